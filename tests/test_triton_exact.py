"""The batch-invariant fused MoE kernel (rollout/models/kernels/fused_moe_exact.py): a (token, slot) row's
result is the same bits alone, in any batch, at any position and next to any tile neighbours; the
k slots are added in slot order; it agrees with rollout.exact.fused_experts within fp32 rounding;
the deterministic engine runs it on the triton backend with a request's numbers batch-invariant.

Without a GPU the kernels run under Triton's interpreter (tests/conftest.py), in fp32; the tests
marked gpu compile them for real (fp32 and bf16, and in a CUDA graph).
"""
import pytest
import torch

pytest.importorskip("triton")

from rollout.exact import fused_experts, sum_slots  # noqa: E402
from rollout.models.moe.block import SparseMoE
from rollout.models.moe.routing import softmax_topk  # noqa: E402
from rollout.models.kernels.fused_moe_exact import EXACT_BLOCK_M, fused_moe_exact  # noqa: E402

# NOTE: not bitwise against the torch ops (another summation order in the GEMMs, h in fp32):
# |diff| <= FP32_TOL * (1 + max |reference|)
FP32_TOL = 1e-5
HIDDEN, INTER, EXPERTS, TOP_K = 48, 40, 6, 3


def weights(seed, device="cpu", dtype=torch.float32, hidden=HIDDEN, inter=INTER, experts=EXPERTS):
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=g) / hidden ** 0.5
    w2 = torch.randn(experts, hidden, inter, generator=g) / inter ** 0.5
    return w13.to(device, dtype), w2.to(device, dtype)


def routed(n, seed, device="cpu", dtype=torch.float32, hidden=HIDDEN, experts=EXPERTS, top_k=TOP_K):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, hidden, generator=g)
    w, ids = softmax_topk(torch.randn(n, experts, generator=g), top_k, renormalize=True)
    return x.to(device, dtype), w.to(device), ids.to(device)


def assert_close_fp32(out, ref):
    tol = FP32_TOL * (1 + ref.abs().max().item())
    assert out.dtype == ref.dtype and out.shape == ref.shape
    assert (out - ref).abs().max().item() <= tol, ((out - ref).abs().max().item(), tol)


def gpt_oss_biases(seed, device="cpu", dtype=torch.float32, scale=1.0):
    """b13 [E, 2I], b2 [E, H] and a small swiglu_limit, so the clamps engage."""
    g = torch.Generator().manual_seed(seed)
    return dict(b13=(torch.randn(EXPERTS, 2 * INTER, generator=g) * scale).to(device, dtype),
                b2=torch.randn(EXPERTS, HIDDEN, generator=g).to(device, dtype), swiglu_limit=1.5, swiglu_alpha=1.702)


