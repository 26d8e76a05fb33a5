"""The model, engines and workloads of scripts/gpu_check.py's benchmark.

A Qwen3-MoE of a given shape with random weights made on the device by transformers (its own
init), and this engine's model sharing those very tensors (HF 5.x keeps experts fused as
gate_up_proj [E, 2I, H] / down_proj [E, H, I], this engine's w13 / w2 layout): one copy of the
weights serves both `generate` and the engine. Nothing is read from the network or from disk
except the embedded tokenizer (decoding only; any id decodes).
"""
from __future__ import annotations

import json
import os
import random
import statistics
import time
from dataclasses import dataclass
from typing import Optional
from unittest import mock

import torch
from torch import nn

import rollout.core.engine_core as engine_core_module
from rollout.config import DEFAULT_MODEL_PATH, EngineConfig
from rollout.core.engine_core import EngineCore
from rollout.models.loader import resolve
from rollout.models.registry import model_class
from rollout.core.request import Req
from rollout.sampling_params import SamplingParams

HBM_BYTES_PER_S = 4.8e12   # H200


@dataclass(frozen=True)
class Shape:
    layers: int
    hidden: int
    experts: int
    top_k: int
    expert_inter: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int

    def hf_config(self) -> dict:
        return dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", vocab_size=self.vocab,
                    hidden_size=self.hidden, intermediate_size=4 * self.expert_inter,
                    moe_intermediate_size=self.expert_inter, num_hidden_layers=self.layers,
                    num_attention_heads=self.heads, num_key_value_heads=self.kv_heads, head_dim=self.head_dim,
                    num_experts=self.experts, num_experts_per_tok=self.top_k, norm_topk_prob=True,
                    decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=40960,
                    rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=False, eos_token_id=0,
                    bos_token_id=0, pad_token_id=0, initializer_range=0.02)


QWEN3_30B_A3B = Shape(layers=48, hidden=2048, experts=128, top_k=8, expert_inter=768, heads=32, kv_heads=4,
                      head_dim=128, vocab=151936)
SMOKE = Shape(layers=2, hidden=64, experts=8, top_k=2, expert_inter=32, heads=4, kv_heads=2, head_dim=16, vocab=512)


def build_models(shape: Shape, device: str, dtype: torch.dtype, workdir: str):
    """-> (HF model, this engine's model on the same tensors, config dict, model dir for the engine)."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    cfg = shape.hf_config()
    with torch.device(device):
        hf = AutoModelForCausalLM.from_config(Qwen3MoeConfig(**cfg), dtype=dtype)
    hf.eval().requires_grad_(False)
    cls = model_class("Qwen3MoeForCausalLM")
    with torch.device("meta"):
        ours = cls(cls.spec_from_config(cfg)).to(dtype)
    for name, tensor in hf.state_dict().items():
        t = resolve(ours, name)
        if t is None:
            continue
        assert t.expert is None and t.half is None, f"{name}: transformers did not keep experts fused"
        owner, _, attr = t.param.rpartition(".")
        module = ours.get_submodule(owner)
        assert getattr(module, attr).shape == tensor.shape, (name, getattr(module, attr).shape, tensor.shape)
        setattr(module, attr, nn.Parameter(tensor, requires_grad=False))
    left = [n for n, p in ours.named_parameters() if p.is_meta]
    assert not left, f"parameters without an HF tensor: {left[:5]}"
    ours.eval()
    model_dir = os.path.join(workdir, "model")
    os.makedirs(model_dir, exist_ok=True)
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(cfg, f)
    return hf, ours, cfg, model_dir


def make_core(model: nn.Module, cfg: dict, model_dir: str, **engine: object) -> EngineCore:
    """An EngineCore on `model` (its loader returns the model already on the device)."""
    config = EngineConfig(model_path=model_dir, tokenizer_path=DEFAULT_MODEL_PATH, **engine)
    with mock.patch.object(engine_core_module, "load_model", lambda *a, **k: (model, cfg)):
        return EngineCore(config)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def rl_batch(vocab: int, prompts: int, samples: int, prompt_lens: tuple[int, int], new_tokens: tuple[int, int],
             seed: int = 0) -> list[tuple[list[int], int]]:
    """(prompt ids, max_new_tokens) per request: `samples` requests per prompt, max_new_tokens spread."""
    rng = random.Random(seed)
    out = []
    for _ in range(prompts):
        ids = [rng.randrange(1, vocab) for _ in range(rng.randint(*prompt_lens))]
        out += [(ids, rng.randint(*new_tokens)) for _ in range(samples)]
    return out


def run_engine(core: EngineCore, batch: list[tuple[list[int], int]], device: str, capture: bool) -> dict:
    """Every request greedy, ignore_eos -> output tokens, seconds, tok/s."""
    for i, (ids, new) in enumerate(batch):
        core.add_request(Req(uid=i, rid=str(i), prompt_ids=list(ids), seed=i, return_routed_experts=capture,
                             params=SamplingParams(temperature=0.0, max_new_tokens=new, ignore_eos=True),
                             max_total_len=core.context_length))
    sync(device)
    t0 = time.perf_counter()
    finished = tokens = 0
    while core.has_work():
        core.step()
        for upd in core.take_updates():   # NOTE: what the engine loop would send (one update per finished request)
            tokens += len(upd.output_ids) // 4
            finished += upd.finished
    sync(device)
    secs = time.perf_counter() - t0
    assert finished == len(batch) and tokens == sum(n for _, n in batch), (finished, tokens)
    return {"tokens": tokens, "seconds": secs, "tok_per_s": tokens / secs}


def run_hf(hf: nn.Module, batch: list[tuple[list[int], int]], device: str, max_time: Optional[float]) -> dict:
    """transformers' generate on the same batch: left-padded, greedy, until the longest request's
    max_new_tokens (or max_time); useful tokens = each request's own max_new_tokens reached."""
    from transformers import GenerationConfig

    width = max(len(ids) for ids, _ in batch)
    ids = torch.zeros(len(batch), width, dtype=torch.long)
    mask = torch.zeros(len(batch), width, dtype=torch.long)
    for i, (p, _) in enumerate(batch):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    longest = max(n for _, n in batch)
    gen = GenerationConfig(max_new_tokens=longest, min_new_tokens=longest, do_sample=False, eos_token_id=None,
                           pad_token_id=0, max_time=max_time)
    with torch.inference_mode():
        hf.generate(input_ids=ids[:1, -8:].to(device), attention_mask=mask[:1, -8:].to(device),
                    generation_config=GenerationConfig(max_new_tokens=2, do_sample=False, eos_token_id=None,
                                                       pad_token_id=0))           # warm-up
        sync(device)
        t0 = time.perf_counter()
        out = hf.generate(input_ids=ids.to(device), attention_mask=mask.to(device), generation_config=gen)
        sync(device)
    secs = time.perf_counter() - t0
    steps = out.shape[1] - width
    tokens = sum(min(n, steps) for _, n in batch)
    return {"tokens": tokens, "seconds": secs, "tok_per_s": tokens / secs, "steps": steps, "longest": longest}


