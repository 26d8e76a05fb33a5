"""transformers as the test oracle: greedy continuations, logprobs and router top-k."""
from __future__ import annotations

import functools
from pathlib import Path

import torch


@functools.lru_cache(maxsize=8)
def hf_model(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@torch.no_grad()
def hf_greedy(path: str | Path, prompt: list[int], n: int) -> list[int]:
    model = hf_model(str(path))
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                         eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@torch.no_grad()
def hf_logprobs(path: str | Path, prompt: list[int], output: list[int]) -> torch.Tensor:
    """log p(output[i] | prompt + output[:i]) under the raw model distribution, [len(output)]."""
    model = hf_model(str(path))
    seq = torch.tensor([prompt + output])
    logits = model(seq).logits[0].float()
    lp = torch.log_softmax(logits, dim=-1)
    pos = torch.arange(len(prompt) - 1, len(prompt) + len(output) - 1)
    return lp[pos, torch.tensor(output)]


@torch.no_grad()
def hf_router_topk(path: str | Path, seq: list[int], top_k: int, num_layers: int) -> torch.Tensor:
    """[len(seq), num_layers, top_k] router top-k ids of transformers' forward; -1 for dense layers.

    Every supported rule picks the k largest softmax probabilities; among exactly equal ones the
    lower expert id wins (the engine's documented rule; torch.topk leaves ties unspecified).
    """
    model = hf_model(str(path))
    out = model(torch.tensor([seq]), output_router_logits=True)
    logits = out.router_logits
    moe_layers = moe_layer_ids(model.config)
    assert len(logits) == len(moe_layers)
    res = torch.full((len(seq), num_layers, top_k), -1, dtype=torch.int32)
    for layer, lg in zip(moe_layers, logits):
        probs = torch.softmax(lg.reshape(len(seq), -1).float(), dim=-1)
        order = torch.sort(probs, dim=-1, descending=True, stable=True).indices
        res[:, layer] = order[:, :top_k].to(torch.int32)
    return res


def moe_layer_ids(config) -> list[int]:
    n = config.num_hidden_layers
    only = set(getattr(config, "mlp_only_layers", None) or [])
    step = getattr(config, "decoder_sparse_step", 1) or 1
    return [i for i in range(n) if i not in only and (i + 1) % step == 0]


def same_sets(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Routing equality as sets per (row, layer)."""
    return a.shape == b.shape and torch.equal(torch.sort(a, dim=-1).values, torch.sort(b, dim=-1).values)
