"""Every wrong value is a ValueError naming the field; nothing is allocated for it."""
import pytest

from rollout import Rollout, SamplingParams
from rollout.config import DEFAULT_MODEL_PATH, EngineConfig

BAD_PARAMS = [
    ("temperature", -0.1), ("temperature", "hot"), ("temperature", float("nan")), ("top_p", 0.0),
    ("top_p", 1.5), ("top_k", -2), ("top_k", 1.5), ("min_p", 2.0), ("max_new_tokens", -1),
    ("max_new_tokens", True), ("min_new_tokens", -3), ("n", 0), ("n", 5000), ("sampling_seed", -1),
    ("stop", 5), ("stop", [""]), ("stop_token_ids", [-1]), ("stop_token_ids", "x"), ("ignore_eos", "yes"),
    ("logprob_mode", "weird"), ("frequency_penalty", 3.0), ("repetition_penalty", 0.0), ("no_such_field", 1),
    ("stream_interval", 0), ("stream_interval", 1.5),
]


@pytest.mark.parametrize("field,value", BAD_PARAMS)
def test_sampling_params_errors_name_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams.from_any({field: value})


def test_min_above_max():
    with pytest.raises(ValueError, match="min_new_tokens"):
        SamplingParams(min_new_tokens=5, max_new_tokens=2)


@pytest.mark.parametrize("field,value", [("dtype", "int8"), ("max_running_requests", 0), ("chunked_prefill_size", 2.5),
                                         ("device", "tpu"), ("dp_size", 0), ("max_total_tokens", 1),
                                         ("decode_graph_batch_sizes", [0]), ("enable_prefix_caching", "no"),
                                         ("stream_interval", 0)])
def test_config_errors_name_field(field, value):
    with pytest.raises(ValueError, match=field):
        EngineConfig(**{field: value})


def test_missing_gpus_are_named_at_start():
    """A config may name GPUs this machine lacks; starting an engine on it says so (no hang)."""
    import torch

    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    with pytest.raises(ValueError, match=r"device='cuda:%d'" % have):
        Rollout(config=EngineConfig(device=f"cuda:{have}"))
    want = max(2, have + 1)
    with pytest.raises(ValueError, match=rf"dp_size={want} .* one GPU per DP rank .* {have} are visible"):
        Rollout(config=EngineConfig(device="cuda", dp_size=want))


@pytest.fixture(scope="module")
def engine(tiny_checkpoint):
    with Rollout(str(tiny_checkpoint("qwen3_moe")), tokenizer_path=DEFAULT_MODEL_PATH, dtype="float32",
                 max_total_tokens=300, context_length=128) as eng:
        yield eng


@pytest.mark.parametrize("kwargs,field", [
    (dict(input_ids=[[1, 2, 300]]), "input_ids"),
    (dict(input_ids=[[1, -2]]), "input_ids"),
    (dict(input_ids=[[]]), "input_ids"),
    (dict(input_ids=[["a"]]), "input_ids"),
    (dict(input_ids=[list(range(3, 131))]), "context"),
    (dict(input_ids=[[1, 2]], prompts=["x"]), "prompts"),
    (dict(), "prompts"),
    (dict(input_ids=[[1, 2]], sampling_params={"max_new_tokens": 299}), "max_new_tokens"),
    (dict(input_ids=[[1, 2]], sampling_params={"stop_token_ids": [999]}), "stop_token_ids"),
    (dict(input_ids=[[1, 2]], sampling_params=[{}, {}]), "sampling_params"),
    (dict(input_ids=[[1, 2]], return_logprob="yes"), "return_logprob"),
    (dict(input_ids=[[1, 2]], top_logprobs_num=-1), "top_logprobs_num"),
    (dict(input_ids=[[1, 2]], return_routed_experts=True), "return_routed_experts"),
    (dict(input_ids=[[1, 2]], routed_experts_start_len=3), "routed_experts_start_len"),
    (dict(input_ids=[[1, 2]], rid=5), "rid"),
    (dict(input_ids=[[1, 2], [3, 4]], rid=["a", "a"]), "rid"),
])
def test_generate_errors_name_field(engine, kwargs, field):
    with pytest.raises(ValueError, match=field):
        engine.generate(**kwargs)
    engine.check_integrity()
    assert engine.stats()["kv_used"] == 0 and engine.stats()["waiting"] == 0


def test_huge_prompt_text_is_refused_by_name_before_tokenizing(engine, monkeypatch):
    import gc

    import psutil

    huge = "the quick brown fox " * 1_500_000          # 30 MB
    limit = engine.tokenizer.max_chars(engine.context_length)
    encoded = []
    real = engine.tokenizer.encode
    monkeypatch.setattr(engine.tokenizer, "encode", lambda text: encoded.append(len(text)) or real(text))
    gc.collect()
    before = psutil.Process().memory_info().rss
    with pytest.raises(ValueError) as err:
        engine.generate(["a short one", huge], {"max_new_tokens": 2})
    msg = str(err.value)
    assert msg.startswith(f"prompts[1] has {len(huge)} characters") and f"({limit} characters)" in msg, msg
    assert encoded == []                                # refused before any prompt was tokenized
    gc.collect()
    assert psutil.Process().memory_info().rss - before < 150 * 2**20
    ok = "x" * (limit // 4)                             # under the bound: tokenized, then the token count decides
    with pytest.raises(ValueError, match=r"prompts\[0\] has \d+ tokens"):
        engine.generate(ok, {"max_new_tokens": 2})
    assert encoded == [len(ok)]
    engine.check_integrity()
    assert engine.stats()["kv_used"] == 0 and engine.stats()["waiting"] == 0
