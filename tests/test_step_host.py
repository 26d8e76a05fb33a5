"""The step's host work: the attention mask made only when read (never by the kernel backends),
the req-to-token table on the device with device-gathered KV indices, and one host read of the
device per decode step (routing rows copied asynchronously, written when read), and the
pieces that make it so (packed host->device staging, HostReads)."""
import random
import weakref

import pytest
import torch
from attention_cases import slot_table
from torch.overrides import TorchFunctionMode

from rollout import Rollout
from rollout.config import DEFAULT_MODEL_PATH, EngineConfig
from rollout.core.engine_core import EngineCore
from rollout.batch.kv_pool import SINK_SLOT, KVPool, ReqToTokenPool
from rollout.core.request import Req
from rollout.batch.forward_batch import ForwardBatch
from rollout.sampling_params import SamplingParams
from tiny_models import random_prompts as prompts

GREEDY = {"temperature": 0.0, "ignore_eos": True}



def mask_built(fb: ForwardBatch) -> bool:
    """Whether this forward holds a mask (attn_mask, or a kept segment mask of grid_mask)."""
    return "attn_mask" in fb.__dict__ or bool(fb.__dict__.get("_kept_masks"))

def reference_mask(prefix_lens, extend_lens, width):
    """[B, 1, max_extend, width] by definition: query i of request b (position prefix + i) sees key
    p <= that position and p < seq_len; a padded query row (i >= extend) sees key 0 only."""
    bsz, ext = len(prefix_lens), max(extend_lens)
    mask = torch.zeros(bsz, 1, ext, width, dtype=torch.bool)
    for b, (pre, e) in enumerate(zip(prefix_lens, extend_lens)):
        for i in range(ext):
            for p in range(width):
                mask[b, 0, i, p] = (p <= pre + i and p < pre + e) or (ext > 1 and p == 0)
    return mask


@pytest.mark.parametrize("seed", range(6))
def test_lazy_mask_matches_its_definition(seed):
    rng = random.Random(seed)
    bsz = rng.randint(1, 5)
    decode = seed % 2 == 0
    extend = [1] * bsz if decode else [rng.randint(1, 6) for _ in range(bsz)]
    prefix = [rng.randint(0, 7) for _ in range(bsz)]
    pool = KVPool(num_slots=256, num_layers=1, num_kv_heads=1, head_dim=4, dtype=torch.float32)
    slots = [torch.tensor(rng.sample(range(1, 257), p + e)) for p, e in zip(prefix, extend)]
    fb = ForwardBatch.build(input_ids=[3] * sum(extend), out_cache_loc=torch.cat([s[p:] for s, p in zip(slots, prefix)]),
                            prefix_lens=prefix, extend_lens=extend, kv_indices=slot_table(slots), kv_pool=pool)
    assert not mask_built(fb)
    width = max(p + e for p, e in zip(prefix, extend))
    ref = reference_mask(prefix, extend, width)
    lo = rng.randrange(bsz)
    hi = rng.randint(lo + 1, bsz)
    part = fb.grid_mask(lo, hi, max(extend[lo:hi]), max(p + e for p, e in zip(prefix[lo:hi], extend[lo:hi])))
    assert not mask_built(fb)     # a segment's grid is made on its own
    assert torch.equal(part, ref[lo:hi, :, :part.shape[2], :part.shape[3]])
    assert torch.equal(fb.attn_mask, ref) and mask_built(fb)


def _count_grid_masks(monkeypatch):
    calls = []
    inner = ForwardBatch.grid_mask

    def counted(self, *args, **kw):
        calls.append(args)
        return inner(self, *args, **kw)
    monkeypatch.setattr(ForwardBatch, "grid_mask", counted)
    return calls


def _generate(path, backend, **kw):
    with Rollout(str(path), tokenizer_path=DEFAULT_MODEL_PATH, dtype="float32", attention_backend=backend,
                 enable_return_routed_experts=True, max_total_tokens=512, client="inproc", **kw) as engine:
        return engine.generate(input_ids=prompts(3, [12, 5]), return_logprob=True, return_routed_experts=True,
                               sampling_params=[dict(GREEDY, max_new_tokens=4), dict(GREEDY, max_new_tokens=3)])


