"""The fused MoE kernels (rollout/models/kernels/fused_moe.py) against FusedExperts' torch path.

Without a GPU they run under Triton's interpreter (fp32: the interpreter does bf16 arithmetic
wrongly); the tests marked gpu compile them for real in fp32 and bf16 and replay them in a CUDA graph.
"""
import pytest
import torch

pytest.importorskip("triton")

from rollout.models.moe.ep_group import expert_range  # noqa: E402
from rollout.models.moe.experts import FusedExperts
from rollout.models.moe.routing import softmax_topk  # noqa: E402
from rollout.models.kernels.moe_align import ExpertBlocks  # noqa: E402
from rollout.models.kernels.fused_moe import fused_moe  # noqa: E402

# NOTE: fp32 tolerance: products accumulate in another order than torch's matmuls (a few ulps of
# each partial sum): |diff| <= FP32_TOL * (1 + max |reference|).
FP32_TOL = 1e-5


def experts(hidden, inter, num_experts, seed, device="cpu", dtype=torch.float32) -> FusedExperts:
    m = FusedExperts(hidden, inter, num_experts)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        m.w13.copy_(torch.randn(m.w13.shape, generator=g) / hidden ** 0.5)
        m.w2.copy_(torch.randn(m.w2.shape, generator=g) / inter ** 0.5)
    return m.to(device=device, dtype=dtype)


def routed(n, hidden, num_experts, top_k, seed, device="cpu", dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, hidden, generator=g)
    w, ids = softmax_topk(torch.randn(n, num_experts, generator=g), top_k, renormalize=True)
    return x.to(device=device, dtype=dtype), w.to(device), ids.to(device)


def shard_of(full: FusedExperts, lo: int, hi: int) -> FusedExperts:
    m = FusedExperts(full.w13.shape[2], full.w2.shape[2], full.num_experts)
    m.shard(lo, hi)
    with torch.no_grad():
        m.w13.copy_(full.w13[lo:hi])
        m.w2.copy_(full.w2[lo:hi])
    return m


def assert_close_fp32(out, ref):
    tol = FP32_TOL * (1 + ref.abs().max().item())
    assert out.dtype == ref.dtype and out.shape == ref.shape
    assert (out - ref).abs().max().item() <= tol, ((out - ref).abs().max().item(), tol)


@pytest.mark.parametrize("n,num_experts,top_k,block_m,lo,hi", [
    (9, 6, 2, 4, 0, 6), (40, 7, 3, 16, 2, 5), (1, 5, 5, 16, 0, 5), (0, 4, 2, 16, 0, 4), (13, 9, 4, 8, 4, 4)])
def test_expert_blocks_align_every_held_pair_once(n, num_experts, top_k, block_m, lo, hi):
    _, _, ids = routed(n, 8, num_experts, top_k, seed=n)
    blocks = ExpertBlocks.build(ids, lo, hi - lo, block_m)
    pairs, per_block = blocks.pairs.long(), blocks.block_expert.long()
    assert pairs.numel() == ExpertBlocks.capacity(n * top_k, hi - lo, block_m) == per_block.numel() * block_m
    flat = ids.reshape(-1)
    held = [p for p in range(n * top_k) if lo <= flat[p] < hi]
    real = pairs[pairs < n * top_k]
    assert sorted(real.tolist()) == held                                # each held pair once, others absent
    expert_of_row = per_block.repeat_interleave(block_m)
    assert torch.equal(flat[real] - lo, expert_of_row[pairs < n * top_k])   # every pair in a block of its expert
    used = per_block[per_block >= 0]
    assert torch.equal(used, used.sort().values)                        # experts in order, then unused blocks
    assert (per_block[used.numel():] == -1).all()
    assert used.unique().numel() == len({int(flat[p]) for p in held})   # each used expert's rows padded to blocks


@pytest.mark.interpreter
@pytest.mark.parametrize("n,hidden,inter,num_experts,top_k", [
    (1, 40, 20, 7, 3), (5, 48, 24, 6, 2), (33, 64, 32, 16, 4), (70, 32, 40, 12, 8), (3, 24, 16, 8, 8)])
def test_fused_moe_matches_torch(n, hidden, inter, num_experts, top_k):
    """Odd sizes (hidden, intermediate and expert counts not powers of two), top-k up to 8, one token."""
    m = experts(hidden, inter, num_experts, seed=n)
    x, w, ids = routed(n, hidden, num_experts, top_k, seed=n + 1)
    assert_close_fp32(m(x, w, ids, impl="triton"), m(x, w, ids, impl="loop"))


