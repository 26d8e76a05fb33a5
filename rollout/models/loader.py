"""Checkpoint loading: HF safetensors names -> this package's parameters, with full validation.

HF 5.x save_pretrained writes experts per expert (model.layers.{i}.mlp.experts.{e}.gate_proj.weight,
up_proj, down_proj; Mixtral: block_sparse_moe.experts.{e}.w1/w3/w2). The in-memory HF 5.x fused
layout (mlp.experts.gate_up_proj [E, 2I, H], mlp.experts.down_proj [E, H, I]) is accepted too.
Both are fused here into mlp.experts.w13 [E, 2I, H] (gate rows, then up rows) and w2 [E, H, I].
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

_PER_EXPERT = re.compile(r"^(.+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_FUSED = re.compile(r"^(.+\.mlp\.experts)\.(gate_up_proj|down_proj)$")
# NOTE: some old checkpoints carry non-persistent RoPE buffers; they hold no weights.
_IGNORED = re.compile(r"(^|\.)rotary_emb\.inv_freq$")
_MAX_LISTED = 20


@dataclass(frozen=True)
class Target:
    """Where one checkpoint tensor goes: param[expert][half-rows] (None = whole dimension)."""

    param: str
    expert: int | None = None
    half: int | None = None      # w13 only: 0 = gate rows, 1 = up rows


def resolve(model: nn.Module, hf_name: str) -> Target | None:
    """Map an HF checkpoint name to a Target; None for tensors that are known and ignored."""
    if _IGNORED.search(hf_name):
        return None
    if hf_name == "lm_head.weight" and model.spec.tie_word_embeddings:
        return None
    name = hf_name
    for pattern, repl in getattr(model, "hf_renames", ()):
        name = re.sub(pattern, repl, name)
    if m := _PER_EXPERT.match(name):
        prefix, e, proj = m.group(1), int(m.group(2)), m.group(3)
        if proj == "down_proj":
            return Target(f"{prefix}.w2", e)
        return Target(f"{prefix}.w13", e, 0 if proj == "gate_proj" else 1)
    if m := _FUSED.match(name):
        return Target(f"{m.group(1)}.{'w13' if m.group(2) == 'gate_up_proj' else 'w2'}")
    return Target(name)


def target_view(param: torch.Tensor, t: Target) -> torch.Tensor:
    view = param if t.expert is None else param[t.expert]
    if t.half is not None:
        rows = view.shape[0] // 2
        view = view[t.half * rows:(t.half + 1) * rows]
    return view


def _pieces(name: str, param: torch.Tensor) -> set[tuple[int | None, int | None]]:
    """Pieces that together cover param; a whole-tensor Target (None, None) covers everything."""
    if name.endswith(".experts.w13"):
        return {(e, h) for e in range(param.shape[0]) for h in (0, 1)}
    if name.endswith(".experts.w2"):
        return {(e, None) for e in range(param.shape[0])}
    return {(None, None)}


def _listing(items: list[str]) -> str:
    more = f"\n  ... and {len(items) - _MAX_LISTED} more" if len(items) > _MAX_LISTED else ""
    return "\n  " + "\n  ".join(items[:_MAX_LISTED]) + more


def plan(model: nn.Module, shapes: dict[str, tuple[int, ...]], *, require_all: bool,
         source: str = "checkpoint") -> dict[str, Target]:
    """Validate every checkpoint name/shape against the model before anything is copied.

    Raises ValueError naming unexpected keys, shape mismatches, overlaps and (with require_all)
    parameters the checkpoint does not provide.
    """
    params = dict(model.named_parameters())
    targets: dict[str, Target] = {}
    covered: dict[str, set] = {}
    unexpected, bad_shape, overlap = [], [], []
    for hf_name, shape in shapes.items():
        t = resolve(model, hf_name)
        if t is None:
            continue
        if t.param not in params:
            unexpected.append(f"{hf_name} {list(shape)}")
            continue
        want = tuple(target_view(params[t.param], t).shape)
        if tuple(shape) != want:
            bad_shape.append(f"{hf_name}: {source} {list(shape)}, model expects {list(want)}")
            continue
        got = _pieces(t.param, params[t.param]) if t.expert is None and t.half is None else {(t.expert, t.half)}
        seen = covered.setdefault(t.param, set())
        if seen & got:
            overlap.append(f"{hf_name} (overlaps another tensor for {t.param})")
            continue
        seen |= got
        targets[hf_name] = t
    missing = []
    if require_all:
        for name, p in params.items():
            for e, h in sorted(_pieces(name, p) - covered.get(name, set()), key=str):
                where = "" if e is None else f" expert {e}" + ("" if h is None else (" gate_proj", " up_proj")[h])
                missing.append(f"{name}{where} {list(target_view(p, Target(name, e, h)).shape)}")
    errors = []
    for title, items in (("missing", missing), ("unexpected", unexpected),
                         ("wrong shape", bad_shape), ("duplicate", overlap)):
        if items:
            errors.append(f"{len(items)} {title} tensor(s):{_listing(items)}")
    if errors:
        raise ValueError(f"{source} does not match {type(model).__name__}:\n" + "\n".join(errors))
    return targets


def _checkpoint_files(model_path: str | Path) -> list[Path]:
    path = Path(model_path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [path / f for f in sorted(set(weight_map.values()))]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors files in {str(path)!r}")
    return files


@torch.no_grad()
def load_checkpoint(model: nn.Module, model_path: str | Path) -> None:
    """Load every parameter of model from model_path's safetensors (sharded or not)."""
    files = _checkpoint_files(model_path)
    shapes: dict[str, tuple[int, ...]] = {}
    file_of: dict[str, Path] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for key in st.keys():
                if key in shapes:
                    raise ValueError(f"tensor {key!r} appears in both {file_of[key].name} and {f.name}")
                shapes[key] = tuple(st.get_slice(key).get_shape())
                file_of[key] = f
    targets = plan(model, shapes, require_all=True)
    params = dict(model.named_parameters())
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for key in st.keys():
                if key in targets:
                    t = targets[key]
                    target_view(params[t.param], t).copy_(st.get_tensor(key))


@torch.no_grad()
def load_state_dict_from_tensors(model: nn.Module, named_tensors: dict[str, torch.Tensor]) -> int:
    """Copy HF-named tensors into model, all or nothing: every name and shape is checked first.

    A subset of the parameters is fine (weight updates may be partial). Returns tensors copied.
    """
    targets = plan(model, {k: tuple(v.shape) for k, v in named_tensors.items()}, require_all=False,
                   source="tensors")
    params = dict(model.named_parameters())
    for key, t in targets.items():
        target_view(params[t.param], t).copy_(named_tensors[key])
    return len(targets)
