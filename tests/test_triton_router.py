"""The Triton router kernel (rollout/models/kernels/topk.py) against the torch rules.

Without a GPU the kernel runs under Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1):
ids bitwise equal to softmax_topk including exact ties, the ids stored in the capture buffer by the
kernel itself, and DeepSeek-V3's grouped sigmoid rule against transformers' DeepseekV3TopkRouter.
The tests marked gpu compile the kernel for real (bf16 and fp32) and run it inside a CUDA graph.
"""
import pytest
import torch

pytest.importorskip("triton")

from capture.capturer import RoutedExpertsBuffer  # noqa: E402
from rollout.models.moe.routing import softmax_topk  # noqa: E402
from rollout.models.kernels.topk import grouped_sigmoid_topk_triton, softmax_topk_triton  # noqa: E402

# NOTE: fp32 weights: the kernel's exp and sum differ from torch's by a few ulps at most.
WEIGHT_ATOL = 2e-6


def tied_logits(n: int, e: int, seed: int, dtype=torch.float32, random_rows: bool = True) -> torch.Tensor:
    """Random logits with exact ties: values on a coarse grid, a duplicated column, an all-equal row
    (and, with random_rows, every third row without any)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-6, 7, (n, e), generator=g).float() / 2          # [N, E], many exact ties
    if n > 1 and random_rows:
        x[1::3] = torch.randn(x[1::3].shape, generator=g)              # and rows without any
    if e > 3:
        x[:, e - 1] = x[:, 1]
    if n > 2:
        x[2] = 0.25
    return x.to(dtype)


def grouped_sigmoid_reference(logits, top_k, bias, n_group, topk_group, norm, scale):
    """DeepSeek-V3's rule in torch (transformers' DeepseekV3TopkRouter), made deterministic: stable
    descending sorts, so among equal values the lower group / expert id wins, ids in order of choice."""
    scores = logits.float().sigmoid()                                  # [N, E]
    choice = scores + bias
    n, e = choice.shape
    groups = choice.view(n, n_group, e // n_group)
    group_scores = torch.sort(groups, dim=-1, descending=True, stable=True).values[..., :2].sum(-1)
    group_idx = torch.sort(group_scores, dim=-1, descending=True, stable=True).indices[:, :topk_group]
    allowed = torch.zeros(n, n_group, dtype=torch.bool, device=choice.device).scatter_(1, group_idx, True)
    choice = choice.masked_fill(~allowed.repeat_interleave(e // n_group, dim=1), float("-inf"))
    ids = torch.sort(choice, dim=-1, descending=True, stable=True).indices[:, :top_k]
    w = scores.gather(1, ids)
    if norm:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return w * scale, ids


@pytest.mark.interpreter
@pytest.mark.parametrize("num_experts,top_k,n", [(16, 4, 37), (60, 8, 5), (7, 3, 1), (6, 6, 9), (128, 8, 3),
                                                  (20, 1, 70)])
@pytest.mark.parametrize("renormalize", [True, False])
def test_softmax_router_matches_softmax_topk(num_experts, top_k, n, renormalize):
    """Expert counts that are not powers of two, top-k up to 8, exact ties (lower id wins)."""
    logits = tied_logits(n, num_experts, seed=num_experts * 100 + n)
    buf = RoutedExpertsBuffer(rows=n + 5, num_layers=3, top_k=top_k)
    w, ids = softmax_topk_triton(logits, top_k, renormalize, capture=buf, layer_id=1)
    w_ref, ids_ref = softmax_topk(logits, top_k, renormalize)
    assert ids.dtype == torch.int64 and w.dtype == torch.float32 and ids.shape == (n, top_k)
    assert torch.equal(ids, ids_ref)
    torch.testing.assert_close(w, w_ref, atol=WEIGHT_ATOL, rtol=0)
    # the kernel's own store is the capture: this layer's first n rows, nothing else touched
    assert torch.equal(buf.buffer[:n, 1], ids_ref.int())
    assert (buf.buffer[n:] == -1).all() and (buf.buffer[:, [0, 2]] == -1).all()


@pytest.mark.interpreter
def test_softmax_router_bf16_logits_and_strided_input():
    """bf16 logits (loaded, then fp32 math) and a non-contiguous [N, E] view give softmax_topk's ids."""
    logits = tied_logits(19, 24, seed=3, dtype=torch.bfloat16)
    w, ids = softmax_topk_triton(logits, 5, True)
    w_ref, ids_ref = softmax_topk(logits, 5, True)
    assert torch.equal(ids, ids_ref)
    torch.testing.assert_close(w, w_ref, atol=WEIGHT_ATOL, rtol=0)
    wide = tied_logits(19, 48, seed=4)[:, ::2]
    assert torch.equal(softmax_topk_triton(wide, 4, False)[1], softmax_topk(wide, 4, False)[1])