@pytest.mark.interpreter
def test_kernel_backend_makes_no_mask_even_with_sliding_windows(tiny_checkpoint, monkeypatch):
    path = tiny_checkpoint("mixtral", sliding_window=5)   # windowed layers: the kernels take the layer's window
    calls = _count_grid_masks(monkeypatch)
    ref = _generate(path, "torch")
    assert calls, "the torch backend reads masks (the counter sees them)"
    calls.clear()
    outs = _generate(path, "triton", chunked_prefill_size=8)
    assert calls == []
    for out, r in zip(outs, ref, strict=True):
        assert out.output_ids == r.output_ids
        assert torch.equal(out.routed_experts, r.routed_experts)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_req_to_token_table_on_the_device_gathers_what_the_host_lists_held(device):
    rng = random.Random(0)
    pool = ReqToTokenPool(num_rows=6, width=40, device=device)
    assert pool.device_table.device.type == device
    held: dict[int, list[int]] = {}          # the old host-side state: each request's slot list
    next_slot = iter(range(1, 10**6))
    for _ in range(60):
        op = rng.random()
        if op < 0.25 and len(held) < 6:
            row = pool.alloc()
            held[row] = [next(next_slot) for _ in range(rng.randint(0, 9))]
            pool.write(row, 0, torch.tensor(held[row], dtype=torch.int64))
        elif op < 0.4 and held:
            row = rng.choice(list(held))
            pool.free(row)
            del held[row]
        elif op < 0.6 and held:
            row = rng.choice(list(held))
            more = [next(next_slot) for _ in range(rng.randint(1, 5))]
            if len(held[row]) + len(more) <= 40:
                pool.write(row, len(held[row]), torch.tensor(more, dtype=torch.int64))
                held[row] += more
        elif held:
            rows = [r for r in held if len(held[r]) < 40]
            new = [next(next_slot) for _ in rows]
            pool.append_one(torch.tensor(rows), torch.tensor([len(held[r]) for r in rows]), torch.tensor(new))
            for r, s in zip(rows, new):
                held[r].append(s)
        if held:
            rows = rng.sample(list(held), rng.randint(1, len(held)))
            width = max(len(held[r]) for r in rows) or 1
            got = pool.gather(torch.tensor(rows), width)
            assert got.device.type == device and got.dtype == torch.int64
            ref = torch.nn.utils.rnn.pad_sequence([torch.tensor(held[r] + [SINK_SLOT], dtype=torch.int64)
                                                   for r in rows], batch_first=True, padding_value=SINK_SLOT)
            for i, r in enumerate(rows):   # cells past a length may be stale (masked by every reader)
                n = len(held[r])
                assert torch.equal(got[i, :n].cpu(), ref[i, :n])
                assert torch.equal(pool.slots(r, n), torch.tensor(held[r], dtype=torch.int64))
    pool.check_integrity(list(held))


class DeviceReads(TorchFunctionMode):
    """Counts blocking host reads (tolist, item, bool, int, float, numpy, blocking copies to the
    host) of tensors that came out of the model's forward or the capture buffer, or were computed
    from them: on a GPU each of these waits for the device on its own. Non_blocking copies to the
    host are not reads (their waits are HostReads' one stream sync, or the capture's event)."""

    READS = {torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.__bool__, torch.Tensor.__int__,
             torch.Tensor.__float__, torch.Tensor.__index__, torch.Tensor.numpy, torch.Tensor.cpu}

    def __init__(self):
        super().__init__()
        self.born: dict[int, weakref.ref] = {}
        self.reads = 0
        self.inside_host_reads = False   # HostReads.read's own conversions, after its one wait

    def mark(self, t):
        if isinstance(t, torch.Tensor):
            self.born[id(t)] = weakref.ref(t)

    def _is_born(self, t) -> bool:
        ref = self.born.get(id(t)) if isinstance(t, torch.Tensor) else None
        return ref is not None and ref() is t

    @staticmethod
    def _to_host(args, kwargs) -> bool:
        targets = list(args[1:]) + [kwargs.get("device")]
        return any(t == "cpu" or (isinstance(t, torch.device) and t.type == "cpu") for t in targets)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat = list(args) + list(kwargs.values())
        flat += [x for a in flat if isinstance(a, (list, tuple)) for x in a]
        born = any(self._is_born(a) for a in flat)
        async_copy = func in (torch.Tensor.to, torch.Tensor.copy_) and kwargs.get("non_blocking", False)
        if born and not async_copy and not self.inside_host_reads and (
                func in self.READS
                or (func is torch.Tensor.to and self._to_host(args, kwargs))
                or (func is torch.Tensor.copy_ and not self._is_born(args[0]))):
            self.reads += 1
        out = func(*args, **kwargs)
        if born and not async_copy:   # NOTE: an async copy's host tensor is the event's business
            for o in out if isinstance(out, (list, tuple)) else (out,):
                self.mark(o)
        return out


