"""Pack samples into micro-batches; tokens and routing go through one index map.

Layout of a ``PackedBatch`` (N = packed length, a multiple of ``pad_to_multiple``): one row
``[1, N]`` holding the samples back to back, then padding. ``position_ids`` restart at 0 for every
sample and for the padding segment, and no attention mask nor cache is passed
(``model_inputs()``: ``use_cache=False``): transformers 5.x then builds
a block-diagonal causal mask from the position restarts (packed-sequence format), so samples do
not attend to each other. NOTE: transformers 5.x's gpt-oss (``GptOssModel``) does not hand
``position_ids`` to its mask functions, so there the samples of a row would attend to each other;
``enable_packed_masks(model)`` builds its masks from the restarts (``PolicyTrainer`` calls it).
Everything is aligned to the *input position* i:

``input_ids[i]``         token at i
``routed_experts[i]``    routing row of token i (``[N, num_layers, top_k]``, the layout
                         ``RouterReplay`` takes for ``input_ids`` ``[1, N]``)
``target_ids[i]``        the next token of the same sample (what the logits at i predict)
``loss_mask[i]``         1 where ``target_ids[i]`` is a response token with loss mask 1
``rollout_logprobs[i]``  rollout log-prob of ``target_ids[i]`` (0 where not a response token)
``sample_index[i]``      index of the sample in the list given to ``pack_samples`` (-1 padding)

A sample's last token has no routing row (it never went forward in rollout) and padding has none
either: both get the filler row (ids ``0..top_k-1`` in MoE layers, -1 in dense layers: k distinct
valid ids) and have ``loss_mask`` 0 (``routing_mask`` marks the real rows).

Every per-position field is built by ``_take(source, index, fill)`` with the same ``index`` (flat
position in the concatenation of all samples' per-position arrays, -1 = padding), so token row i
and routing row i cannot come apart.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from .sample import Sample

__all__ = ["PackedBatch", "enable_packed_masks", "pack_samples"]

# transformers model classes whose forward builds its attention masks without position_ids, so
# without help a packed row's samples attend to each other (transformers 5.x gpt-oss)
_MASKS_WITHOUT_POSITIONS = ("GptOssModel",)


@dataclass(frozen=True, eq=False)
class PackedBatch:
    input_ids: torch.Tensor  # [1, N] int64
    position_ids: torch.Tensor  # [1, N] int64
    target_ids: torch.Tensor  # [1, N] int64
    loss_mask: torch.Tensor  # [1, N] float32
    rollout_logprobs: torch.Tensor  # [1, N] float32
    sample_index: torch.Tensor  # [1, N] int64, -1 padding
    routing_mask: torch.Tensor  # [1, N] bool, True where routed_experts holds a real row
    routed_experts: Optional[torch.Tensor]  # [N, num_layers, top_k] int32
    index: torch.Tensor  # [N] int64 flat source position, -1 padding (the one index map)
    cu_seqlens: torch.Tensor  # [num_samples + 1] int32, sample boundaries (padding excluded)
    samples: tuple  # the Sample objects in this micro-batch, in packed order

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[1]

    @property
    def num_padding(self) -> int:
        return int((self.index < 0).sum())

    def model_inputs(self) -> dict:
        """Keyword arguments for a transformers causal LM forward over the packed row.

        NOTE: ``use_cache=False`` is required: with a KV cache transformers skips the
        packed-sequence detection and the samples would attend to each other.
        """
        return {"input_ids": self.input_ids, "position_ids": self.position_ids, "use_cache": False}

    def per_token(self, values: torch.Tensor) -> torch.Tensor:
        """Broadcast per-sample ``values`` (indexed like ``pack_samples``' list) to ``[1, N]`` (0 on padding)."""
        values = torch.as_tensor(values)
        idx = self.sample_index.clamp(min=0)
        return torch.where(self.sample_index >= 0, values.to(self.loss_mask.device)[idx],
                           torch.zeros((), dtype=values.dtype))

    def to(self, device) -> "PackedBatch":
        def mv(x):
            return x.to(device) if isinstance(x, torch.Tensor) else x
        return PackedBatch(**{k: mv(v) for k, v in vars(self).items()})


def _take(source: torch.Tensor, index: torch.Tensor, fill: torch.Tensor) -> torch.Tensor:
    """``source[index]`` along dim 0, with ``fill`` (broadcast to a row) where ``index < 0``."""
    out = source[index.clamp(min=0)]
    pad = (index < 0).reshape(-1, *([1] * (source.ndim - 1)))
    return torch.where(pad, fill.to(source.dtype), out)


def _filler_row(samples: Sequence[Sample], moe_layers) -> Optional[torch.Tensor]:
    routed = [s.routed_experts for s in samples]
    if all(r is None for r in routed):
        return None
    if any(r is None for r in routed):
        missing = next(s.rid for s in samples if s.routed_experts is None)
        raise ValueError(f"sample {missing!r} has no routed_experts while others do")
    shapes = {tuple(r.shape[1:]) for r in routed}
    if len(shapes) != 1:
        raise ValueError(f"samples disagree on routed_experts [num_layers, top_k]: {sorted(shapes)}")
    num_layers, top_k = shapes.pop()
    if moe_layers is None:
        rows = torch.cat([r.reshape(-1, num_layers, top_k) for r in routed])
        moe = ~(rows == -1).all(dim=2).all(dim=0) if rows.shape[0] else torch.ones(num_layers, dtype=torch.bool)
    else:
        moe = torch.zeros(num_layers, dtype=torch.bool)
        moe[list(moe_layers)] = True
    fill = torch.arange(top_k, dtype=torch.int32).expand(num_layers, top_k).clone()
    fill[~moe] = -1
    return fill  # [num_layers, top_k]


def pack_samples(samples: Sequence[Sample], *, pad_to_multiple: int = 1, max_tokens: Optional[int] = None,
                 pad_token_id: int = 0, moe_layers: Optional[list[int]] = None) -> list[PackedBatch]:
    """Pack ``samples`` into micro-batches of at most ``max_tokens`` (None: one micro-batch).

    Samples go first-fit in the given order; each micro-batch is padded to a multiple of
    ``pad_to_multiple``. ``moe_layers`` (optional) names the MoE layers for the filler rows; by
    default layers that are all -1 in every sample are dense.
    """
    if pad_to_multiple < 1:
        raise ValueError(f"pad_to_multiple must be >= 1, got {pad_to_multiple}")
    if max_tokens is not None and (max_tokens < 1 or max_tokens % pad_to_multiple):
        raise ValueError(f"max_tokens={max_tokens} must be a positive multiple of pad_to_multiple={pad_to_multiple}")
    if not samples:
        return []
    fill_route = _filler_row(samples, moe_layers)

    tok, pos, tgt, lmask, lp, sidx, rmask, route = [], [], [], [], [], [], [], []
    starts, lengths = [], []
    offset = 0
    for i, s in enumerate(samples):
        T, P = s.num_tokens, len(s.prompt_ids)
        if P < 1:
            raise ValueError(f"sample {s.rid!r} has an empty prompt")
        if max_tokens is not None and T > max_tokens:
            raise ValueError(f"sample {s.rid!r} has {T} tokens, more than max_tokens={max_tokens}")
        tokens = s.tokens
        resp = torch.zeros(T, dtype=torch.float32)  # mask of the *target* at each position
        resp[P - 1:T - 1] = s.loss_mask
        logp = torch.zeros(T, dtype=torch.float32)
        if s.rollout_logprobs is not None:
            if len(s.rollout_logprobs) != s.response_length:
                raise ValueError(f"sample {s.rid!r}: rollout_logprobs length {len(s.rollout_logprobs)} "
                                 f"!= response length {s.response_length}")
            logp[P - 1:T - 1] = s.rollout_logprobs
        tok.append(tokens)
        pos.append(torch.arange(T))
        tgt.append(torch.cat([tokens[1:], tokens.new_full((1,), pad_token_id)]))
        lmask.append(resp)
        lp.append(logp)
        sidx.append(torch.full((T,), i, dtype=torch.long))
        has_row = torch.ones(T, dtype=torch.bool)
        has_row[T - 1] = False
        rmask.append(has_row)
        if fill_route is not None:
            if s.routed_experts.shape[0] != T - 1:
                raise ValueError(f"sample {s.rid!r}: routed_experts has {s.routed_experts.shape[0]} rows, "
                                 f"expected T-1 = {T - 1}")
            route.append(torch.cat([s.routed_experts.to(torch.int32), fill_route[None]]))
        starts.append(offset)
        lengths.append(T)
        offset += T
    src = dict(input_ids=torch.cat(tok), position_ids=torch.cat(pos), target_ids=torch.cat(tgt),
               loss_mask=torch.cat(lmask), rollout_logprobs=torch.cat(lp), sample_index=torch.cat(sidx),
               routing_mask=torch.cat(rmask))
    fills = dict(input_ids=pad_token_id, position_ids=0, target_ids=pad_token_id, loss_mask=0.0,
                 rollout_logprobs=0.0, sample_index=-1, routing_mask=False)
    routes = torch.cat(route) if fill_route is not None else None

    bins: list[list[int]] = []
    used: list[int] = []
    for i, T in enumerate(lengths):
        for b in range(len(bins)):
            if max_tokens is None or used[b] + T <= max_tokens:
                bins[b].append(i)
                used[b] += T
                break
        else:
            bins.append([i])
            used.append(T)

    out = []
    for members, n in zip(bins, used):
        N = -(-n // pad_to_multiple) * pad_to_multiple
        index = torch.cat([torch.arange(starts[i], starts[i] + lengths[i]) for i in members]
                          + [torch.full((N - n,), -1, dtype=torch.long)])
        fields = {k: _take(v, index, torch.tensor(fills[k]))[None] for k, v in src.items()}
        fields["position_ids"][0, n:] = torch.arange(N - n)  # NOTE: padding is its own packed segment
        cu = torch.tensor([0] + [lengths[i] for i in members], dtype=torch.int32).cumsum(0, dtype=torch.int32)
        out.append(PackedBatch(
            **fields,
            routed_experts=_take(routes, index, fill_route) if routes is not None else None,
            index=index, cu_seqlens=cu, samples=tuple(samples[i] for i in members)))
    return out


def enable_packed_masks(model: torch.nn.Module) -> int:
    """In place: every decoder of ``model`` in ``_MASKS_WITHOUT_POSITIONS`` (transformers' gpt-oss)
    gets a forward pre-hook that, for a forward without attention mask and cache
    (``PackedBatch.model_inputs()``), builds its full and sliding-window masks with the
    ``position_ids`` (block-diagonal per packed sample, as transformers does for the other models)
    and hands them to the forward. Idempotent; returns how many decoders it hooked (0 for a model
    that needs nothing)."""
    hooked = 0
    for m in model.modules():
        if type(m).__name__ in _MASKS_WITHOUT_POSITIONS and "_packed_masks_hook" not in vars(m):
            m._packed_masks_hook = m.register_forward_pre_hook(_packed_masks, with_kwargs=True)
            hooked += 1
    return hooked


def _packed_masks(module, args, kwargs):
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    position_ids = kwargs.get("position_ids")
    use_cache = kwargs.get("use_cache")
    if use_cache is None:
        use_cache = getattr(module.config, "use_cache", False)
    if (args or position_ids is None or kwargs.get("attention_mask") is not None or use_cache
            or kwargs.get("cache") is not None or kwargs.get("past_key_values") is not None):
        return None                                  # not the packed form: transformers' own masks
    embeds = kwargs.get("inputs_embeds")
    if embeds is None:
        embeds = module.embed_tokens(kwargs["input_ids"])                          # [B, N, hidden]
    mask_kwargs = dict(config=module.config, inputs_embeds=embeds, attention_mask=None, cache=None,
                       position_ids=position_ids)
    masks = {"full_attention": create_causal_mask(**mask_kwargs),
             "sliding_attention": create_sliding_window_causal_mask(**mask_kwargs)}
    return args, {**kwargs, "input_ids": None, "inputs_embeds": embeds, "attention_mask": masks}