def _check_invariance(device, dtype, sizes=(1, 7, 33, 100), gpt_oss=False):
    w13, w2 = weights(0, device, dtype)
    kw = gpt_oss_biases(0, device, dtype) if gpt_oss else {}
    x, w, ids = routed(max(sizes), 1, device, dtype)
    full = fused_moe_exact(x, w13, w2, w, ids, 0, **kw)                             # [100, H]
    for n in sizes:
        for start in sorted({0, (max(sizes) - n) // 2, max(sizes) - n}):
            rows = slice(start, start + n)
            assert torch.equal(fused_moe_exact(x[rows], w13, w2, w[rows], ids[rows], 0, **kw), full[rows]), (n, start)
    # one row alone vs inside batches where it sits at every place of its expert's block
    for target in (0, 57, 99):
        alone = fused_moe_exact(x[target:target + 1], w13, w2, w[target:target + 1], ids[target:target + 1], 0, **kw)
        assert torch.equal(alone, full[target:target + 1])
        for place in (0, 5, EXACT_BLOCK_M - 1, EXACT_BLOCK_M + 3):
            others = routed(place + 9, 100 + place, device, dtype)
            others[2][:] = ids[target]                                              # the same experts
            bx, bw, bids = (torch.cat([o[:place], t[target:target + 1], o[place:]])
                            for o, t in zip(others, (x, w, ids)))
            out = fused_moe_exact(bx, w13, w2, bw, bids, 0, **kw)
            assert torch.equal(out[place:place + 1], alone), (target, place)


@pytest.mark.interpreter
def test_a_row_is_the_same_bits_in_any_batch_and_next_to_any_neighbours():
    _check_invariance("cpu", torch.float32)


@pytest.mark.interpreter
@pytest.mark.parametrize("n,hidden,inter,experts,top_k", [(1, 48, 40, 6, 3), (37, 48, 40, 6, 3), (20, 300, 24, 5, 2)])
def test_matches_the_torch_exact_experts(n, hidden, inter, experts, top_k):
    """Close to rollout.exact.fused_experts (hidden 300: w13's reduction in two BLOCK_K chunks)."""
    w13, w2 = weights(n, hidden=hidden, inter=inter, experts=experts)
    x, w, ids = routed(n, n + 1, hidden=hidden, experts=experts, top_k=top_k)
    assert_close_fp32(fused_moe_exact(x, w13, w2, w, ids, 0), fused_experts(x, w13, w2, w, ids))
    assert_close_fp32(fused_moe_exact(x, w13, w2, w, ids, 0, per_slot=True),
                      fused_experts(x, w13, w2, w, ids, per_slot=True))


@pytest.mark.interpreter
def test_slots_are_added_in_slot_order():
    w13, w2 = weights(2)
    x, w, ids = routed(9, 3)
    terms = fused_moe_exact(x, w13, w2, w, ids, 0, per_slot=True)                   # [N, K, H]
    assert torch.equal(fused_moe_exact(x, w13, w2, w, ids, 0), (terms[:, 0] + terms[:, 1]) + terms[:, 2])
    # a slot's term is its own (expert, weight)'s: permuting the slots permutes the terms, and the
    # sum follows the new order (whose bits may differ: fp32 addition is not associative)
    perm = torch.tensor([2, 0, 1])
    moved = fused_moe_exact(x, w13, w2, w[:, perm], ids[:, perm], 0, per_slot=True)
    assert torch.equal(moved, terms[:, perm])
    assert torch.equal(fused_moe_exact(x, w13, w2, w[:, perm], ids[:, perm], 0),
                       (terms[:, 2] + terms[:, 0]) + terms[:, 1])
    # the order matters: terms chosen so that the two orders round differently
    big = torch.tensor([[1e8, 1.0, -1e8]])[:, :, None]                              # [1, K, 1]
    assert not torch.equal(sum_slots(big), sum_slots(big[:, perm]))


@pytest.mark.interpreter
@pytest.mark.parametrize("ranks", [2, 3])
def test_expert_parallel_terms_add_up_to_the_whole_bitwise(ranks):
    w13, w2 = weights(4)
    x, w, ids = routed(21, 5)
    bounds = [EXPERTS * r // ranks for r in range(ranks + 1)]
    parts = [fused_moe_exact(x, w13[lo:hi], w2[lo:hi], w, ids, lo, per_slot=True)
             for lo, hi in zip(bounds, bounds[1:])]
    total = parts[0]
    for part in parts[1:]:
        total = total + part                                                        # one nonzero term per slot
    assert torch.equal(sum_slots(total), fused_moe_exact(x, w13, w2, w, ids, 0))


@pytest.mark.interpreter
def test_empty_batch_and_no_experts_held():
    w13, w2 = weights(6)
    x, w, ids = routed(0, 7)
    assert fused_moe_exact(x, w13, w2, w, ids, 0).shape == (0, HIDDEN)
    x, w, ids = routed(5, 8)
    assert torch.equal(fused_moe_exact(x, w13[:0], w2[:0], w, ids, 0), torch.zeros_like(x))
    far = fused_moe_exact(x, w13[:2], w2[:2], w, ids + EXPERTS, 0, per_slot=True)   # routed elsewhere
    assert torch.equal(far, torch.zeros(5, TOP_K, HIDDEN))


@pytest.mark.interpreter
def test_a_row_is_the_same_bits_in_any_batch_with_biases_and_clamped_swiglu():
    _check_invariance("cpu", torch.float32, gpt_oss=True)


@pytest.mark.interpreter
@pytest.mark.parametrize("n,hidden,inter,experts,top_k,limit,scale", [
    (1, 48, 40, 6, 3, 7.0, 1.0), (37, 48, 40, 6, 3, 1.5, 1.0), (20, 300, 24, 5, 2, 7.0, 6.0)])
def test_with_biases_and_clamped_swiglu_matches_hf_and_the_torch_exact_experts(n, hidden, inter, experts, top_k,
                                                                                limit, scale):
    """Against transformers' GptOssExperts in float64 (tests/test_expert_bias.py), and close to
    rollout.exact.fused_experts with the same arguments (summed and per slot)."""
    from test_expert_bias import assert_clamps_engage, assert_close_to, gpt_oss_case, routed as gpt_oss_routed

    case = gpt_oss_case(hidden, inter, experts, seed=n, limit=limit, scale=scale)
    x, w, ids = gpt_oss_routed(n, hidden, experts, top_k, seed=n + 1)
    if n > 1:
        assert_clamps_engage(case, x)
    out = fused_moe_exact(x, case.w13, case.w2, w, ids, 0, **case.kwargs)
    assert_close_to(out, case.reference(x, w, ids))
    assert_close_fp32(out, fused_experts(x, case.w13, case.w2, w, ids, **case.kwargs))
    assert_close_fp32(fused_moe_exact(x, case.w13, case.w2, w, ids, 0, per_slot=True, **case.kwargs),
                      fused_experts(x, case.w13, case.w2, w, ids, per_slot=True, **case.kwargs))


@pytest.mark.interpreter
@pytest.mark.parametrize("ranks", [2, 3])
def test_expert_parallel_terms_with_biases_add_up_to_the_whole_bitwise(ranks):
    w13, w2 = weights(4)
    kw = gpt_oss_biases(4, scale=2.0)
    x, w, ids = routed(21, 5)
    bounds = [EXPERTS * r // ranks for r in range(ranks + 1)]
    parts = [fused_moe_exact(x, w13[lo:hi], w2[lo:hi], w, ids, lo, per_slot=True,
                             **dict(kw, b13=kw["b13"][lo:hi], b2=kw["b2"][lo:hi]))
             for lo, hi in zip(bounds, bounds[1:])]
    total = parts[0]
    for part in parts[1:]:
        total = total + part                                                        # one nonzero term per slot
    assert torch.equal(sum_slots(total), fused_moe_exact(x, w13, w2, w, ids, 0, **kw))


@pytest.mark.interpreter
def test_the_deterministic_triton_backend_runs_it():
    """An exact SparseMoE on the triton backend: experts by fused_moe_exact, routing by the torch rule."""
    from rollout.models.registry import model_spec

    spec = model_spec({"architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 32, "hidden_size": HIDDEN,
                       "num_hidden_layers": 1, "num_attention_heads": 4, "moe_intermediate_size": INTER,
                       "num_experts": EXPERTS, "num_experts_per_tok": TOP_K, "norm_topk_prob": True}, None)
    moe = SparseMoE(spec, layer_id=0)
    w13, w2 = weights(9)
    with torch.no_grad():
        moe.experts.w13.copy_(w13)
        moe.experts.w2.copy_(w2)
        moe.gate.weight.copy_(torch.randn(EXPERTS, HIDDEN, generator=torch.Generator().manual_seed(9)))
    moe.moe_backend = "triton"
    moe.gate.exact = moe.experts.exact = True
    assert moe._experts_impl == "exact_triton"
    x = routed(11, 10)[0]
    w, ids = softmax_topk(moe.gate(x), TOP_K, True)
    routed_w, routed_ids = moe.rule(moe.gate(x), exact=True, triton=True)   # the torch rule, not the kernel
    assert torch.equal(routed_w, w) and torch.equal(routed_ids, ids)
    out = moe.experts(x, w, ids, impl=moe._experts_impl)
    assert torch.equal(out, fused_moe_exact(x, w13, w2, w, ids, 0))
    assert torch.equal(moe.experts.exact_terms(x, w, ids, triton=True),
                       fused_moe_exact(x, w13, w2, w, ids, 0, per_slot=True))
    moe.gate.exact = moe.experts.exact = False
    assert moe._experts_impl == "triton"                                           # the default path


def test_config_takes_the_triton_moe_backend_in_deterministic_mode():
    from rollout.config import EngineConfig

    cfg = EngineConfig(enable_deterministic_inference=True, moe_backend="triton")
    assert cfg.resolved_moe_backend == "triton" and cfg.resolved_attention_backend == "torch"
    assert EngineConfig(enable_deterministic_inference=True).resolved_moe_backend == "torch"   # CPU
    cfg = EngineConfig(enable_deterministic_inference=True, attention_backend="triton")
    assert cfg.resolved_attention_backend == "triton"
    with pytest.raises(ValueError, match="attention_backend"):
        EngineConfig(enable_deterministic_inference=True, attention_backend="flashinfer")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_a_row_is_the_same_bits_in_any_batch(dtype):
    _check_invariance("cuda", dtype, sizes=(1, 7, 33, 100, 1000))
    w13, w2 = weights(0, "cuda", dtype)
    x, w, ids = routed(64, 1, "cuda", dtype)
    ref = fused_experts(x.double(), w13.double(), w2.double(), w, ids).to(dtype)
    tol = (FP32_TOL if dtype == torch.float32 else 3e-2) * (1 + ref.abs().max().item())
    assert (fused_moe_exact(x, w13, w2, w, ids, 0) - ref).abs().max().item() <= tol


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_a_row_is_the_same_bits_in_any_batch_with_biases_and_clamped_swiglu(dtype):
    _check_invariance("cuda", dtype, sizes=(1, 7, 33, 100, 1000), gpt_oss=True)
    from test_expert_bias import gpt_oss_case, routed as gpt_oss_routed

    dev = gpt_oss_case(2880, 2880, 8, seed=0, limit=7.0, scale=6.0).rounded(dtype, "cuda")
    x, w, ids = gpt_oss_routed(64, 2880, 8, 4, seed=1)
    x = x.to(dtype)
    ref = dev.reference(x, w, ids)
    tol = (FP32_TOL if dtype == torch.float32 else 3e-2) * (1 + ref.abs().max().item())
    out = fused_moe_exact(x.cuda(), dev.w13, dev.w2, w.cuda(), ids.cuda(), 0, **dev.kwargs)
    assert (out.double().cpu() - ref).abs().max().item() <= tol
    alone = fused_moe_exact(x[5:6].cuda(), dev.w13, dev.w2, w[5:6].cuda(), ids[5:6].cuda(), 0, **dev.kwargs)
    assert torch.equal(alone, out[5:6])


@pytest.mark.gpu
def test_gpu_inside_cuda_graph():
    w13, w2 = weights(0, "cuda", torch.bfloat16)
    x, w, ids = routed(24, 1, "cuda", torch.bfloat16)
    eager = fused_moe_exact(x, w13, w2, w, ids, 0)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        fused_moe_exact(x, w13, w2, w, ids, 0)                                     # compile outside capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe_exact(x, w13, w2, w, ids, 0)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
    nx, nw, nids = routed(24, 2, "cuda", torch.bfloat16)
    x.copy_(nx), w.copy_(nw), ids.copy_(nids)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, fused_moe_exact(x, w13, w2, w, ids, 0)) and not torch.equal(out, eager)


def _paged(seed, lens, heads=4, kv_heads=2, dim=16, slots=600, device="cpu", dtype=torch.float32):
    """A KV pool [slots, 2, kvH, D], requests' slot tables [B, max(lens)] (disjoint random slots)
    and queries [sum(lens), H, D] for every position of each request."""
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(slots, 2, kv_heads, dim, generator=g)
    perm = torch.randperm(slots, generator=g)
    table = torch.zeros(len(lens), max(lens), dtype=torch.int64)
    at = 0
    for b, n in enumerate(lens):
        table[b, :n] = perm[at:at + n]
        at += n
    queries = [torch.randn(n, heads, dim, generator=g).to(device, dtype) for n in lens]
    return kv.to(device, dtype), table.to(device), queries


def _attend(kv, table, queries, starts, exact=True, window=None):
    """Request b's queries at positions starts[b] .. (its cached prefix: keys before starts[b])."""
    from rollout.models.kernels.extend_attention import extend_attention

    ext = torch.tensor([q.shape[0] for q in queries], device=kv.device)
    seq = torch.tensor(starts, device=kv.device) + ext
    return extend_attention(torch.cat(queries), kv, table, ext, seq, max_extend=int(ext.max()), scale=0.25,
                            window=window, exact=exact)


@pytest.mark.interpreter
@pytest.mark.parametrize("window", [None, 40])
def test_attention_decode_chunks_and_whole_prompt_agree_bitwise(window):
    """The batch-invariant extend kernel: a query's output is the same bits decoded alone (one query
    over its prefix), in a chunk of a chunked prefill, in the whole prompt, and next to other requests;
    and close to a float64 softmax attention."""
    _check_attention(window, "cpu", torch.float32)


def _check_attention(window, device, dtype):
    kv, table, (q, *others) = _paged(0, [150, 70, 9], device=device, dtype=dtype)
    whole = _attend(kv, table[:1], [q], [0], window=window)                           # [150, H*D]
    for p in (0, 31, 32, 63, 64, 100, 149):
        assert torch.equal(_attend(kv, table[:1], [q[p:p + 1]], [p], window=window), whole[p:p + 1]), p
    assert torch.equal(_attend(kv, table[:1], [q[30:50]], [30], window=window), whole[30:50])
    batch = _attend(kv, table[[1, 0, 2]], [others[0][60:], q[90:], others[1]], [60, 90, 0], window=window)
    assert torch.equal(batch[10:70], whole[90:])
    keys, values = kv[table[0, :150], 0].double(), kv[table[0, :150], 1].double()    # [S, kvH, D]
    qd = q.double().view(150, 2, 2, 16)                                               # [S, kvH, G, D]
    s = torch.einsum("qhgd,khd->hgqk", qd, keys) * 0.25
    pos = torch.arange(150, device=device)
    see = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - (window or 10**9))
    ref = torch.einsum("hgqk,khd->qhgd", s.masked_fill(~see, float("-inf")).softmax(-1), values)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    assert (whole.double() - ref.reshape(150, -1)).abs().max().item() <= tol


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_attention_decode_chunks_and_whole_prompt_agree_bitwise(dtype):
    for window in (None, 40):
        _check_attention(window, "cuda", dtype)


@pytest.mark.interpreter
def test_deterministic_engine_on_the_triton_backend_alone_vs_in_a_batch(tiny_checkpoint):
    from test_deterministic_engine import TARGET, _others, _run, _same
    from tiny_models import make_engine, random_prompts

    path = tiny_checkpoint("qwen3_moe")
    target = random_prompts(11, [45])[0]
    prompts, params = _others(5, 3)
    # NOTE: torch attention here (the triton attention under the interpreter costs ~40 s more):
    # the engine with both triton backends is the slow test below
    with make_engine(path, enable_deterministic_inference=True, moe_backend="triton", chunked_prefill_size=32,
                     client="inproc") as engine:
        alone = _run(engine, target)
        among = engine.generate(input_ids=prompts[:2] + [target] + prompts[2:],
                                sampling_params=params[:2] + [TARGET] + params[2:], return_logprob=True,
                                top_logprobs_num=3, return_routed_experts=True)[2]
        impls = engine.debug(lambda core: {m._experts_impl for m in core.model.modules() if isinstance(m, SparseMoE)})
    assert impls == {"exact_triton"}
    _same(alone, among)


@pytest.mark.interpreter
@pytest.mark.slow
def test_deterministic_engine_on_the_triton_backend_is_batch_invariant(tiny_checkpoint):
    """The engine, deterministic on the triton MoE and attention backends: the same checks as on
    torch (chunks, retractions, a prefix hit, decode vs prefill); the routing is the torch
    backends' (the same rule) and the logprobs close to theirs."""
    from test_deterministic_engine import _run, check_batch_invariance
    from tiny_models import make_engine, random_prompts

    path = tiny_checkpoint("qwen3_moe")
    both = dict(moe_backend="triton", attention_backend="triton")
    alone = check_batch_invariance(path, **both)
    with make_engine(path, enable_deterministic_inference=True, client="inproc", **both) as engine:
        _run(engine, random_prompts(12, [20])[0], {"max_new_tokens": 2, "temperature": 0.0})
        calls = engine.debug(lambda core: dict(core.runner.runners["eager"].attention.calls))
    assert set(calls) == {"exact"}, calls                          # decode too: no split decode, no cascade
    with make_engine(path, enable_deterministic_inference=True, enable_prefix_caching=False) as engine:
        on_torch = _run(engine, random_prompts(11, [45])[0])
    assert alone.output_ids == on_torch.output_ids and torch.equal(alone.routed_experts, on_torch.routed_experts)
    diff = (torch.tensor(alone.output_logprobs) - torch.tensor(on_torch.output_logprobs)).abs().max().item()
    assert diff <= 1e-4, diff
