"""attention_backend: config and flag validation, and the engine end to end on the embedded model
with the Triton kernels (under the interpreter on CPU) against the torch backend: greedy tokens
and every routing row equal, with prefix-cache hits, chunked prefill, the GRPO cascade, the
static-shape runners and dp_size=2."""
import importlib.util
import subprocess
import sys

import pytest
import torch

from rollout import Rollout
from rollout.config import EngineConfig
from rollout.config.backends import check_attention_backend
from rollout.server.args import ServerArgs
from tiny_models import random_prompts as prompts

GREEDY = {"temperature": 0.0, "ignore_eos": True}
HAS_FLASHINFER = importlib.util.find_spec("flashinfer") is not None


def test_config_resolves_by_device_and_names_the_field():
    assert EngineConfig().resolved_attention_backend == "torch"
    assert EngineConfig(device="cuda").resolved_attention_backend == ("flashinfer" if HAS_FLASHINFER else "triton")
    assert EngineConfig(attention_backend="triton").resolved_attention_backend == "triton"
    with pytest.raises(ValueError, match=r"attention_backend must be one of \('torch', 'triton', 'flashinfer'\)"):
        EngineConfig(attention_backend="sdpa")


def test_unavailable_backends_are_value_errors(monkeypatch):
    with pytest.raises(ValueError, match="attention_backend='flashinfer' needs a CUDA device"):
        Rollout(attention_backend="flashinfer")
    if not HAS_FLASHINFER:
        with pytest.raises(ValueError, match="attention_backend='flashinfer' but flashinfer is not installed"):
            check_attention_backend("flashinfer", "cuda")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="attention_backend='triton' on device='cpu' runs only under"):
        Rollout(attention_backend="triton")


def test_flag():
    assert ServerArgs.from_cli(["--attention-backend", "triton"]).engine.attention_backend == "triton"
    assert ServerArgs.from_cli([]).engine.attention_backend is None
    with pytest.raises(SystemExit):
        ServerArgs.from_cli(["--attention-backend", "sdpa"])


def test_package_import_loads_neither_triton_nor_flashinfer():
    code = ("import sys, rollout, rollout.core.engine_core, rollout.server.app; "
            "print(sorted(m for m in ('triton', 'flashinfer') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def _generate(backend, rounds, **kw):
    kw.setdefault("max_total_tokens", 1024)   # NOTE: the interpreter copies each KV layer per launch
    client = "process" if kw.get("dp_size", 1) > 1 else "inproc"   # NOTE: inproc: debug() reads the runners
    with Rollout(enable_return_routed_experts=True, attention_backend=backend, dtype="float32", client=client,
                 **kw) as engine:
        outs = [o for batch, params in rounds for o in engine.generate(
            input_ids=batch, sampling_params=params, return_logprob=True, return_routed_experts=True)]
        engine.check_integrity()
        calls = {} if kw.get("dp_size", 1) > 1 else engine.debug(lambda core: {
            name: dict(r.attention.calls) for name, r in core.runner.runners.items() if r.attention is not None})
        stats = engine.stats()
    return outs, calls, stats


def assert_same(outs, ref):
    assert len(outs) == len(ref)
    for out, r in zip(outs, ref):
        assert out.output_ids == r.output_ids
        assert torch.equal(out.routed_experts, r.routed_experts)
        diff = (torch.tensor(out.output_logprobs) - torch.tensor(r.output_logprobs)).abs().max().item()
        assert diff < 1e-4, diff


# round 1: a GRPO group (3 samples of a 30-token prompt, chunked at 16 tokens) and a loner;
# round 2: the same prompt again (a prefix-cache hit) with 2 samples
ROUNDS = [(prompts(1, [30, 9]), [dict(GREEDY, n=3, max_new_tokens=3), dict(GREEDY, max_new_tokens=4)]),
          (prompts(1, [30]), [dict(GREEDY, n=2, max_new_tokens=3)])]


def test_triton_engine_matches_torch_eager():
    ref, _, _ = _generate("torch", ROUNDS, chunked_prefill_size=16)
    outs, calls, _ = _generate("triton", ROUNDS, chunked_prefill_size=16)
    assert_same(outs, ref)
    assert outs[-1].cached_tokens > 0 and ref[-1].cached_tokens == outs[-1].cached_tokens
    eager = calls["eager"]
    assert eager.get("extend", 0) > 0 and eager.get("decode", 0) > 0 and eager.get("cascade", 0) > 0, eager


@pytest.mark.slow
def test_triton_engine_matches_torch_static_runners():
    """Decode buckets and piecewise prefill buckets (without graphs on CPU), as a GPU runs them."""
    kw = dict(chunked_prefill_size=16, decode_graph_batch_sizes=(1, 2, 4), prefill_graph_token_sizes=(8, 16))
    ref, _, _ = _generate("torch", ROUNDS, **kw)
    outs, calls, stats = _generate("triton", ROUNDS, **kw)
    assert_same(outs, ref)
    assert stats["forwards_decode_graph"] > 0 and stats["forwards_prefill_graph"] > 0
    assert calls["decode_graph"].get("decode", 0) > 0 and calls["prefill_graph"].get("extend", 0) > 0


@pytest.mark.slow
def test_triton_engine_matches_torch_dp2():
    ref, _, _ = _generate("torch", ROUNDS, chunked_prefill_size=16, dp_size=2)
    outs, _, _ = _generate("triton", ROUNDS, chunked_prefill_size=16, dp_size=2)
    assert_same(outs, ref)