def decode_step_time(core: EngineCore, vocab: int, batch: int, prompt_len: int, steps: int, device: str) -> dict:
    """Median seconds of a decode step with `batch` requests of ~prompt_len context (after their
    prefill), the context length at the timed steps, and the step's host seconds (its wall time
    less its one wait for the device: EngineCore.host_reads)."""
    reads = core.host_reads
    read = reads.read
    waited = [0.0]

    def timed_read(columns):
        t = time.perf_counter()
        try:
            return read(columns)
        finally:
            waited[0] += time.perf_counter() - t
    reads.read = timed_read
    try:
        return _decode_step_time(core, vocab, batch, prompt_len, steps, device, waited)
    finally:
        del reads.read


def _decode_step_time(core: EngineCore, vocab: int, batch: int, prompt_len: int, steps: int, device: str,
                      waited: list) -> dict:
    rng = random.Random(batch)
    for i in range(batch):
        core.add_request(Req(uid=batch * 1_000_000 + i, rid=f"d{batch}-{i}", seed=i,
                             prompt_ids=[rng.randrange(1, vocab) for _ in range(prompt_len)],
                             params=SamplingParams(temperature=0.0, max_new_tokens=steps + 64, ignore_eos=True),
                             max_total_len=core.context_length))
    times, host = [], []
    warm = 2
    for _ in range(batch * prompt_len // 256 + steps + warm + 64):
        decodes = core.stats["num_decode_forwards"]
        sync(device)
        waited[0] = 0.0
        t0 = time.perf_counter()
        core.step()
        t1 = time.perf_counter()
        sync(device)
        core.take_updates()
        is_decode = core.stats["num_decode_forwards"] > decodes
        if is_decode and len(core.scheduler.running) == batch and not core.scheduler.waiting:
            if warm:
                warm -= 1
            else:
                times.append(time.perf_counter() - t0)
                host.append(t1 - t0 - waited[0])
        if len(times) == steps:
            break
    context = prompt_len + warm + len(times)
    core.abort_all()
    while core.has_work():
        core.step()
    core.take_updates()
    assert times, "no decode step of the whole batch was timed"
    return {"step_s": statistics.median(times), "context": context, "steps_timed": len(times),
            "host_s": statistics.median(host)}


def hbm_limit_s(model: nn.Module, shape: Shape, batch: int, context: int, kv_bytes_per_token: int) -> dict:
    """Bytes one decode step must read (every non-expert weight but the embedding table, the
    experts the batch's tokens pick (expected distinct experts under uniform routing), every
    request's KV) and that over HBM bandwidth."""
    elt = next(model.parameters()).element_size()
    expert = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n) * elt
    embed = model.model.embed_tokens.weight.numel() * elt
    rest = sum(p.numel() for p in model.parameters()) * elt - expert - embed
    per_expert = expert / (shape.layers * shape.experts)
    distinct = shape.experts * (1 - (1 - shape.top_k / shape.experts) ** batch)
    weights = rest + shape.layers * distinct * per_expert
    kv = batch * context * kv_bytes_per_token
    return {"bytes": weights + kv, "weight_bytes": weights, "kv_bytes": kv, "limit_s": (weights + kv) / HBM_BYTES_PER_S}
