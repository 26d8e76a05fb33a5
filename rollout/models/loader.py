"""Checkpoint loading: HF safetensors names -> this package's parameters, with full validation.

HF 5.x save_pretrained writes experts per expert (model.layers.{i}.mlp.experts.{e}.gate_proj.weight,
up_proj, down_proj; Mixtral: block_sparse_moe.experts.{e}.w1/w3/w2). The in-memory HF 5.x fused
layout (mlp.experts.gate_up_proj [E, 2I, H], mlp.experts.down_proj [E, H, I]) is accepted too.
Both are fused here into mlp.experts.w13 [E, 2I, H] (gate rows, then up rows) and w2 [E, H, I].
An architecture whose checkpoint lays a tensor out otherwise names it in `hf_transforms` (gpt-oss:
gate_up_proj [E, H, 2I] with gate / up interleaved, down_proj [E, I, H]): the shape is checked
after the transform and the tensor transformed as it is copied. MXFP4 tensors (`<name>_blocks` /
`<name>_scales`, gpt-oss's experts) are dequantized on load into the model's dtype (quant/mxfp4.py).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from rollout.models.quant.fp8 import FP8_DTYPE
from rollout.models.quant.mxfp4 import dequantize_checkpoint_tensor, pair_mxfp4_names

_PER_EXPERT = re.compile(r"^(.+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.(weight|weight_scale_inv|weight_scale)$")
_FUSED = re.compile(r"^(.+\.mlp\.experts)\.(gate_up_proj|down_proj)$")
# NOTE: some old checkpoints carry non-persistent RoPE buffers; they hold no weights.
_IGNORED = re.compile(r"(^|\.)rotary_emb\.inv_freq$")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
SCALE_PARAMS = ("weight_scale_inv", "weight_scale", "w13_scale_inv", "w2_scale_inv", "w13_scale", "w2_scale")
_MAX_LISTED = 20


@dataclass(frozen=True)
class Target:
    """Where one checkpoint tensor goes: param[expert][half-rows] (None = whole dimension).

    expert is global (the checkpoint's numbering); source_rows: copy only these rows of the
    source's dim 0 (a whole stacked-experts tensor loaded into an expert shard).
    """

    param: str
    expert: int | None = None
    half: int | None = None      # w13 only: 0 = gate rows, 1 = up rows
    source_rows: tuple[int, int] | None = None
    transform: str | None = None   # a TRANSFORMS key: the checkpoint's layout -> the parameter's


def _deinterleave(t: torch.Tensor) -> torch.Tensor:
    """[..., 2I] with gate / up alternating -> [..., 2I] gate half then up half."""
    return torch.cat((t[..., 0::2], t[..., 1::2]), dim=-1)


# name -> (shape of the transformed tensor from the checkpoint's shape, the transform)
TRANSFORMS = {
    # [E, H, 2I] interleaved -> w13 [E, 2I, H] gate rows then up rows
    "gate_up_interleaved": (lambda s: (s[0], s[2], s[1]), lambda t: _deinterleave(t).transpose(1, 2)),
    # [E, I, H] -> w2 [E, H, I]
    "transpose": (lambda s: (s[0], s[2], s[1]), lambda t: t.transpose(1, 2)),
    # [E, 2I] interleaved -> b13 [E, 2I] gate then up
    "interleaved": (lambda s: tuple(s), _deinterleave),
}


def transformed_shape(shape: tuple[int, ...], t: "Target") -> tuple[int, ...]:
    return tuple(shape) if t.transform is None else tuple(TRANSFORMS[t.transform][0](shape))


def transformed(tensor: torch.Tensor, t: "Target") -> torch.Tensor:
    return tensor if t.transform is None else TRANSFORMS[t.transform][1](tensor)


def resolve(model: nn.Module, hf_name: str) -> Target | None:
    """Map an HF checkpoint name to a Target; None for tensors that are known and ignored."""
    if _IGNORED.search(hf_name):
        return None
    skip = getattr(model, "checkpoint_skip", None)   # copies of tensors the model holds once (mtp.py)
    if skip is not None and skip.match(hf_name):
        return None
    skipped = getattr(getattr(model, "spec", None), "skipped_checkpoint_layers", ())
    if skipped and (m := _LAYER.match(hf_name)) and int(m.group(1)) in skipped:
        return None
    if hf_name == "lm_head.weight" and model.spec.tie_word_embeddings:
        return None
    name = hf_name
    for pattern, repl in getattr(model, "hf_renames", ()):
        name = re.sub(pattern, repl, name)
    for pattern, transform in getattr(model, "hf_transforms", ()):
        if re.search(pattern, hf_name):
            return Target(name, transform=transform)
    if m := _PER_EXPERT.match(name):
        prefix, e, proj, kind = m.group(1), int(m.group(2)), m.group(3), m.group(4)
        suffix = "" if kind == "weight" else "_" + kind.removeprefix("weight_")    # FP8 scales: w13_scale_inv, ...
        if proj == "down_proj":
            return Target(f"{prefix}.w2{suffix}", e)
        return Target(f"{prefix}.w13{suffix}", e, 0 if proj == "gate_proj" else 1)
    if m := _FUSED.match(name):
        return Target(f"{m.group(1)}.{'w13' if m.group(2) == 'gate_up_proj' else 'w2'}")
    return Target(name)


def _experts_of(model: nn.Module, param_name: str) -> tuple[int, int, int] | None:
    """(lo, hi, num_experts) when param_name is a stacked-experts weight holding experts [lo, hi)."""
    owner = model.get_submodule(param_name.rpartition(".")[0]) if "." in param_name else model
    if hasattr(owner, "expert_lo") and hasattr(owner, "num_experts"):
        return owner.expert_lo, owner.expert_hi, owner.num_experts
    return None


def target_view(param: torch.Tensor, t: Target, expert_lo: int = 0) -> torch.Tensor:
    view = param if t.expert is None else param[t.expert - expert_lo]
    if t.half is not None:
        rows = view.shape[0] // 2
        view = view[t.half * rows:(t.half + 1) * rows]
    return view


def source_view(tensor: torch.Tensor, t: Target) -> torch.Tensor:
    return tensor if t.source_rows is None else tensor[t.source_rows[0]:t.source_rows[1]]


def _expert_shape(param: torch.Tensor, half: int | None) -> tuple[int, ...]:
    """The shape of one expert's tensor (or its gate/up half) in a stacked-experts parameter."""
    shape = list(param.shape[1:])
    if half is not None:
        shape[0] //= 2
    return tuple(shape)


def _pieces(name: str, experts: tuple[int, int, int] | None,
            held_only: bool = True) -> set[tuple[int | None, int | None]]:
    """Pieces that make up a parameter: (global expert, half) for stacked experts (the held
    ones, or with held_only=False all of the model's), else the whole tensor (None, None)."""
    if experts is None:
        return {(None, None)}
    lo, hi, n = experts
    halves = (0, 1) if name.endswith((".w13", ".b13", ".w13_scale_inv", ".w13_scale")) else (None,)
    return {(e, h) for e in (range(lo, hi) if held_only else range(n)) for h in halves}


def _listing(items: list[str]) -> str:
    more = f"\n  ... and {len(items) - _MAX_LISTED} more" if len(items) > _MAX_LISTED else ""
    return "\n  " + "\n  ".join(items[:_MAX_LISTED]) + more


def plan(model: nn.Module, shapes: dict[str, tuple[int, ...]], *, require_all: bool,
         source: str = "checkpoint") -> dict[str, Target]:
    """Validate every checkpoint name/shape against the model before anything is copied.

    Returns the tensors to copy and where. Experts a sharded model does not hold are checked
    (name, shape, duplicates) and then left out. Raises ValueError naming unexpected keys, shape
    mismatches, overlaps and (with require_all) parameters the checkpoint does not provide.
    """
    params = dict(model.named_parameters())
    targets: dict[str, Target] = {}
    covered: dict[str, set] = {}
    unexpected, bad_shape, overlap = [], [], []
    for hf_name, shape in shapes.items():
        t = resolve(model, hf_name)
        if t is None:
            continue
        shape = transformed_shape(shape, t)
        if t.param not in params:
            unexpected.append(f"{hf_name} {list(shape)}")
            continue
        param = params[t.param]
        experts = _experts_of(model, t.param)
        if experts is None:
            want = tuple(target_view(param, t).shape)
        elif t.expert is None:                       # all experts stacked in one tensor
            want = (experts[2], *param.shape[1:])
        elif not 0 <= t.expert < experts[2]:
            unexpected.append(f"{hf_name} {list(shape)} (the model has {experts[2]} experts)")
            continue
        else:                                        # one expert (any: they all have one shape)
            want = _expert_shape(param, t.half)
        if tuple(shape) != want:
            bad_shape.append(f"{hf_name}: {source} {list(shape)}, model expects {list(want)}")
            continue
        got = _pieces(t.param, experts, held_only=False) if t.expert is None else {(t.expert, t.half)}
        seen = covered.setdefault(t.param, set())
        if seen & got:
            overlap.append(f"{hf_name} (overlaps another tensor for {t.param})")
            continue
        seen |= got
        if experts is not None and t.expert is None and experts[:2] != (0, experts[2]):
            t = Target(t.param, source_rows=experts[:2], transform=t.transform)
        if experts is not None and t.expert is not None and not experts[0] <= t.expert < experts[1]:
            continue                                 # another rank's expert
        targets[hf_name] = t
    missing = []
    if require_all:
        for name, p in params.items():
            if name.rpartition(".")[2] in SCALE_PARAMS:
                continue    # FP8 scales: from the checkpoint, or made when a float weight is quantized
            experts = _experts_of(model, name)
            for e, h in sorted(_pieces(name, experts) - covered.get(name, set()), key=str):
                where = "" if e is None else f" expert {e}" + ("" if h is None else (" gate_proj", " up_proj")[h])
                shape = p.shape if e is None else _expert_shape(p, h)
                missing.append(f"{name}{where} {list(shape)}")
    errors = []
    for title, items in (("missing", missing), ("unexpected", unexpected),
                         ("wrong shape", bad_shape), ("duplicate", overlap)):
        if items:
            errors.append(f"{len(items)} {title} tensor(s):{_listing(items)}")
    if errors:
        raise ValueError(f"{source} does not match {type(model).__name__}:\n" + "\n".join(errors))
    return targets


def copy_into(model: nn.Module, params: dict[str, torch.Tensor], t: Target, value: torch.Tensor) -> None:
    """Copy one planned checkpoint tensor (already sliced to t.source_rows) into its parameter;
    a float value for an FP8 weight is quantized by the weight's module (online FP8, weight updates)."""
    experts = _experts_of(model, t.param)
    lo = experts[0] if experts else 0
    param, value = params[t.param], transformed(value, t)
    if param.dtype == FP8_DTYPE and value.dtype != FP8_DTYPE:
        owner, _, name = t.param.rpartition(".")
        model.get_submodule(owner).write_float(name, t, value, lo)
        return
    if value.dtype == FP8_DTYPE and param.dtype != FP8_DTYPE:
        raise ValueError(f"{t.param}: an FP8 tensor for a weight the model holds in {param.dtype} (its checkpoint "
                         f"has no scale for it)")
    target_view(param, t, lo).copy_(value)


def fp8_modules(model: nn.Module, names) -> set[str]:
    """The model's modules whose FP8 scales a checkpoint with these tensor names holds."""
    out = set()
    for hf_name in names:
        if hf_name.endswith(("weight_scale_inv", "weight_scale")) and (t := resolve(model, hf_name)) is not None:
            out.add(t.param.rpartition(".")[0])
    return out


def checkpoint_names(model_path: str | Path) -> list[str]:
    """Every tensor name of a checkpoint directory (no tensor read)."""
    names = []
    for f in _checkpoint_files(model_path):
        with safe_open(str(f), framework="pt") as st:
            names.extend(st.keys())
    return names


def _checkpoint_files(model_path: str | Path) -> list[Path]:
    path = Path(model_path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        data = json.loads(index.read_text())
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(weight_map, dict) or not weight_map or not all(
                isinstance(f, str) and f for f in weight_map.values()):
            raise ValueError(f"{index.name}: weight_map must be a non-empty object of tensor name -> file name, "
                             f"got {type(weight_map).__name__}")
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
    # MXFP4: each <name>_blocks [E, out, in/32, 16] / <name>_scales pair is one tensor <name>, as
    # transformers holds it dequantized ([E, in, out])
    quantized = pair_mxfp4_names(shapes)
    for name, (blocks, scales) in quantized.items():
        if len(shapes[blocks]) != 4:
            raise ValueError(f"MXFP4 tensor {blocks}: expected [experts, rows, groups, 16], got {list(shapes[blocks])}")
        e, out, groups, per = shapes.pop(blocks)
        shapes.pop(scales)
        shapes[name] = (e, groups * per * 2, out)
    targets = plan(model, shapes, require_all=True)
    params = dict(model.named_parameters())
    dtype = next(iter(params.values())).dtype if params else torch.float32

    def read(st, key: str, t: Target) -> torch.Tensor:
        # NOTE: an expert shard reads only its rows of a stacked-experts tensor
        return st.get_tensor(key) if t.source_rows is None else st.get_slice(key)[slice(*t.source_rows)]

    for name, t in targets.items():
        if name in quantized:
            blocks, scales = quantized[name]
            with safe_open(str(file_of[blocks]), framework="pt") as sb, \
                    safe_open(str(file_of[scales]), framework="pt") as ss:
                _, value = dequantize_checkpoint_tensor(name, read(sb, blocks, t), read(ss, scales, t), dtype)
            copy_into(model, params, t, value)
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for key in st.keys():
                if key in targets:
                    copy_into(model, params, targets[key], read(st, key, targets[key]))


@torch.no_grad()
def load_state_dict_from_tensors(model: nn.Module, named_tensors: dict[str, torch.Tensor]) -> int:
    """Copy HF-named tensors into model, all or nothing: every name and shape is checked first.

    A subset of the parameters is fine (weight updates may be partial). Returns the number of
    tensors accepted (an expert shard copies only its own experts' tensors).
    """
    targets = plan(model, {k: tuple(v.shape) for k, v in named_tensors.items()}, require_all=False,
                   source="tensors")
    params = dict(model.named_parameters())
    for key, t in targets.items():
        copy_into(model, params, t, source_view(named_tensors[key], t))
    # NOTE: counted over the model, not this shard: another rank's experts were validated here too
    return sum(resolve(model, k) is not None for k in named_tensors)