@pytest.mark.interpreter
def test_softmax_router_empty_and_one_token_batches():
    buf = RoutedExpertsBuffer(rows=4, num_layers=2, top_k=2)
    w, ids = softmax_topk_triton(torch.zeros(0, 8), 2, True, capture=buf, layer_id=0)
    assert w.shape == (0, 2) and ids.shape == (0, 2) and (buf.buffer == -1).all()
    w, ids = softmax_topk_triton(torch.full((1, 8), 1.5), 2, True, capture=buf, layer_id=0)
    assert ids.tolist() == [[0, 1]] and w.tolist() == [[0.5, 0.5]]
    assert buf.buffer[0, 0].tolist() == [0, 1] and (buf.buffer[1:] == -1).all()


def test_router_errors_name_the_field():
    with pytest.raises(ValueError, match="top_k"):
        softmax_topk_triton(torch.zeros(2, 4), 5, True)
    with pytest.raises(ValueError, match="top_k"):
        softmax_topk_triton(torch.zeros(2, 4), 0, True)
    bias = torch.zeros(12)
    kw = dict(correction_bias=bias, norm_topk_prob=True, routed_scaling_factor=1.0)
    with pytest.raises(ValueError, match="n_group"):
        grouped_sigmoid_topk_triton(torch.zeros(2, 12), 2, n_group=5, topk_group=1, **kw)
    with pytest.raises(ValueError, match="topk_group"):
        grouped_sigmoid_topk_triton(torch.zeros(2, 12), 2, n_group=4, topk_group=5, **kw)
    with pytest.raises(ValueError, match="top_k"):
        grouped_sigmoid_topk_triton(torch.zeros(2, 12), 7, n_group=4, topk_group=2, **kw)
    with pytest.raises(ValueError, match="correction_bias"):
        grouped_sigmoid_topk_triton(torch.zeros(2, 12), 2, n_group=4, topk_group=2, correction_bias=torch.zeros(8),
                                    norm_topk_prob=True, routed_scaling_factor=1.0)


