"""GPU: the Triton attention kernels compiled for real against the torch path, captured in a
CUDA graph, and the engine's CUDA graphs (decode buckets, piecewise prefill buckets) against the
same static runners without graphs, bitwise, for every attention backend this machine has."""
import importlib.util

import pytest
import torch

from attention_cases import attention_case, reference
from rollout.config import DEFAULT_MODEL_PATH, EngineConfig
from rollout.core.engine_core import EngineCore
from rollout.exec.model_runner import DECODE, PREFILL, ModelRunner
from rollout.models.attention.backend import make_attention_backend
from test_runners import _run_core
from tiny_models import random_prompts as prompts

pytestmark = pytest.mark.gpu
TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}
BACKENDS = ["torch", "triton"] + (["flashinfer"] if importlib.util.find_spec("flashinfer") else [])
SHAPES = [(4, 2, 32), (32, 4, 128)]                        # (heads, kv heads, head_dim): tiny, Qwen3-30B-A3B


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("heads,kv_heads,dim", SHAPES)
def test_triton_kernels_compiled_match_torch(dtype, heads, kv_heads, dim):
    from rollout.models.kernels.cascade_attention import cascade_decode_attention
    from rollout.models.kernels.decode_attention import decode_attention
    from rollout.models.kernels.extend_attention import extend_attention
    from rollout.batch.paged_kv_metadata import paged_kv_metadata

    kw = dict(heads=heads, kv_heads=kv_heads, dim=dim, dtype=dtype, device="cuda")
    layer, q, fb, _ = attention_case([0, 1, 63, 700, 5], [1] * 5, seed=1, **kw)
    kv = fb.kv_pool.kv_buffers[0]
    for splits in (1, 16):
        out = decode_attention(q, kv, fb.kv_indices, fb.seq_lens, scale=layer.scale, num_splits=splits)
        torch.testing.assert_close(out.float(), reference(layer, q, fb), atol=TOL[dtype], rtol=0)
    layer, q, fb, _ = attention_case([0, 24, 300, 0], [90, 7, 1, 1], seed=2, **kw)
    out = extend_attention(q, fb.kv_pool.kv_buffers[0], fb.kv_indices, fb.extend_lens, fb.seq_lens,
                           max_extend=fb.max_extend, scale=layer.scale)
    torch.testing.assert_close(out.float(), reference(layer, q, fb), atol=TOL[dtype], rtol=0)
    groups = [(400, (0, 2, 4)), (170, (1, 3))]
    layer, q, fb, groups = attention_case([403, 171, 408, 172, 405, 29], [1] * 6, shared=groups, seed=3, **kw)
    meta = paged_kv_metadata(extend_lens=[1] * 6, seq_lens=fb.seq_lens.tolist(), kv_indices=fb.kv_indices,
                             prefix_groups=groups, device="cuda")
    out = cascade_decode_attention(q, fb.kv_pool.kv_buffers[0], meta, scale=layer.scale)
    torch.testing.assert_close(out.float(), reference(layer, q, fb), atol=TOL[dtype], rtol=0)


def test_triton_decode_replays_in_a_cuda_graph():
    """Captured once over static buffers, replayed after the slot table and lengths changed."""
    from rollout.models.kernels.decode_attention import decode_attention

    layer, q, fb, _ = attention_case([30, 200, 90], [1] * 3, heads=32, kv_heads=4, dim=128,
                                     dtype=torch.bfloat16, device="cuda", seed=4)
    kv = fb.kv_pool.kv_buffers[0]
    table, lens, q_static = fb.kv_indices.clone(), fb.seq_lens.clone(), q.clone()
    eager = decode_attention(q_static, kv, table, lens, scale=layer.scale)       # warm-up (compile)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = decode_attention(q_static, kv, table, lens, scale=layer.scale)
    graph.replay()
    assert torch.equal(out, eager)
    table[:, :150] = table.flip(0)[:, :150]
    lens.copy_(torch.tensor([120, 40, 150], device="cuda"))
    q_static.mul_(0.5)
    graph.replay()
    assert torch.equal(out, decode_attention(q_static, kv, table, lens, scale=layer.scale))


@pytest.mark.parametrize("backend", BACKENDS)
def test_cuda_graphs_match_the_same_buckets_without_graphs_bitwise(tiny_checkpoint, backend):
    """Decode buckets and piecewise prefill buckets replayed as CUDA graphs give exactly (bitwise)
    the tokens, logprobs and routing rows of the same static buffers run without graphs; routing
    is captured inside the graphs (every MoE row holds real expert ids)."""
    path = tiny_checkpoint("qwen3_moe")
    cfg = EngineConfig(model_path=str(path), tokenizer_path=DEFAULT_MODEL_PATH, dtype="bfloat16", device="cuda",
                       enable_return_routed_experts=True, decode_graph_batch_sizes=(1, 2, 4, 8),
                       prefill_graph_token_sizes=(16, 32, 64), chunked_prefill_size=64, context_length=256,
                       attention_backend=backend)
    batch = prompts(3, [4, 19, 33, 7, 12, 50])
    params = [{"temperature": 0.0, "max_new_tokens": m, "ignore_eos": True} for m in (20, 9, 14, 3, 17, 6)]
    graphed = EngineCore(cfg)
    assert graphed.runner.runners[DECODE].backend.uses_graphs and graphed.runner.runners[PREFILL].backend.uses_graphs
    outs = _run_core(graphed, batch, params)
    assert graphed.runner.counts[DECODE] > 0 and graphed.runner.counts[PREFILL] > 0
    plain = EngineCore(cfg)
    plain.runner = ModelRunner(model=plain.model, kv_pool=plain.kv_pool, device=plain.device,
                               limits=plain.forward_shape_limits, capture_buffer=plain.capturer.buffer,
                               seq_capacity=plain.context_length, use_cuda_graphs=False, static_grid=True,
                               attention_backend=make_attention_backend(backend, device=plain.device,
                                                                        model=plain.model))
    ref = _run_core(plain, batch, params)
    assert plain.runner.counts == graphed.runner.counts
    moe = list(graphed.info.moe_layer_ids)
    for out, r in zip(outs, ref):
        assert out.output_ids == r.output_ids
        assert out.output_logprobs == r.output_logprobs
        assert torch.equal(out.routed_experts, r.routed_experts)
        assert (out.routed_experts[:, moe] >= 0).all() and out.routed_experts[:, moe].any()