@pytest.mark.interpreter
def test_fused_moe_empty_batch_and_no_experts_held():
    m = experts(16, 16, 4, seed=0)
    x, w, ids = routed(0, 16, 4, 2, seed=0)
    assert m(x, w, ids, impl="triton").shape == (0, 16)
    x, w, ids = routed(6, 16, 4, 2, seed=1)
    assert torch.equal(m(x, w, ids, experts=(2, 2), impl="triton"), torch.zeros_like(x))


@pytest.mark.interpreter
@pytest.mark.parametrize("ranks", [2, 3, 5])
def test_fused_moe_expert_parallel_shards_sum_to_the_whole(ranks):
    """Each rank's shard (expert_range, as under DP attention; 5 ranks over 4 experts: one holds none)
    computes only its experts, as the torch path does, and the shards add up to the unsharded MoE."""
    full = experts(32, 24, 4 if ranks == 5 else 10, seed=ranks)
    x, w, ids = routed(21, 32, full.num_experts, 3, seed=ranks)
    total = torch.zeros_like(x)
    for rank in range(ranks):
        lo, hi = expert_range(full.num_experts, rank, ranks)
        shard = shard_of(full, lo, hi)
        part = shard(x, w, ids, impl="triton")
        assert_close_fp32(part, shard(x, w, ids, impl="loop"))
        total += part
    assert_close_fp32(total, full(x, w, ids, impl="loop"))
    narrowed = full(x, w, ids, experts=(3, 7 if full.num_experts == 10 else 4), impl="triton")
    assert_close_fp32(narrowed, full(x, w, ids, experts=(3, 7 if full.num_experts == 10 else 4), impl="loop"))


# ---- compiled for real ---------------------------------------------------------------------------
# NOTE: bf16: the kernel accumulates in fp32 and rounds once; torch's bf16 path rounds after each
# GEMM, product and add. Both are compared with an fp32 computation on the same (bf16) weights.
BF16_TOL = 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,hidden,inter,num_experts,top_k", [
    (1, 2048, 768, 128, 8), (64, 2048, 768, 128, 8), (1000, 2048, 768, 128, 8), (77, 200, 96, 60, 4)])
