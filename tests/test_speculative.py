"""Speculative decoding: outputs with it are the outputs without it (tokens, logprobs, top logprobs,
routing rows; bitwise in deterministic mode), routing rows only for emitted positions, the verify
tokens in the capture buffer's size, SGLang's flags and meta_info counters."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from capture.buffer_sizing import capture_buffer_rows
from oracle import hf_greedy
from rollout.config import DEFAULT_MODEL_PATH, EngineConfig
from rollout.core.drafter import MAX_BACKOFF, draft_budget, ngram_lookup, pace
from test_capture import check_rows
from tiny_models import damped_checkpoint, make_engine, random_prompts, truncated_checkpoint, with_mtp_layer

SPEC = {"speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": 4}


def _prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    """Random prompts whose second half repeats spans of the first (n-gram drafts find matches)."""
    rng = random.Random(seed)
    out = []
    for p in random_prompts(seed, lengths):
        spans = [p[i:i + rng.randrange(3, 9)] for i in sorted(rng.sample(range(len(p)), 3))]
        out.append(p + [t for s in spans for t in s])
    return out


def _params(rng: random.Random) -> list[dict]:
    """Greedy, sampled (top-p, top-k, min-p), penalties and min_new_tokens, EOS allowed or not."""
    return [{"temperature": 0.0, "max_new_tokens": 24, "ignore_eos": True},
            {"temperature": 0.9, "top_p": 0.9, "max_new_tokens": 20, "ignore_eos": True,
             "sampling_seed": rng.randrange(1000)},
            {"temperature": 1.0, "top_k": 20, "min_p": 0.02, "max_new_tokens": 18, "ignore_eos": True,
             "sampling_seed": rng.randrange(1000)},
            {"temperature": 0.7, "max_new_tokens": 22, "frequency_penalty": 0.4, "presence_penalty": 0.2,
             "repetition_penalty": 1.1, "min_new_tokens": 6, "sampling_seed": rng.randrange(1000)},
            {"temperature": 0.0, "max_new_tokens": 30}]


def _run(engine, prompts, params, **kw):
    return engine.generate(input_ids=prompts, sampling_params=params, return_logprob=True, top_logprobs_num=3,
                           return_routed_experts=True, **kw)


def _same(a, b, *, bitwise: bool) -> None:
    assert a.output_ids == b.output_ids, (a.rid, a.output_ids, b.output_ids)
    assert a.finish_reason == b.finish_reason and a.finish_info == b.finish_info
    la, lb = torch.tensor(a.output_logprobs), torch.tensor(b.output_logprobs)
    if bitwise:
        assert torch.equal(la, lb)
        assert a.output_top_logprobs == b.output_top_logprobs
    else:
        assert torch.allclose(la, lb, atol=1e-4)
    assert torch.equal(a.routed_experts, b.routed_experts)


def _workload(engine, seed: int, stop: str | None = None):
    """A GRPO-shaped batch (n samples of one prompt), a mixed batch, and the mixed batch again (its
    prompts now prefix hits), with stop strings when given."""
    rng = random.Random(seed)
    prompts = _prompts(seed, [9, 30, 21, 44, 15])
    params = _params(rng)
    if stop is not None:
        params = [dict(p, stop=[stop]) for p in params]
    group = _run(engine, [prompts[1]] * 4, [dict(params[1], sampling_seed=s) for s in range(4)])
    mixed = _run(engine, prompts, params)
    again = _run(engine, prompts, params)
    return group + mixed + again


def _standalone(draft) -> dict:
    return {"speculative_algorithm": "STANDALONE", "speculative_num_draft_tokens": 4,
            "speculative_draft_model_path": str(draft)}


NEXTN = {"speculative_algorithm": "NEXTN", "speculative_num_draft_tokens": 4}


def _mtp_checkpoint(src, tmp_path, echo: bool = True):
    """src with one MTP layer; echo: on a target whose layers add little to the embeddings (their
    outputs damped), an MTP layer whose drafts hold for greedy requests (tests/tiny_models.py)."""
    if echo:
        src = damped_checkpoint(src, tmp_path / "damped", 0.002)
    return with_mtp_layer(src, tmp_path / "mtp", echo=echo)


# NOTE: NGRAM on one architecture by default; DeepSeek-V3 (MLA, grouped sigmoid routing), DP 2 with
# the static-shape runners and STANDALONE drafts under slow
@pytest.mark.parametrize("arch, draft, kw", [
    ("qwen3_moe", None, {}),
    pytest.param("deepseek_v3", None, {}, marks=pytest.mark.slow),
    pytest.param("qwen3_moe", None, {"dp_size": 2, "max_total_tokens": 130, "decode_graph_batch_sizes": (1, 2, 4, 8),
                                     "prefill_graph_token_sizes": (16, 64)}, marks=pytest.mark.slow, id="dp2-graphs"),
    pytest.param("qwen3_moe", "self", {}, marks=pytest.mark.slow, id="standalone-self"),
    pytest.param("deepseek_v3", "small", {}, marks=pytest.mark.slow, id="standalone-small"),
    pytest.param("deepseek_v3", "nextn", {"decode_graph_batch_sizes": (1, 2, 4, 8), "prefill_graph_token_sizes": (16, 64)},
                 id="nextn-graphs"),
    pytest.param("glm4_moe", "nextn", {}, marks=pytest.mark.slow, id="nextn-glm"),
    pytest.param("deepseek_v3", "nextn", {"dp_size": 2, "max_total_tokens": 130, "decode_graph_batch_sizes": (1, 2, 4, 8),
                                          "prefill_graph_token_sizes": (16, 64)}, marks=pytest.mark.slow,
                 id="nextn-dp2-graphs")])
def test_deterministic_outputs_equal_without_speculation(tiny_checkpoint, tmp_path, arch, draft, kw):
    """Deterministic mode, small prefill chunks, a KV pool small enough to retract: every output with
    drafts (NGRAM, a draft checkpoint: the target itself or a smaller one of its family, or the
    checkpoint's own MTP layer) is bitwise the output without them, and drafts were both kept and
    rejected (the smaller draft is the target's first layer with its embeddings and head)."""
    path = tiny_checkpoint(arch)
    if draft == "nextn":
        path, spec = _mtp_checkpoint(path, tmp_path), NEXTN
    else:
        spec = SPEC if draft is None else _standalone(path if draft == "self" else truncated_checkpoint(path, tmp_path, 1))
    kw = {"enable_deterministic_inference": True, "chunked_prefill_size": 16, "max_total_tokens": 260, **kw}
    outs = {}
    for name, extra in (("plain", {}), ("spec", spec)):
        with make_engine(path, **kw, **extra) as engine:
            outs[name] = _workload(engine, 5)
    for a, b in zip(outs["plain"], outs["spec"]):
        _same(a, b, bitwise=True)
    spec_out = outs["spec"]
    # NOTE: a draft model keeps most drafts: its requests finish in fewer steps, before the pool runs out
    assert draft is not None or any(o.num_retractions for o in spec_out), "the KV pool must force a retraction"
    assert any(o.cached_tokens for o in spec_out), "the repeated batch must hit the prefix cache"
    assert sum(o.spec_num_correct_drafts for o in spec_out) > 0
    assert sum(o.spec_num_proposed_drafts - o.spec_num_correct_drafts for o in spec_out) > 0
    for o in spec_out:
        meta = o.meta_info()
        assert meta["spec_verify_ct"] == o.spec_verify_ct >= 1
        assert meta["spec_accept_length"] == pytest.approx(o.completion_tokens / o.spec_verify_ct)
        assert 0 <= meta["spec_num_correct_drafts"] <= meta["spec_num_proposed_drafts"]
    assert all(o.spec_verify_ct == 0 and "spec_verify_ct" not in o.meta_info() for o in outs["plain"])


def test_stop_strings_inside_a_verified_run(tiny_checkpoint):
    """A stop string completed by a token in the middle of a verified run ends the output there, as
    decoding one token at a time does (the front end cuts the run's later tokens and rows)."""
    path = tiny_checkpoint("qwen3_moe")
    kw = dict(enable_deterministic_inference=True, tokenizer_path=DEFAULT_MODEL_PATH)
    prompts = _prompts(8, [12, 25])
    greedy = {"temperature": 0.0, "max_new_tokens": 24, "ignore_eos": True}
    outs = {}
    for name, spec in (("plain", {}), ("ngram", SPEC)):
        with make_engine(path, **kw, **spec) as engine:
            if name == "plain":
                text = engine.generate(input_ids=prompts[:1], sampling_params=greedy)[0].text
                stop = text[len(text) // 2:len(text) // 2 + 2]
                assert stop.strip(), text
                params = [dict(greedy, stop=[stop]), dict(greedy, stop=[stop], temperature=0.8, sampling_seed=3)]
            outs[name] = _run(engine, prompts, params)
    for a, b in zip(outs["plain"], outs["ngram"]):
        _same(a, b, bitwise=True)
        assert a.text == b.text
    assert outs["ngram"][0].finish_reason == "stop" and outs["ngram"][0].finish_info["matched"] == stop


@pytest.mark.parametrize("draft", [None, "self"])
def test_default_mode_greedy_equal_and_rows_are_the_routers(tiny_checkpoint, draft):
    """Default kernels: greedy tokens with drafts (NGRAM, or the target as its own STANDALONE draft:
    every draft kept, the mechanism's ceiling) equal those without and transformers'; every emitted
    token's routing rows are transformers' router top-k."""
    path = tiny_checkpoint("qwen3_moe")
    prompts = _prompts(3, [7, 26, 40])
    greedy = {"temperature": 0.0, "max_new_tokens": 20, "ignore_eos": True}
    outs = {}
    for name, spec in (("plain", {}), ("spec", SPEC if draft is None else _standalone(path))):
        with make_engine(path, **spec) as engine:
            outs[name] = _run(engine, prompts, greedy)
    for a, b, prompt in zip(outs["plain"], outs["spec"], prompts):
        assert a.output_ids == b.output_ids == hf_greedy(path, prompt, 20)
        check_rows(path, b)
        if draft == "self":
            assert b.spec_num_correct_drafts == b.spec_num_proposed_drafts > 0
    assert sum(o.spec_num_correct_drafts for o in outs["spec"]) > 0


def test_nextn_default_mode_greedy_and_rows_are_transformers(tiny_checkpoint, tmp_path):
    """Default kernels, NEXTN on DeepSeek-V3 (its MTP layer's greedy drafts hold): greedy tokens are
    transformers' and every routing row (prompt and output) is its grouped router's."""
    from test_deepseek_glm import assert_matches_hf

    path = _mtp_checkpoint(tiny_checkpoint("deepseek_v3"), tmp_path)
    prompts = _prompts(6, [11, 29])
    greedy = {"temperature": 0.0, "max_new_tokens": 20, "ignore_eos": True}
    with make_engine(path, **NEXTN) as engine:
        outs = _run(engine, prompts, greedy)
    for prompt, out in zip(prompts, outs):
        assert out.spec_num_correct_drafts > 0
        assert_matches_hf(str(path), prompt, out)


class WrongDrafter:
    """Drafts that are never the target's tokens: each is one past the token greedy decoding emits
    there (known from a run without speculation)."""

    def __init__(self, expected: dict[tuple, list[int]], vocab: int, k: int):
        self.expected, self.vocab, self.k = expected, vocab, k
        self.proposed = 0

    def propose(self, reqs, step):
        out = []
        for req in reqs:
            ref = self.expected[tuple(req.prompt_ids)]
            n = len(req.output_ids)
            drafts = [(t + 1) % self.vocab for t in ref[n:n + draft_budget(req, self.k, step)]]
            self.proposed += len(drafts)
            out.append(drafts)
        return out

    def release(self, req) -> None:
        """Holds nothing per request."""


def test_always_wrong_drafts_keep_rows_exact(tiny_checkpoint):
    """Drafts that are always rejected: the tokens and rows are still exact (transformers' router
    top-k), and the host store receives exactly one row per kept position, never a rejected one."""
    path = tiny_checkpoint("qwen3_moe")
    prompts = random_prompts(21, [6, 19, 33])
    greedy = {"temperature": 0.0, "max_new_tokens": 16, "ignore_eos": True}
    with make_engine(path) as engine:
        plain = _run(engine, prompts, greedy)
    expected = {tuple(o.prompt_ids): o.output_ids for o in plain}
    with make_engine(path, client="inproc", enable_prefix_caching=False, **SPEC) as engine:
        drafter = WrongDrafter(expected, 256, 3)
        written = []

        def install(core):
            core.scheduler.drafter = drafter
            store = core.capturer.store
            original = store.write
            store.write = lambda slots, rows: (written.append(int(slots.numel())), original(slots, rows))[1]
        engine.debug(install)
        outs = _run(engine, prompts, greedy)
    assert drafter.proposed > 0
    for a, b in zip(plain, outs):
        assert a.output_ids == b.output_ids
        assert b.spec_num_correct_drafts == 0 and b.spec_num_proposed_drafts > 0
        check_rows(path, b)
    # every position whose input was emitted (the prompt and all outputs but the last) has one row
    assert sum(written) == sum(len(o.prompt_ids) + len(o.output_ids) - 1 for o in outs)


def test_verify_tokens_size_the_capture_buffer(tiny_checkpoint):
    """Invariant 1 with speculation: a decode step carries max_running x num_draft_tokens tokens; a
    buffer cap below that is refused at startup, naming the values."""
    cfg = EngineConfig(max_running_requests=64, chunked_prefill_size=128, speculative_algorithm="NGRAM",
                       speculative_num_draft_tokens=6)
    assert capture_buffer_rows(cfg.shape_limits(512)) == 64 * 6
    path = tiny_checkpoint("qwen3_moe")
    with pytest.raises(ValueError, match=r"speculative_num_draft_tokens\).*max_capture_buffer_rows=256"):
        with make_engine(path, max_running_requests=64, chunked_prefill_size=128, max_capture_buffer_rows=256,
                         speculative_algorithm="NGRAM", speculative_num_draft_tokens=6):
            pass
    with make_engine(path, max_running_requests=64, chunked_prefill_size=128, max_capture_buffer_rows=384,
                     speculative_algorithm="NGRAM", speculative_num_draft_tokens=6):
        pass


def test_pace_backs_off_failing_drafts_and_grows_holding_ones():
    from rollout.core.request import Req
    from rollout.sampling_params import SamplingParams

    req = Req(uid=0, rid="r", prompt_ids=[5] * 10, params=SamplingParams(max_new_tokens=1000), seed=0,
              max_total_len=4096)
    assert draft_budget(req, 3, 1) == 1   # one draft to start
    pace(req, 1, 1)
    assert draft_budget(req, 3, 1) == 2
    pace(req, 2, 2)
    assert draft_budget(req, 3, 1) == 3
    tried = []
    for step in range(1, 400):   # every draft fails: it drafts at multiples of 4, 8, .. 64 only
        k = draft_budget(req, 3, step)
        if k:
            tried.append((step, k))
            pace(req, k, 0)
    assert tried == [(1, 3), (4, 1), (8, 1), (16, 1), (32, 1), (64, 1), (128, 1), (192, 1),
                     (256, 1), (320, 1), (384, 1)] and MAX_BACKOFF == 64
    pace(req, 1, 1)              # the one draft held: two next, then up to the most allowed
    assert draft_budget(req, 3, 401) == 2
    pace(req, 2, 2)
    assert draft_budget(req, 3, 402) == 3
    pace(req, 3, 1)
    assert draft_budget(req, 3, 403) == 2
    req.output_ids = [7] * 998   # room for 2 more tokens: at most one draft
    assert draft_budget(req, 3, 404) == 1


def _lookup_reference(seq: list[int], lo: int, hi: int, k: int) -> list[int]:
    n = len(seq)
    for length in range(min(hi, n - 1), lo - 1, -1):
        suffix = seq[n - length:]
        for end in range(n - 2, length - 2, -1):
            if seq[end - length + 1:end + 1] == suffix:
                ext = list(seq)
                while len(ext) < n + k:   # the match predicts ext[end + 1 + i]; past n, its own drafts
                    ext.append(ext[end + 1 + len(ext) - n])
                return ext[n:n + k]
    return []


def test_ngram_lookup_matches_its_definition():
    rng = random.Random(0)
    for _ in range(400):
        seq = [rng.randrange(4) for _ in range(rng.randrange(1, 40))]
        lo, hi, k = rng.randrange(1, 4), rng.randrange(1, 8), rng.randrange(0, 6)
        hi = max(lo, hi)
        assert ngram_lookup(np.array(seq, dtype=np.int64), lo, hi, k) == _lookup_reference(seq, lo, hi, k), (seq, lo, hi, k)


@pytest.mark.parametrize("kw, message", [
    ({"speculative_algorithm": "EAGLE", "speculative_draft_model_path": "/x"}, "EAGLE draft heads are not supported"),
    ({"speculative_algorithm": "EAGLE3"}, "EAGLE3 draft heads are not supported"),
    ({"speculative_algorithm": "NEXTN", "model_path": "/m", "speculative_draft_model_path": "/x"},
     "NEXTN reads the MTP layers of model_path's own checkpoint"),
    ({"speculative_algorithm": "MEDUSA"}, r"speculative_algorithm must be one of \('NGRAM', 'STANDALONE', 'NEXTN'\)"),
    ({"speculative_num_draft_tokens": 4}, "needs speculative_algorithm"),
    ({"speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": 1},
     r"speculative_num_draft_tokens must be an integer in \[2, 64\]"),
    ({"speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": 5, "speculative_num_steps": 2},
     "must be speculative_num_steps \\+ 1 = 3"),
    ({"speculative_algorithm": "NGRAM", "speculative_eagle_topk": 4}, "tree drafts are not supported"),
    ({"speculative_algorithm": "STANDALONE"}, "needs speculative_draft_model_path"),
    ({"speculative_algorithm": "NGRAM", "speculative_draft_model_path": "/x"}, "read only by"),
    ({"speculative_algorithm": "NGRAM", "speculative_ngram_min_match_window_size": 4,
      "speculative_ngram_max_match_window_size": 2}, "speculative_ngram_max_match_window_size must be"),
])
def test_bad_speculative_settings_are_refused_by_name(kw, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**kw)


def test_speculative_settings_resolve():
    assert EngineConfig().verify_tokens_per_request == 1
    # SGLang runs EAGLE on a checkpoint's own MTP layers (no separate draft) as NEXTN
    assert EngineConfig(speculative_algorithm="EAGLE").speculative_algorithm == "NEXTN"
    assert EngineConfig(model_path="/m", speculative_algorithm="EAGLE",
                        speculative_draft_model_path="/m").speculative_algorithm == "NEXTN"
    assert EngineConfig(speculative_algorithm="ngram").speculative_algorithm == "NGRAM"
    assert EngineConfig(speculative_algorithm="NGRAM").verify_tokens_per_request == 4
    assert EngineConfig(speculative_algorithm="NGRAM", speculative_num_steps=6).verify_tokens_per_request == 7
    assert EngineConfig(speculative_algorithm="NGRAM", speculative_num_draft_tokens=3,
                        speculative_eagle_topk=1).verify_tokens_per_request == 3


def test_kv_budget_counts_the_drafts_memory(tiny_checkpoint, tmp_path):
    """The KV cache's bytes hold the draft's memory per slot too: a STANDALONE draft's own KV (the
    target as its draft: twice the bytes per slot), NEXTN's hidden state and MTP layer's KV."""
    from rollout.batch.kv_pool import KVPool
    from rollout.core.engine_core import EngineCore
    from rollout.models.registry import model_info

    budget = 1 << 20

    def slots(path, **spec) -> int:
        cfg = EngineConfig(model_path=str(path), tokenizer_path=DEFAULT_MODEL_PATH, dtype="float32",
                           kv_cache_bytes=budget, **spec)
        core = EngineCore(cfg)
        return core.kv_capacity

    def per_slot(info, layers: int, hidden: int = 0) -> int:
        return KVPool.bytes_per_slot(num_layers=layers, num_kv_heads=info.num_kv_heads, head_dim=info.head_dim,
                                     dtype=torch.float32, latent_dim=info.kv_latent_dim, hidden_size=hidden)

    qwen = tiny_checkpoint("qwen3_moe")
    info = model_info(qwen)
    assert slots(qwen, **SPEC) == budget // per_slot(info, info.num_hidden_layers)
    assert slots(qwen, **_standalone(qwen)) == budget // (2 * per_slot(info, info.num_hidden_layers))
    mtp = _mtp_checkpoint(tiny_checkpoint("deepseek_v3"), tmp_path, echo=False)
    info = model_info(mtp)
    assert slots(mtp, **NEXTN) == budget // per_slot(info, info.num_hidden_layers + 1, info.hidden_size)


def test_draft_with_another_vocabulary_is_refused_at_startup(tiny_checkpoint):
    from rollout.core.engine_core import EngineCore

    cfg = EngineConfig(model_path=str(tiny_checkpoint("qwen3_moe")), tokenizer_path=DEFAULT_MODEL_PATH,
                       dtype="float32", **_standalone(tiny_checkpoint("qwen3_moe", vocab_size=320)))
    with pytest.raises(ValueError, match="the draft's vocab_size 320 is not the target's 256"):
        EngineCore(cfg)


def test_server_reports_speculation(tmp_path):
    """rollout-serve --speculative-algorithm NGRAM: SGLang's meta_info counters on /generate, a
    stream whose chunks add up to the non-streamed answer, and the acceptance histogram on /metrics."""
    import httpx

    from server_proc import ServerProcess, sse_events

    body = {"text": "Q: 12+7= A: 19. Q: 12+7= A: 19. Q: 12+7= A:", "return_logprob": True,
            "return_routed_experts": True, "sampling_params": {"temperature": 0, "max_new_tokens": 24,
                                                              "ignore_eos": True}}
    with ServerProcess(["--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "5",
                        "--enable-return-routed-experts"]) as srv, httpx.Client(timeout=60) as c:
        one = c.post(f"{srv.url}/generate", json=body).json()
        meta = one["meta_info"]
        assert meta["spec_verify_ct"] >= 1 and meta["completion_tokens"] == 24
        assert meta["spec_accept_length"] == pytest.approx(24 / meta["spec_verify_ct"])
        assert 0 <= meta["spec_num_correct_drafts"] <= meta["spec_num_proposed_drafts"]
        with c.stream("POST", f"{srv.url}/generate", json={**body, "stream": True,
                                                             "incremental_streaming_output": True}) as r:
            chunks = list(sse_events(r))
        assert [t for ch in chunks for t in ch["output_ids"]] == one["output_ids"]
        assert chunks[-1]["meta_info"]["spec_verify_ct"] == meta["spec_verify_ct"]
        metrics = c.get(f"{srv.url}/metrics").text
        counts = [line for line in metrics.splitlines() if line.startswith("rollout_spec_accept_length_count")]
        assert counts and float(counts[0].split()[-1]) >= 2 * meta["spec_verify_ct"] - 2
        assert "sglang:spec_accept_length{" in metrics


def test_nextn_through_a_real_server_is_the_plain_server(tiny_checkpoint, tmp_path):
    """rollout-serve --speculative-algorithm NEXTN on a checkpoint with an MTP layer, sent a GRPO
    group as slime sends it (one concurrent /generate per sample, logprobs and routing asked) and a
    streamed greedy request: in deterministic mode every answer is bitwise the plain server's
    (tokens, logprobs, routing rows), drafts were kept, and the stream adds up to the answer."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    from rollout.config import DEFAULT_MODEL_PATH
    from server_proc import ServerProcess, sse_events

    path = _mtp_checkpoint(tiny_checkpoint("deepseek_v3"), tmp_path)
    prompt = _prompts(6, [25])[0]
    payloads = [{"input_ids": prompt, "return_logprob": True, "return_routed_experts": True,
                 "sampling_params": {"temperature": 0.0 if s == 0 else 1.0, "sampling_seed": s, "max_new_tokens": 16,
                                     "ignore_eos": True}} for s in range(4)]
    flags = ["--model-path", str(path), "--tokenizer-path", DEFAULT_MODEL_PATH, "--dtype", "float32",
             "--enable-return-routed-experts", "--enable-deterministic-inference"]
    answers, streamed = {}, {}
    for name, extra in (("plain", []), ("nextn", ["--speculative-algorithm", "NEXTN",
                                                   "--speculative-num-draft-tokens", "4"])):
        with ServerProcess(flags + extra) as srv, httpx.Client(base_url=srv.url, timeout=120) as c, \
                ThreadPoolExecutor(len(payloads)) as pool:
            replies = list(pool.map(lambda p: c.post("/generate", json=p), payloads))
            assert all(r.status_code == 200 for r in replies), [r.text for r in replies]
            answers[name] = [r.json() for r in replies]
            with c.stream("POST", "/generate", json={**payloads[0], "stream": True,
                                                     "incremental_streaming_output": True}) as r:
                streamed[name] = [t for ch in sse_events(r) for t in ch["output_ids"]]

    def same(meta: dict) -> dict:   # NOTE: timing, and which sample's prompt was cached first
        return {k: v for k, v in meta.items() if not k.startswith("spec_") and k not in ("e2e_latency", "id",
                                                                                           "cached_tokens")}

    for a, b in zip(answers["plain"], answers["nextn"], strict=True):
        assert a["output_ids"] == b["output_ids"]
        assert same(a["meta_info"]) == same(b["meta_info"])
        assert b["meta_info"]["routed_experts"]
    assert sum(b["meta_info"]["spec_num_correct_drafts"] for b in answers["nextn"]) > 0
    assert streamed["nextn"] == streamed["plain"] == answers["plain"][0]["output_ids"]


def test_abort_mid_run_returns_an_exact_prefix(tiny_checkpoint):
    """A request aborted while it speculates: its partial output, logprobs and routing rows are the
    start of the output without speculation, and no KV slot is left behind."""
    path = tiny_checkpoint("qwen3_moe")
    prompt = _prompts(4, [30])[0]
    params = {"temperature": 0.0, "max_new_tokens": 200, "ignore_eos": True}
    with make_engine(path, enable_deterministic_inference=True) as engine:
        full = _run(engine, [prompt], params)[0]
    with make_engine(path, enable_deterministic_inference=True, client="inproc", **SPEC) as engine:
        seen = []
        for chunk in engine.generate(input_ids=[prompt], sampling_params=params, return_logprob=True,
                                     top_logprobs_num=3, return_routed_experts=True, stream=True, rid="a"):
            seen.append(len(chunk.output_ids))
            if sum(seen) >= 20 and not chunk.finished:
                engine.abort("a")
            part = chunk.output or None
        assert engine.debug(lambda core: core.flush_cache() and core.check_integrity() and core.kv_pool.used() == 0)
    assert part.finish_reason == "abort" and 20 <= len(part.output_ids) < 200
    n = len(part.output_ids)
    assert part.output_ids == full.output_ids[:n]
    assert part.output_logprobs == full.output_logprobs[:n] and part.output_top_logprobs == full.output_top_logprobs[:n]
    assert torch.equal(part.routed_experts, full.routed_experts[:len(prompt) + n - 1])


# ---- NEXTN: the checkpoint's MTP layer -------------------------------------------------------------
def _hf_mtp_reference(path, seq: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' own modules: the target's final-normed hidden states h [n, H] of seq, and the MTP
    layer's logits [n - 1, V] at positions 0 .. n-2 (eh_proj over enorm(embed(t_{i+1})) and hnorm(h_i),
    transformers' decoder layer of the checkpoint's class with a causal mask, shared_head.norm, lm_head)."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, attn_implementation="eager").eval()
    cfg, n_layer = hf.config, hf.config.num_hidden_layers
    prefix = f"model.layers.{n_layer}."
    own = {k[len(prefix):]: v for k, v in load_file(str(path / "mtp.safetensors")).items()}
    layer = type(hf.model.layers[-1])(cfg, n_layer).eval()
    layer.load_state_dict({k: v for k, v in own.items() if k.startswith(("self_attn.", "mlp.", "input_layernorm",
                                                                          "post_attention_layernorm"))})

    def norm(name):
        m = type(hf.model.norm)(cfg.hidden_size, eps=cfg.rms_norm_eps)
        m.weight.data.copy_(own[f"{name}.weight"])
        return m

    with torch.no_grad():
        ids = torch.tensor([seq])
        h = hf.model(ids).last_hidden_state[0]
        x = torch.cat((norm("enorm")(hf.model.embed_tokens(ids[0, 1:])), norm("hnorm")(h[:-1])), dim=-1)
        x = (x @ own["eh_proj.weight"].T)[None]
        n = x.shape[1]
        pos = torch.arange(n)[None]
        mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
        out = layer(x, attention_mask=mask, position_ids=pos, position_embeddings=hf.model.rotary_emb(x, pos))
        out = out[0] if isinstance(out, tuple) else out
        return h, hf.lm_head(norm("shared_head.norm")(out[0]))


@pytest.mark.parametrize("arch", ["deepseek_v3", pytest.param("glm4_moe", marks=pytest.mark.slow)])
def test_mtp_layer_is_transformers_decoder_layer(tiny_checkpoint, tmp_path, arch):
    """The MTP layer as loaded with the model (checkpoint names model.layers.{N}.*) computes what
    transformers' own modules compute from the same tensors, at every position."""
    from rollout.core.draft_kv import DraftKV
    from rollout.models.registry import load_model

    path = _mtp_checkpoint(tiny_checkpoint(arch), tmp_path, echo=False)
    seq = random_prompts(3, [21])[0]
    h, ref = _hf_mtp_reference(path, seq)
    model, _ = load_model(path, "float32", "cpu", mtp=True)
    spec = model.mtp.spec
    kv = DraftKV(num_slots=64, num_layers=1, num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim,
                 latent_dim=spec.info.kv_latent_dim, dtype=torch.float32, device=torch.device("cpu"),
                 max_requests=1, context_length=64)
    seqs = [kv.seq(type("R", (), {"draft_state": None})())]
    # two extends (chunks) over the MTP's own KV: positions 0..9, then 10..19
    got = []
    for lo, hi in ((0, 10), (10, len(seq) - 1)):
        fb = kv.forward_batch(seqs, seq[lo + 1:hi + 1], [lo], [hi - lo])
        got.append(model.mtp.logits(model.mtp(fb, h[lo:hi])))
    torch.testing.assert_close(torch.cat(got), ref, atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("arch, kw", [
    ("deepseek_v3", {}),
    # the decode steps without drafts run compiled buckets: their hidden states are the compiled graph's
    ("glm4_moe", {"enable_torch_compile": True, "decode_graph_batch_sizes": (1, 2)})])
def test_nextn_feeds_the_targets_hidden_states(tiny_checkpoint, tmp_path, arch, kw):
    """Every position the MTP layer is fed with the target's state gets the token after it and the
    target's final-normed hidden state there (transformers' own forward), prefix-cache hits included
    (their hidden states sit in the shared slots)."""
    from transformers import AutoModelForCausalLM

    path = _mtp_checkpoint(tiny_checkpoint(arch), tmp_path, echo=False)
    prompts = random_prompts(8, [12, 27])
    greedy = {"temperature": 0.0, "max_new_tokens": 12, "ignore_eos": True}
    fed = []
    with make_engine(path, client="inproc", **NEXTN, **kw) as engine:
        def install(core):
            drafter = core.scheduler.drafter
            propose, forward, first = drafter.propose, drafter.model.forward, [False]

            def recording_propose(reqs, step):
                first[0] = True
                return propose(reqs, step)

            def recording_forward(fb, hidden):
                if first[0]:   # the proposal's extend: the positions fed with the target's hidden states
                    fed.append((fb.positions.tolist(), fb.input_ids.tolist(), hidden.clone()))
                    first[0] = False
                return forward(fb, hidden)
            drafter.propose, drafter.model.forward = recording_propose, recording_forward
        engine.debug(install)
        outs = _run(engine, prompts, greedy) + _run(engine, prompts, greedy)
    assert any(o.cached_tokens for o in outs[2:]), "the repeated prompts must hit the prefix cache"
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    seqs = []
    for o in outs[:2]:
        seq = list(o.prompt_ids) + list(o.output_ids)
        with torch.no_grad():
            seqs.append((seq, hf.model(torch.tensor([seq])).last_hidden_state[0]))
    rows = 0
    for positions, ids, hidden in fed:
        for p, t, hv in zip(positions, ids, hidden):
            assert any(p + 1 < len(seq) and seq[p + 1] == t and torch.allclose(hv, hs[p], atol=1e-4)
                       for seq, hs in seqs), (p, t)
            rows += 1
    # each request's MTP sees its whole prompt once per run: the second run's from the cached slots
    assert sum(1 for positions, _, _ in fed for p in positions if p == 0) == 4
    assert rows >= 2 * sum(len(p) for p in prompts)


@pytest.mark.parametrize("arch, nextn", [("qwen3_moe", 0), ("deepseek_v3", 1)])
def test_nextn_refused_without_mtp_layers(tiny_checkpoint, arch, nextn):
    """A checkpoint without MTP tensors (whatever its config says) is refused at startup, by name."""
    with pytest.raises(ValueError, match=rf"'NEXTN' needs .*num_nextn_predict_layers={nextn} and 0 tensors "
                                         rf"model\.layers\.3\.\*"):
        with make_engine(tiny_checkpoint(arch), **NEXTN):
            pass


def test_nextn_weight_updates_and_memory_release_reach_the_mtp_layer(tiny_checkpoint, tmp_path):
    """The MTP layer's tensors are the model's: an update of model.layers.{N}.eh_proj.weight changes
    its drafts (the echo layer's greedy drafts all held; with eh_proj zero they fail) and never the
    outputs; release_memory_occupation frees its KV and weights with the target's and resume brings
    the same drafts back."""
    path = _mtp_checkpoint(tiny_checkpoint("deepseek_v3"), tmp_path)
    prompts = random_prompts(9, [14, 23])
    greedy = {"temperature": 0.0, "max_new_tokens": 16, "ignore_eos": True}
    with make_engine(path, client="inproc", **NEXTN) as engine:
        before = _run(engine, prompts, greedy)
        engine.release_memory_occupation()
        engine.resume_memory_occupation()
        resumed = _run(engine, prompts, greedy)
        engine.swap_weights({"model.layers.3.eh_proj.weight": torch.zeros(64, 128)})
        assert engine.debug(lambda core: bool((core.model.mtp.eh_proj.weight == 0).all()))
        after = _run(engine, prompts, greedy)
        assert engine.debug(lambda core: core.check_integrity() or True)
    for a, b, c in zip(before, resumed, after):
        assert a.output_ids == b.output_ids == c.output_ids
        assert a.spec_num_correct_drafts == a.spec_num_proposed_drafts > 0
        assert b.spec_num_correct_drafts == a.spec_num_correct_drafts
    assert sum(c.spec_num_correct_drafts for c in after) < sum(a.spec_num_correct_drafts for a in before) / 2