def test_a_decode_step_reads_the_device_once():
    core = EngineCore(EngineConfig(model_path=DEFAULT_MODEL_PATH, dtype="float32", max_running_requests=8,
                                   enable_return_routed_experts=True))
    inner = core.model.forward
    mode = DeviceReads()

    def forward(*args, **kwargs):
        out = inner(*args, **kwargs)
        mode.mark(out)
        return out
    core.model.forward = forward
    mode.mark(core.capturer.buffer.buffer)
    read = core.host_reads.read

    def sanctioned(columns):
        mode.inside_host_reads = True
        try:
            return read(columns)
        finally:
            mode.inside_host_reads = False
    core.host_reads.read = sanctioned
    for i, ids in enumerate(prompts(5, [7, 4, 9])):
        core.add_request(Req(uid=i + 1, rid=str(i), prompt_ids=ids, seed=i, return_logprob=True,
                             return_routed_experts=True, max_total_len=64, top_logprobs_num=2 if i == 0 else 0,
                             params=SamplingParams(temperature=1.0, max_new_tokens=6, ignore_eos=True)))
    core.step()                                     # the prefill: every request samples its first token
    core.take_updates()
    for _ in range(3):
        before = core.host_reads.count
        with mode:
            mode.reads = 0
            core.step()
        assert core.stats["num_decode_forwards"] >= 1
        # no blocking read of a forward result but through HostReads (one wait)
        assert mode.reads == 0 and core.host_reads.count == before + 1
        # the routing rows of the step are in the host store (written by the step's forward stage)
        for req in core.scheduler.running:
            last = core.scheduler.kv_slots(req)[-1:]
            assert bool((core.capturer.store.gather(last) >= 0).all()), req.rid
        assert not core.take_updates()              # nothing finished, nothing streamed
    while core.has_work():
        core.step()
    upd = {u.uid: u for u in core.take_updates()}
    assert len(upd) == 3 and all(u.finished for u in upd.values())
    core.check_integrity()


def test_a_long_chunk_attends_in_mask_blocks(monkeypatch):
    from attention_cases import attention_case
    from rollout.models.attention import paged as layers

    layer, q, fb, _ = attention_case([40], [100], heads=4, kv_heads=2, dim=16, seed=3)
    kv = fb.kv_pool.kv_buffers[0][fb.kv_indices[0]].double()                 # [140, 2, kvH, D]
    keys, values = kv[:, 0].repeat_interleave(2, dim=1), kv[:, 1].repeat_interleave(2, dim=1)  # [S, H, D]
    scores = torch.einsum("nhd,shd->hns", q.double(), keys) * layer.scale    # [H, 100, 140]
    causal = torch.arange(140)[None, :] <= (40 + torch.arange(100))[:, None]
    probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
    ref = torch.einsum("hns,shd->nhd", probs, values).reshape(100, -1)
    shapes = []
    inner = ForwardBatch.grid_mask

    def recorded(self, *args, **kw):
        out = inner(self, *args, **kw)
        shapes.append(tuple(out.shape))
        return out
    monkeypatch.setattr(ForwardBatch, "grid_mask", recorded)
    monkeypatch.setattr(layers, "MASK_BLOCK_CELLS", 1000)
    out = layer.torch_attend(q, fb)
    assert len(shapes) == 15 and max(s[2] * s[3] for s in shapes) <= 1000   # 7 query rows x 140 keys a block
    assert not mask_built(fb)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    monkeypatch.setattr(layers, "MASK_BLOCK_CELLS", 1 << 24)
    shapes.clear()
    whole = layer.torch_attend(q, fb)
    assert shapes == [(1, 1, 100, 140)]
    torch.testing.assert_close(whole, out, atol=1e-6, rtol=1e-6)


@pytest.mark.gpu
def test_a_graphed_decode_step_syncs_only_for_its_one_read():
    core = EngineCore(EngineConfig(model_path=DEFAULT_MODEL_PATH, device="cuda", dtype="bfloat16",
                                   attention_backend="triton", max_running_requests=8,
                                   decode_graph_batch_sizes=(1, 2, 4, 8), enable_return_routed_experts=True))
    for i, ids in enumerate(prompts(6, [7, 4, 9])):
        core.add_request(Req(uid=i + 1, rid=str(i), prompt_ids=ids, seed=i, return_logprob=True,
                             return_routed_experts=True, max_total_len=64,
                             params=SamplingParams(temperature=1.0, max_new_tokens=6, ignore_eos=True)))
    core.step()
    core.take_updates()
    for _ in range(3):
        before = core.host_reads.count
        with core.host_reads.strict():   # any other sync (a pageable copy, .item(), .tolist()) raises
            core.step()
        assert core.host_reads.count == before + 1 and core.runner.counts["decode_graph"] >= 1
    while core.has_work():
        core.step()
    assert all(u.finished for u in core.take_updates())
    core.check_integrity()


def test_staging_packs_host_vectors_into_one_buffer():
    from rollout.batch.host_device import stage

    parts = [torch.arange(5), torch.tensor([7, 8]), torch.zeros(0, dtype=torch.int64), torch.tensor([9])]
    out = stage(parts, torch.device("cpu"), pack=True)
    assert [o.tolist() for o in out] == [p.tolist() for p in parts]
    assert len({o.untyped_storage().data_ptr() for o in out if o.numel()}) == 1      # views of one copy
    assert all(o is p for o, p in zip(stage(parts, torch.device("cpu")), parts))   # CPU default: no copy


def test_host_reads_reads_each_column_once():
    from rollout.batch.host_device import HostReads

    reads = HostReads()
    ids, lps, ok = reads.read([torch.tensor([3, 2**40]), torch.tensor([-0.5, float("nan")]),
                               torch.tensor([True, False])])
    assert ids == [3, 2**40] and lps[0] == -0.5 and lps[1] != lps[1] and ok == [True, False]
    assert reads.count == 1
