"""The `openai` client itself (sync and async) against a real rollout-serve: /v1/completions and
/v1/chat/completions with routing from `sglext` checked against transformers' router top-k,
`echo` (prompt logprobs against transformers'), n > 1, streaming, the context-length check and
errors as BadRequestError naming the field; and 20 concurrent first chat requests on a fresh server."""
import asyncio
import base64

import numpy as np
import openai
import pytest
import torch

from oracle import hf_logprobs, hf_router_topk, same_sets
from rollout.config import DEFAULT_MODEL_PATH
from server_proc import ServerProcess

pytestmark = pytest.mark.timeout(600)
L, K = 4, 4
MODEL = "tiny-moe"
PROMPT = [15, 99, 301, 7, 42, 256, 88, 19]
GREEDY = dict(temperature=0, max_tokens=6)
NO_EOS = {"ignore_eos": True}


@pytest.fixture(scope="module")
def server():
    with ServerProcess(["--enable-return-routed-experts", "--dtype", "float32", "--context-length", "256"]) as srv:
        yield srv
        assert srv.alive, srv.log()


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c


def routing_rows(ext, rows):
    return torch.from_numpy(np.frombuffer(base64.b64decode(ext["routed_experts"]), dtype="<i4").reshape(rows, L, K).copy())


def check_routing(ext, prompt_ids, output_ids):
    seq = list(prompt_ids) + list(output_ids)
    assert same_sets(routing_rows(ext, len(seq) - 1), hf_router_topk(DEFAULT_MODEL_PATH, seq[:-1], K, L))


def test_completions_routing_from_sglext(client):
    r = client.completions.create(model=MODEL, prompt=PROMPT, **GREEDY,
                                  extra_body={"return_routed_experts": True, "return_token_ids": True, **NO_EOS})
    body = r.model_dump()
    choice = body["choices"][0]
    assert len(choice["token_ids"]) == 6 and choice["prompt_token_ids"] == PROMPT
    check_routing(body["sglext"], PROMPT, choice["token_ids"])


def test_completions_n_greater_than_one(client):
    r = client.completions.create(model=MODEL, prompt=PROMPT, n=3, temperature=1.0, max_tokens=5, seed=7,
                                  extra_body={"return_routed_experts": True, "return_token_ids": True, **NO_EOS})
    body = r.model_dump()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    for c in body["choices"]:
        check_routing(c["sglext"], PROMPT, c["token_ids"])
    assert body["sglext"] == body["choices"][0]["sglext"]


def test_completions_echo_with_prompt_logprobs(client):
    plain = client.completions.create(model=MODEL, prompt=PROMPT, **GREEDY, logprobs=0, extra_body=NO_EOS)
    r = client.completions.create(model=MODEL, prompt=PROMPT, **GREEDY, logprobs=0, echo=True,
                                  extra_body={"return_token_ids": True, **NO_EOS})
    choice = r.choices[0]
    prompt_text = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0, echo=True).choices[0].text
    assert choice.text == prompt_text + plain.choices[0].text and choice.text != plain.choices[0].text
    lps = choice.logprobs.token_logprobs
    assert len(lps) == len(PROMPT) + 6 and lps[0] is None
    want = hf_logprobs(DEFAULT_MODEL_PATH, PROMPT[:1], PROMPT[1:])
    assert torch.allclose(torch.tensor(lps[1:len(PROMPT)]), want, atol=1e-3)
    # NOTE: the prompt-logprob prefill runs eagerly: the output logprobs agree to float rounding
    assert torch.allclose(torch.tensor(lps[len(PROMPT):]), torch.tensor(plain.choices[0].logprobs.token_logprobs),
                          atol=1e-4)
    assert choice.logprobs.tokens[len(PROMPT):] == plain.choices[0].logprobs.tokens
    assert choice.logprobs.text_offset == sorted(choice.logprobs.text_offset)


def test_completions_streaming(client):
    whole = client.completions.create(model=MODEL, prompt=PROMPT, **GREEDY, extra_body=NO_EOS).choices[0].text
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, **GREEDY, stream=True,
                                            extra_body={"return_routed_experts": True, **NO_EOS}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole
    ext = [c.model_dump().get("sglext") for c in chunks]
    assert ext[-1] is not None and all(e is None for e in ext[:-1])
    echoed = list(client.completions.create(model=MODEL, prompt="Q: 1+1=", max_tokens=3, stream=True, echo=True,
                                            temperature=0))
    assert "".join(c.choices[0].text for c in echoed if c.choices).startswith("Q: 1+1=")


@pytest.mark.parametrize("kwargs,param", [
    (dict(top_p=5.0), "top_p"),
    (dict(max_tokens=-1), "max_tokens"),
    (dict(extra_body={"routed_experts_format": "bogus"}), "routed_experts_format"),
    (dict(echo=True, logprobs=1, stream=True), "echo"),
])
def test_completions_errors_name_the_field(client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as info:
        r = client.completions.create(model=MODEL, prompt=PROMPT, **{"max_tokens": 4, **kwargs})
        if kwargs.get("stream"):
            list(r)
    assert info.value.status_code == 400 and info.value.param == param, info.value.body


def test_context_length_check(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=250)
    assert "maximum context length of 256 tokens" in str(info.value)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=300)


def test_chat_sync_routing(client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hello there"}],
                                       **GREEDY, extra_body={"return_routed_experts": True, "return_token_ids": True,
                                                             **NO_EOS})
    body = r.model_dump()
    choice = body["choices"][0]
    assert choice["message"]["role"] == "assistant" and len(choice["token_ids"]) == 6
    check_routing(body["sglext"], choice["prompt_token_ids"], choice["token_ids"])
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], top_logprobs=2)
    assert info.value.param == "top_logprobs"


def test_async_client_chat_and_completions(server):
    async def run():
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0,
                                      timeout=120) as c:
            msgs = [{"role": "user", "content": "count"}]
            whole = await c.chat.completions.create(model=MODEL, messages=msgs, **GREEDY, n=2,
                                                    extra_body={"return_routed_experts": True, **NO_EOS})
            stream = await c.chat.completions.create(model=MODEL, messages=msgs, **GREEDY, stream=True,
                                                     extra_body=NO_EOS)
            text = "".join([ch.choices[0].delta.content or "" async for ch in stream if ch.choices])
            comp = await c.completions.create(model=MODEL, prompt=PROMPT, **GREEDY, logprobs=2,
                                              extra_body={"return_routed_experts": True, "return_token_ids": True,
                                                          **NO_EOS})
            return whole, text, comp
    whole, text, comp = asyncio.run(run())
    assert len(whole.choices) == 2 and whole.choices[0].message.content == whole.choices[1].message.content == text
    assert all(c.model_dump()["sglext"]["routed_experts"] for c in whole.choices)
    body = comp.model_dump()
    check_routing(body["sglext"], PROMPT, body["choices"][0]["token_ids"])
    assert all(len(t) <= 2 for t in comp.choices[0].logprobs.top_logprobs)


def test_twenty_concurrent_first_chat_requests_on_a_fresh_server():
    with ServerProcess(["--dtype", "float32"]) as srv:
        async def run():
            async with openai.AsyncOpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0,
                                          timeout=120) as c:
                return await asyncio.gather(*[c.chat.completions.with_raw_response.create(
                    model=MODEL, messages=[{"role": "user", "content": f"question {i}"}], max_tokens=2)
                    for i in range(20)])
        answers = asyncio.run(run())
        assert [a.status_code for a in answers] == [200] * 20
        assert all(a.parse().choices[0].message.role == "assistant" for a in answers)
