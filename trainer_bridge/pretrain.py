"""Supervised pre-training of a causal LM on the embedded task (used by ``scripts/make_tiny_moe.py``).

Examples become ``Sample`` records (prompt ids, response ids, loss mask) and go through the same
``pack_samples`` / ``token_logprobs`` code as RL training, so the pre-trained model sees exactly the
token layout the GRPO loop later trains on: prompt ``"Q: 37+45= A:"``, response ``" 82"`` + EOS,
loss on the response only. A share of plain sentences (loss on every token after the first) keeps
the model a language model of the tokenizer's corpus.

Deterministic: a seeded generator draws the data, ``torch.manual_seed`` fixes the init-independent
parts, and the caller runs with ``torch.use_deterministic_algorithms(True)``.
"""
from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from .losses import masked_mean, token_logprobs
from .packing import pack_samples
from .sample import Sample
from .task import ArithmeticTask, arithmetic_reward

__all__ = ["PretrainConfig", "pretrain", "greedy_generate", "greedy_accuracy"]


@dataclass(frozen=True, kw_only=True)
class PretrainConfig:
    steps: int = 750
    schedule_steps: Optional[int] = 1500  # cosine horizon; > steps stops early (None: = steps)
    batch_size: int = 64
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 30
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    sentence_fraction: float = 0.2
    seed: int = 0
    log_every: int = 100

    def __post_init__(self):
        for f in ("steps", "batch_size", "log_every"):
            if getattr(self, f) < 1:
                raise ValueError(f"{f} must be >= 1, got {getattr(self, f)}")
        if self.lr <= 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if not 0 <= self.sentence_fraction < 1:
            raise ValueError(f"sentence_fraction must be in [0, 1), got {self.sentence_fraction}")
        if self.schedule_steps is not None and self.schedule_steps < self.steps:
            raise ValueError(f"schedule_steps ({self.schedule_steps}) must be >= steps ({self.steps})")

    def lr_at(self, step: int) -> float:
        """Linear warmup, then cosine from ``lr`` to ``lr * min_lr_ratio`` over ``schedule_steps``."""
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        horizon = self.schedule_steps or self.steps
        t = (step - self.warmup_steps) / max(1, horizon - self.warmup_steps)
        return self.lr * (self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


def _samples(cfg: PretrainConfig, task: ArithmeticTask, encode: Callable[[str], list[int]], eos_id: int,
             sentences: Sequence[str], rng: random.Random, stream) -> list[Sample]:
    out = []
    for i in range(cfg.batch_size):
        if sentences and rng.random() < cfg.sentence_fraction:
            ids = encode(rng.choice(sentences)) + [eos_id]
            out.append(Sample(prompt_ids=ids[:1], response_ids=ids[1:], rid=f"s{i}"))
        else:
            ex = next(stream)
            out.append(Sample(prompt_ids=encode(ex["prompt"]), response_ids=encode(" " + ex["answer"]) + [eos_id],
                              rid=f"a{i}"))
    return out


def pretrain(model: torch.nn.Module, encode: Callable[[str], list[int]], eos_id: int, *,
             config: PretrainConfig = PretrainConfig(), task: ArithmeticTask = ArithmeticTask(),
             sentences: Sequence[str] = (), log: Callable[[str], None] = print,
             eval_fn: Optional[Callable[[torch.nn.Module], float]] = None) -> list[dict]:
    """Trains ``model`` in place on the task's ``train`` split; returns the logged history."""
    cfg = config
    rng = random.Random(f"pretrain-{cfg.seed}")
    stream = task.iter_examples(cfg.seed, "train")
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.98))
    model.train()
    history, t0, run_loss = [], time.perf_counter(), 0.0
    for step in range(cfg.steps):
        for g in opt.param_groups:
            g["lr"] = cfg.lr_at(step)
        (batch,) = pack_samples(_samples(cfg, task, encode, eos_id, sentences, rng, stream), pad_token_id=eos_id)
        logits = model(**batch.model_inputs()).logits
        loss = -masked_mean(token_logprobs(logits, batch.target_ids), batch.loss_mask)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        opt.step()
        run_loss += float(loss.detach())
        if (step + 1) % cfg.log_every == 0 or step + 1 == cfg.steps:
            n = (step % cfg.log_every) + 1
            rec = {"step": step + 1, "loss": run_loss / n, "lr": cfg.lr_at(step),
                   "elapsed_s": time.perf_counter() - t0}
            run_loss = 0.0
            if eval_fn is not None:
                model.eval()
                rec["eval_accuracy"] = eval_fn(model)
                model.train()
            history.append(rec)
            log("pretrain " + " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                       for k, v in rec.items()))
    model.eval()
    return history


@torch.no_grad()
def greedy_generate(model: torch.nn.Module, prompts: Sequence[Sequence[int]], *, max_new_tokens: int,
                    eos_id: int, pad_id: int) -> list[list[int]]:
    """Greedy continuation of each prompt (left-padded batch, stops at ``eos_id``, which is kept)."""
    model.eval()
    n, width = len(prompts), max(len(p) for p in prompts)
    ids = torch.full((n, width), pad_id, dtype=torch.long)
    attn = torch.zeros((n, width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(list(p))
        attn[i, width - len(p):] = 1
    out = [[] for _ in range(n)]
    done = torch.zeros(n, dtype=torch.bool)
    for _ in range(max_new_tokens):
        pos = (attn.cumsum(-1) - 1).clamp(min=0)
        nxt = model(input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=False).logits[:, -1].argmax(-1)
        for i in range(n):
            if not done[i]:
                out[i].append(int(nxt[i]))
        done |= nxt == eos_id
        if bool(done.all()):
            break
        ids = torch.cat([ids, nxt[:, None]], 1)
        attn = torch.cat([attn, torch.ones((n, 1), dtype=torch.long)], 1)
    return out


def greedy_accuracy(model: torch.nn.Module, encode: Callable[[str], list[int]],
                    decode: Callable[[list[int]], str], records: Sequence[dict], *, eos_id: int,
                    max_new_tokens: int = 8, batch_size: int = 128) -> float:
    """Mean ``arithmetic_reward`` of greedy responses to ``records``."""
    total = 0.0
    for i in range(0, len(records), batch_size):
        chunk = records[i:i + batch_size]
        outs = greedy_generate(model, [encode(r["prompt"]) for r in chunk], max_new_tokens=max_new_tokens,
                               eos_id=eos_id, pad_id=eos_id)
        for r, o in zip(chunk, outs):
            total += arithmetic_reward(decode([t for t in o if t != eos_id]), r)
    return total / max(1, len(records))