def test_gpu_fused_moe_matches_torch(dtype, n, hidden, inter, num_experts, top_k):
    m = experts(hidden, inter, num_experts, seed=n, device="cuda", dtype=dtype)
    x, w, ids = routed(n, hidden, num_experts, top_k, seed=n, device="cuda", dtype=dtype)
    out = m(x, w, ids, impl="triton")
    assert out.dtype == dtype
    if dtype == torch.float32:
        assert_close_fp32(out, m(x, w, ids, impl="loop"))
        return
    exact = experts(hidden, inter, num_experts, seed=n, device="cuda").to(torch.float32)
    with torch.no_grad():
        exact.w13.copy_(m.w13.float())
        exact.w2.copy_(m.w2.float())
    ref = exact(x.float(), w, ids, impl="loop")
    scale = 1 + ref.abs().max().item()
    err = (out.float() - ref).abs().max().item()
    torch_err = (m(x, w, ids, impl="loop").float() - ref).abs().max().item()
    assert err <= BF16_TOL * scale, (err, scale)
    assert err <= 2 * torch_err + 1e-3 * scale, (err, torch_err)       # no worse than torch's own bf16 path
    for lo, hi in ((0, num_experts // 3), (num_experts // 3, num_experts)):
        part = m(x, w, ids, experts=(lo, hi), impl="triton").float()
        assert (part - exact(x.float(), w, ids, experts=(lo, hi), impl="loop")).abs().max().item() <= BF16_TOL * scale


def _replays_in_graph(n, hidden, inter, num_experts, top_k, replays):
    m = experts(hidden, inter, num_experts, seed=0, device="cuda", dtype=torch.bfloat16)
    x, w, ids = routed(n, hidden, num_experts, top_k, seed=0, device="cuda", dtype=torch.bfloat16)
    m(x, w, ids, impl="triton")                                         # compile outside the graph
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        torch.cuda.set_sync_debug_mode("error")                         # a host sync raises
        try:
            out = m(x, w, ids, impl="triton")
        finally:
            torch.cuda.set_sync_debug_mode("default")
    for seed in range(1, 1 + replays):
        x2, w2, ids2 = routed(n, hidden, num_experts, top_k, seed=seed, device="cuda", dtype=torch.bfloat16)
        x.copy_(x2)
        w.copy_(w2)
        ids.copy_(ids2)
        graph.replay()
        ref = m(x, w, ids, impl="loop").float()
        assert (out.float() - ref).abs().max().item() <= BF16_TOL * (1 + ref.abs().max().item()), seed


@pytest.mark.gpu
def test_gpu_fused_moe_inside_cuda_graph():
    """Captured once, replayed on new routing: the alignment and both kernels read nothing back to
    the host (capture under sync-debug 'error'), and every replay matches the torch path."""
    _replays_in_graph(48, 256, 128, 32, 4, replays=3)


@pytest.mark.gpu
def test_gpu_fused_moe_inside_cuda_graph_at_the_prefill_bucket_size():
    """The largest prefill bucket of a Qwen3-30B-A3B shape: 8192 tokens x top-8 of 128 experts =
    65,536 pairs, where moe_align's stable sort takes another algorithm than at a few hundred."""
    _replays_in_graph(8192, 2048, 768, 128, 8, replays=2)


# ---- gpt-oss: biases and the clamped SwiGLU ------------------------------------------------------

@pytest.mark.interpreter
@pytest.mark.parametrize("n,hidden,inter,num_experts,top_k,limit,scale", [
    (1, 40, 20, 7, 3, 7.0, 1.0), (13, 48, 24, 6, 2, 1.5, 1.0), (33, 64, 32, 16, 4, 7.0, 6.0),
    (9, 24, 16, 8, 8, 2.0, 2.0)])
def test_fused_moe_with_biases_and_clamped_swiglu_matches_hf(n, hidden, inter, num_experts, top_k, limit, scale):
    """Against transformers' GptOssExperts in float64 (tests/test_expert_bias.py), clamps engaged."""
    from test_expert_bias import assert_clamps_engage, assert_close_to, gpt_oss_case, routed as gpt_oss_routed

    case = gpt_oss_case(hidden, inter, num_experts, seed=n, limit=limit, scale=scale)
    x, w, ids = gpt_oss_routed(n, hidden, num_experts, top_k, seed=n + 1)
    if n > 1:
        assert_clamps_engage(case, x)
    assert_close_to(fused_moe(x, case.w13, case.w2, w, ids, 0, **case.kwargs), case.reference(x, w, ids))


@pytest.mark.interpreter
@pytest.mark.parametrize("ranks", [2, 3])
def test_fused_moe_expert_parallel_shards_with_biases_sum_to_the_whole(ranks):
    """Each shard adds only its experts' biases (b13 / b2 sliced with the weights)."""
    from test_expert_bias import assert_close_to, gpt_oss_case, routed as gpt_oss_routed

    case = gpt_oss_case(32, 24, 7, seed=ranks, limit=2.0, scale=2.0)
    x, w, ids = gpt_oss_routed(21, 32, 7, 3, seed=ranks)
    total = torch.zeros_like(x)
    for rank in range(ranks):
        lo, hi = expert_range(7, rank, ranks)
        w13, w2, kwargs = case.shard(lo, hi)
        total += fused_moe(x, w13, w2, w, ids, lo, **kwargs)
    assert_close_to(total, case.reference(x, w, ids))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_fused_moe_with_biases_and_clamped_swiglu(dtype):
    """Compiled: gpt-oss's hidden and intermediate size (2880) against HF in float64 on the same
    (dtype-rounded) weights, with the clamps engaged."""
    from test_expert_bias import assert_clamps_engage, gpt_oss_case, routed as gpt_oss_routed

    case = gpt_oss_case(2880, 2880, 8, seed=0, limit=7.0, scale=6.0)
    dev = case.rounded(dtype, "cuda")
    tol = FP32_TOL if dtype == torch.float32 else BF16_TOL
    for n in (1, 64, 600):
        x, w, ids = gpt_oss_routed(n, 2880, 8, 4, seed=n)
        x = x.to(dtype)
        if n > 1:
            assert_clamps_engage(dev, x.cpu())
        ref = dev.reference(x, w, ids)
        out = fused_moe(x.cuda(), dev.w13, dev.w2, w.cuda(), ids.cuda(), 0, **dev.kwargs)
        assert out.dtype == dtype
        err = (out.double().cpu() - ref).abs().max().item()
        assert err <= tol * (1 + ref.abs().max().item()), (n, err)