@pytest.mark.interpreter
@pytest.mark.parametrize("num_experts,top_k,n_group,topk_group,norm", [
    (24, 6, 4, 2, True), (256 // 4, 8, 8, 4, True), (20, 3, 5, 3, False), (12, 4, 1, 1, True)])
def test_grouped_sigmoid_router_matches_transformers(num_experts, top_k, n_group, topk_group, norm):
    """DeepSeek-V3's rule: the same experts and weights as transformers' DeepseekV3TopkRouter (which
    leaves the order unspecified: compared as sets), and the same ordered ids as the reference above."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    cfg = DeepseekV3Config(hidden_size=32, n_routed_experts=num_experts, num_experts_per_tok=top_k,
                           n_group=n_group, topk_group=topk_group, norm_topk_prob=norm, routed_scaling_factor=2.5)
    router = DeepseekV3TopkRouter(cfg)
    g = torch.Generator().manual_seed(num_experts)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=g))
        router.e_score_correction_bias.copy_(0.1 * torch.randn(num_experts, generator=g))
    logits, hf_w, hf_ids = router(torch.randn(23, 32, generator=g))
    buf = RoutedExpertsBuffer(rows=23, num_layers=2, top_k=top_k)
    w, ids = grouped_sigmoid_topk_triton(logits, top_k, correction_bias=router.e_score_correction_bias,
                                         n_group=n_group, topk_group=topk_group, norm_topk_prob=norm,
                                         routed_scaling_factor=2.5, capture=buf, layer_id=1)
    order, hf_order = ids.argsort(-1), hf_ids.argsort(-1)
    assert torch.equal(ids.gather(1, order), hf_ids.gather(1, hf_order))
    torch.testing.assert_close(w.gather(1, order), hf_w.gather(1, hf_order), atol=WEIGHT_ATOL, rtol=1e-6)
    w_ref, ids_ref = grouped_sigmoid_reference(logits, top_k, router.e_score_correction_bias, n_group, topk_group,
                                               norm, 2.5)
    assert torch.equal(ids, ids_ref) and torch.equal(buf.buffer[:, 1], ids_ref.int())
    torch.testing.assert_close(w, w_ref, atol=WEIGHT_ATOL, rtol=1e-6)


@pytest.mark.interpreter
def test_grouped_sigmoid_router_ties_and_group_limit():
    """Exact ties among groups and experts: lower ids win; no expert outside the chosen groups."""
    logits = tied_logits(30, 32, seed=7)
    bias = torch.zeros(32)
    bias[8:16] = 0.5                                                    # group 1 always wins
    w, ids = grouped_sigmoid_topk_triton(logits, 5, correction_bias=bias, n_group=4, topk_group=2,
                                         norm_topk_prob=False, routed_scaling_factor=1.0)
    w_ref, ids_ref = grouped_sigmoid_reference(logits, 5, bias, 4, 2, False, 1.0)
    assert torch.equal(ids, ids_ref)
    torch.testing.assert_close(w, w_ref, atol=WEIGHT_ATOL, rtol=0)
    assert ((ids // 8 == 1).sum(-1) >= 1).all()
    assert ((ids // 8).unsqueeze(-1) == (ids // 8).unsqueeze(-2)).any(-1).all()
    assert all(len(set(row.tolist())) <= 2 for row in ids // 8)         # at most topk_group groups


# ---- compiled for real ---------------------------------------------------------------------------
# NOTE: on a GPU tl.exp is the fast exp2-based one: weights within 1e-5 of torch's. The grouped rule
# chooses on sigmoid values, whose rounding differs from torch's: its GPU check uses logits and
# biases on grids where every two distinct choice values (and group scores) differ by > 5e-5.
GPU_WEIGHT_ATOL = 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_experts,top_k", [(16, 4), (60, 4), (128, 8), (256, 8)])
def test_gpu_router_matches_torch(dtype, num_experts, top_k):
    logits = tied_logits(1000, num_experts, seed=num_experts, dtype=dtype).cuda()
    buf = RoutedExpertsBuffer(rows=1024, num_layers=2, top_k=top_k, device="cuda")
    for renormalize in (True, False):
        w, ids = softmax_topk_triton(logits, top_k, renormalize, capture=buf, layer_id=1)
        w_ref, ids_ref = softmax_topk(logits, top_k, renormalize)
        assert torch.equal(ids, ids_ref) and torch.equal(buf.buffer[:1000, 1], ids_ref.int())
        torch.testing.assert_close(w, w_ref, atol=GPU_WEIGHT_ATOL, rtol=0)
    grid = tied_logits(1000, num_experts, seed=num_experts + 1, random_rows=False).cuda()
    bias = (torch.randint(-2, 3, (num_experts,), generator=torch.Generator().manual_seed(1)) / 8).cuda()
    n_group = 8 if num_experts % 8 == 0 else 4
    w, ids = grouped_sigmoid_topk_triton(grid, top_k, correction_bias=bias, n_group=n_group, topk_group=4,
                                         norm_topk_prob=True, routed_scaling_factor=2.5)
    w_ref, ids_ref = grouped_sigmoid_reference(grid, top_k, bias, n_group, 4, True, 2.5)
    assert torch.equal(ids, ids_ref)
    torch.testing.assert_close(w, w_ref, atol=2.5 * GPU_WEIGHT_ATOL, rtol=1e-5)


@pytest.mark.gpu
def test_gpu_router_inside_cuda_graph():
    """Captured once, replayed on new logits: ids and the capture rows follow the new logits (the
    kernel reads nothing back to the host; capture under sync-debug 'error' proves it)."""
    n, e, k = 256, 128, 8
    static = torch.randn(n, e, device="cuda")
    buf = RoutedExpertsBuffer(rows=n, num_layers=3, top_k=k, device="cuda")
    softmax_topk_triton(static, k, True, capture=buf, layer_id=2)      # compile outside the graph
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        torch.cuda.set_sync_debug_mode("error")                         # a host sync raises
        try:
            w, ids = softmax_topk_triton(static, k, True, capture=buf, layer_id=2)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    for seed in range(3):
        static.copy_(tied_logits(n, e, seed=seed).cuda())
        buf.buffer.fill_(-1)
        graph.replay()
        w_ref, ids_ref = softmax_topk(static, k, True)
        assert torch.equal(ids, ids_ref) and torch.equal(buf.buffer[:, 2], ids_ref.int())
        torch.testing.assert_close(w, w_ref, atol=GPU_WEIGHT_ATOL, rtol=0)


# ---- gpt-oss: top-k of the logits, then softmax over them ----------------------------------------

@pytest.mark.interpreter
@pytest.mark.parametrize("num_experts,top_k,n", [(32, 4, 37), (60, 8, 5), (7, 3, 1), (6, 6, 9), (128, 4, 3)])
def test_topk_softmax_router_matches_topk_softmax(num_experts, top_k, n):
    """Ids bitwise equal to the torch rule including exact ties (lower id first), weights within
    fp32 rounding, the ids in the capture buffer's rows of this layer only."""
    from rollout.models.moe.routing import topk_softmax
    from rollout.models.kernels.topk import topk_softmax_triton

    logits = tied_logits(n, num_experts, seed=num_experts * 10 + n)
    buf = RoutedExpertsBuffer(rows=n + 5, num_layers=3, top_k=top_k)
    w, ids = topk_softmax_triton(logits, top_k, capture=buf, layer_id=2)
    w_ref, ids_ref = topk_softmax(logits, top_k)
    assert ids.dtype == torch.int64 and w.dtype == torch.float32 and ids.shape == (n, top_k)
    assert torch.equal(ids, ids_ref)
    torch.testing.assert_close(w, w_ref, atol=WEIGHT_ATOL, rtol=0)
    assert torch.equal(buf.buffer[:n, 2], ids_ref.int())
    assert (buf.buffer[n:] == -1).all() and (buf.buffer[:, [0, 1]] == -1).all()


@pytest.mark.interpreter
def test_topk_softmax_router_bf16_strided_and_a_recording_capture():
    """bf16 logits, a non-contiguous view, and a capture without rows (its record() gets the ids)."""
    from rollout.models.moe.routing import topk_softmax
    from rollout.models.kernels.topk import topk_softmax_triton

    class Recorder:
        calls = []

        def record(self, layer_id, topk_ids):
            self.calls.append((layer_id, topk_ids.clone()))

    logits = tied_logits(19, 24, seed=5, dtype=torch.bfloat16)
    rec = Recorder()
    w, ids = topk_softmax_triton(logits, 5, capture=rec, layer_id=7)
    w_ref, ids_ref = topk_softmax(logits, 5)
    assert torch.equal(ids, ids_ref)
    torch.testing.assert_close(w, w_ref, atol=WEIGHT_ATOL, rtol=0)
    assert len(rec.calls) == 1 and rec.calls[0][0] == 7 and torch.equal(rec.calls[0][1], ids)
    wide = tied_logits(19, 48, seed=6)[:, ::2]
    assert torch.equal(topk_softmax_triton(wide, 4)[1], topk_softmax(wide, 4)[1])
    assert topk_softmax_triton(wide[:0], 4)[1].shape == (0, 4)
    with pytest.raises(ValueError, match="top_k"):
        topk_softmax_triton(wide, 25)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_experts,top_k", [(32, 4), (60, 4), (128, 4)])
def test_gpu_topk_softmax_router_matches_torch(dtype, num_experts, top_k):
    """gpt-oss-20b (32 experts) and -120b (128), top-4: the choice is on the logits, so ids bitwise
    even with exact ties; the capture rows written by the kernel."""
    from rollout.models.moe.routing import topk_softmax
    from rollout.models.kernels.topk import topk_softmax_triton

    logits = tied_logits(1000, num_experts, seed=num_experts, dtype=dtype).cuda()
    buf = RoutedExpertsBuffer(rows=1024, num_layers=2, top_k=top_k, device="cuda")
    w, ids = topk_softmax_triton(logits, top_k, capture=buf, layer_id=1)
    w_ref, ids_ref = topk_softmax(logits, top_k)
    assert torch.equal(ids, ids_ref) and torch.equal(buf.buffer[:1000, 1], ids_ref.int())
    torch.testing.assert_close(w, w_ref, atol=GPU_WEIGHT_ATOL, rtol=0)
