"""Router replay (R3): make a trainer model's MoE blocks use given expert ids.

``RouterReplay(model, mode=...)`` is a context over a model:

``off``     nothing is touched.
``record``  the routers run live; ``routed_experts()`` returns their top-k of the last forward.
``replay``  each MoE block uses the expert ids given in ``routed_experts`` and recomputes its gate
            weights from its *own* router logits over that set, with the model's own rule:
            softmax, gather at the replayed ids, renormalise when the model renormalises
            (``norm_topk_prob=True``, Mixtral, DeepSpeed top-2/top-k); otherwise the full-softmax
            probabilities at the replayed ids (OLMoE, Qwen2-MoE with ``norm_topk_prob=False``,
            DeepSpeed top-1). Gathering from the full softmax (never from probabilities zeroed
            outside the live top-k) keeps gradients flowing to every replayed expert's router row.
            Sigmoid routers (DeepSeek-V3, GLM-4.5, MiniMax-M2): the *unbiased* sigmoid scores at
            the replayed ids, divided by their sum when ``norm_topk_prob`` (MiniMax-M2 always),
            times ``routed_scaling_factor`` (MiniMax-M2: none); the ``e_score_correction_bias``
            only ever chose experts, so replay never reads it (it is a load-balancing statistic,
            not trained by gradient). gpt-oss (top-k of the logits, then softmax over those k):
            the softmax over the replayed ids' logits (router bias included), so every replayed
            expert's router row and bias get gradient.

Supported routers: transformers 5.x ``Qwen3MoeTopKRouter``, ``Qwen2MoeTopKRouter``,
``MixtralTopKRouter``, ``OlmoeTopKRouter``, ``DeepseekV3TopkRouter``, ``Glm4MoeTopkRouter``,
``MiniMaxM2TopKRouter``, ``GptOssTopKRouter`` (a forward hook replaces the (weights, ids) part of
the router's output; logits are untouched), and DeepSpeed ``TopKGate`` anywhere in an ``nn.Module``
(a scoped instance-level patch of its ``forward``, see ``trainer_bridge.ds_gating``). Hooks and
patches are installed on ``__enter__`` and removed on ``__exit__``.

Routing layout: ``[num_tokens, num_layers, top_k]`` integer, row ``i`` = the i-th token row the
routers see. For ``input_ids`` of shape ``[B, T]`` (padded or packed) the routers see the
flattened ``B * T`` rows in row-major order, so row ``b * T + t`` is token ``(b, t)``;
``[B, T, num_layers, top_k]`` is accepted and flattened the same way. Layer axis: all layers;
rows of dense layers (no router) are ignored (``-1`` by convention). Every router call must see
exactly ``num_tokens`` rows: ids are looked up by token position, never by call count, so
activation recomputation (gradient checkpointing) and repeated forwards over the same batch
replay the same ids.

Load-balancing aux loss: it uses the *live* top-k. transformers computes it from the router
logits (``output_router_logits=True``), which replay leaves untouched; the DeepSpeed replica
computes ``l_aux`` from the live selection too. The aux loss is a regulariser on the trainer
router's own distribution, so enabling replay leaves its value and gradient unchanged; the
replayed ids only decide which experts compute.

NOTE: run ``backward()`` inside the replay context when gradient checkpointing is on: the
recomputation in backward calls the routers again and needs the hooks; after ``__exit__`` it
would silently use live routing (a warning is issued when that situation is detected).
"""
from __future__ import annotations

import warnings
from typing import Optional

import torch
from torch import nn

from .routers import Router, discover_routers, replay_gate_weights

__all__ = ["RouterReplay", "check_routed_experts"]

MODES = ("off", "record", "replay")

def _in_backward() -> bool:
    """True while autograd executes a backward pass (i.e. activation recomputation).

    NOTE: private torch API (present since 2.0); without it every call counts as a forward call,
    which only affects the call counters and the exit warning, never the replayed ids.
    """
    task_id = getattr(torch._C, "_current_graph_task_id", None)
    return task_id is not None and task_id() != -1


def check_routed_experts(routed: torch.Tensor, *, num_experts: int, top_k: int,
                         moe_layers: Optional[list[int]] = None, what: str = "routed_experts") -> None:
    """ValueError unless every row of every MoE layer holds ``top_k`` distinct ids in ``[0, num_experts)``.

    ``routed``: ``[rows, num_layers, top_k]``. With ``moe_layers=None`` a layer whose entries are
    all ``-1`` is a dense layer; any other layer must be fully valid (no ``-1`` mixed in).
    """
    if routed.ndim != 3 or routed.shape[-1] != top_k:
        raise ValueError(f"{what}: expected [rows, num_layers, top_k={top_k}], got {list(routed.shape)}")
    if routed.numel() == 0:
        return
    r = routed if routed.dtype in (torch.int32, torch.int64) else routed.to(torch.int32)
    if moe_layers is None:
        moe = ~(r == -1).all(dim=2).all(dim=0)  # [num_layers]
    else:
        moe = torch.zeros(r.shape[1], dtype=torch.bool)
        moe[list(moe_layers)] = True
    layers = moe.nonzero().flatten().tolist()
    if not layers:
        return
    sub = r if len(layers) == r.shape[1] else r[:, layers]  # [rows, num_moe_layers, top_k]
    if int(sub.min()) < 0 or int(sub.max()) >= num_experts:
        bad = (sub < 0) | (sub >= num_experts)
        row, li, _ = bad.nonzero()[0].tolist()
        raise ValueError(f"{what}: expert id {sub[row, li].tolist()} at row {row}, layer {layers[li]} "
                         f"is outside [0, {num_experts})" +
                         (" (-1 only allowed in an all -1 dense layer)" if moe_layers is None else ""))
    if top_k > 1:
        s = torch.sort(sub, dim=-1).values
        dup = (s[..., 1:] == s[..., :-1]).any(dim=-1)
        if dup.any():
            row, li = dup.nonzero()[0].tolist()
            raise ValueError(f"{what}: row {row}, layer {layers[li]} repeats an expert id "
                             f"{sub[row, li].tolist()}; each MoE row needs {top_k} distinct ids")


class RouterReplay:
    """Scoped router record/replay over a model; see the module docstring.

    Args:
        model: an ``nn.Module`` holding supported routers.
        mode: ``"off"``, ``"record"`` or ``"replay"``.
        routed_experts: replay only; ``[num_tokens, num_layers, top_k]`` or
            ``[B, T, num_layers, top_k]`` integer (tensor or array).
        keep_router_logits: keep each MoE layer's router logits of the last forward (with their
            autograd graph) for ``router_logits()`` (e.g. the router alignment loss).
        validate: check the ids (range, k distinct per MoE row); ``False`` skips the check for
            routing already validated (``Sample.validate`` on arrival). Shapes are always checked.
    """

    def __init__(self, model: nn.Module, mode: str = "replay", routed_experts=None, *,
                 keep_router_logits: bool = False, validate: bool = True):
        if mode not in MODES:
            raise ValueError(f"RouterReplay mode must be one of {MODES}, got {mode!r}")
        self.model = model
        self.mode = mode
        self.keep_router_logits = keep_router_logits
        self.validate = validate
        self._active = False
        self._routed: Optional[torch.Tensor] = None
        if mode == "off":
            if routed_experts is not None:
                raise ValueError("RouterReplay(mode='off') takes no routed_experts")
            self.routers, self.num_layers = [], 0
            return
        self.routers, self.num_layers = discover_routers(model)
        for r in self.routers:
            if r.kind == "deepspeed":
                from .ds_gating import check_gate
                check_gate(r.module, r.name, mode)
        if mode == "replay":
            if routed_experts is None:
                raise ValueError("RouterReplay(mode='replay') needs routed_experts")
            self.set_routed_experts(routed_experts)
        elif routed_experts is not None:
            raise ValueError("RouterReplay(mode='record') takes no routed_experts (it records them)")

    # ---- properties
    @property
    def top_k(self) -> int:
        return self.routers[0].top_k if self.routers else 0

    @property
    def num_experts(self) -> int:
        return self.routers[0].num_experts if self.routers else 0

    @property
    def moe_layers(self) -> list[int]:
        return [r.layer for r in self.routers]

    # ---- routing in / out
    def set_routed_experts(self, routed_experts) -> None:
        """Replace the replayed routing (e.g. the next micro-batch); validates it first."""
        if self.mode != "replay":
            raise ValueError(f"set_routed_experts needs mode='replay', this context is {self.mode!r}")
        routed = torch.as_tensor(routed_experts)
        if routed.dtype.is_floating_point or routed.dtype == torch.bool:
            raise ValueError(f"routed_experts must be an integer tensor, got {routed.dtype}")
        if routed.ndim == 4:
            routed = routed.reshape(-1, *routed.shape[2:])
        if routed.ndim != 3 or routed.shape[1] != self.num_layers or routed.shape[2] != self.top_k:
            raise ValueError(
                f"routed_experts must be [num_tokens, num_layers={self.num_layers}, top_k={self.top_k}] "
                f"or [B, T, {self.num_layers}, {self.top_k}], got {list(torch.as_tensor(routed_experts).shape)}")
        if self.validate:
            check_routed_experts(routed, num_experts=self.num_experts, top_k=self.top_k,
                                 moe_layers=self.moe_layers)
        self._routed = routed
        as_long = routed.long()
        for r in self.routers:
            r.ids = as_long[:, r.layer].contiguous()  # [num_tokens, top_k]
            r.live = r.logits = None

    def routed_experts(self) -> torch.Tensor:
        """``[num_tokens, num_layers, top_k]`` int32: recorded (record) or replayed (replay) ids."""
        if self.mode == "replay":
            return self._routed.to(torch.int32).reshape(-1, self.num_layers, self.top_k)
        if self.mode == "record":
            return self._stack_live("routed_experts")
        raise ValueError("routed_experts() needs mode 'record' or 'replay'")

    def live_experts(self) -> torch.Tensor:
        """``[num_tokens, num_layers, top_k]`` int32 live top-k of the last forward (-1 dense layers)."""
        if self.mode == "off":
            raise ValueError("live_experts() needs mode 'record' or 'replay'")
        return self._stack_live("live_experts")

    def _stack_live(self, what: str) -> torch.Tensor:
        if any(r.live is None for r in self.routers):
            raise ValueError(f"{what}(): no forward ran through every router inside this context")
        n = {r.live.shape[0] for r in self.routers}
        if len(n) != 1:
            raise ValueError(f"{what}(): routers saw different token counts {sorted(n)}")
        out = torch.full((n.pop(), self.num_layers, self.top_k), -1, dtype=torch.int32,
                         device=self.routers[0].live.device)
        for r in self.routers:
            out[:, r.layer] = r.live.to(torch.int32)
        return out

    def router_logits(self) -> dict[int, torch.Tensor]:
        """{layer: [num_tokens, num_experts] router logits of the last forward}; needs keep_router_logits."""
        if not self.keep_router_logits:
            raise ValueError("router_logits() needs RouterReplay(..., keep_router_logits=True)")
        if any(r.logits is None for r in self.routers):
            raise ValueError("router_logits(): no forward ran through every router inside this context")
        return {r.layer: r.logits for r in self.routers}

    def mismatch_rate(self, mask: Optional[torch.Tensor] = None) -> float:
        """Share of (token, MoE layer) rows whose live top-k set differs from the replayed one.

        ``mask``: optional ``[num_tokens]`` (or ``[B, T]``) bool, rows to count (e.g. not padding).
        """
        if self.mode != "replay":
            raise ValueError("mismatch_rate() needs mode='replay'")
        from .metrics import routing_mismatch_rate
        return routing_mismatch_rate(self.live_experts(), self.routed_experts(), mask=mask)

    # ---- context
    def __enter__(self) -> "RouterReplay":
        if self._active:
            raise RuntimeError("RouterReplay context entered twice")
        for r in self.routers:
            if getattr(r.module, "_router_replay_active", False):
                raise RuntimeError(f"router {r.name!r} is already inside another RouterReplay context")
        try:
            for r in self.routers:
                r.module._router_replay_active = True
                r.forward_calls = r.grad_forward_calls = r.recompute_calls = 0
                if r.kind == "hf":
                    r.handle = r.module.register_forward_hook(self._make_hf_hook(r))
                else:
                    from .ds_gating import patch_gate
                    r.saved_forward = patch_gate(r.module, self, r)
        except BaseException:
            self._restore()
            raise
        self._active = True
        return self

    def __exit__(self, *exc) -> None:
        self._restore()
        self._active = False
        if self.mode == "replay" and exc[0] is None:
            flag = "is_activation_checkpointing"
            if not hasattr(type(self.model), flag):
                flag = "is_gradient_checkpointing"
            ckpt = bool(getattr(self.model, flag, False)) and self.model.training
            if ckpt and any(r.grad_forward_calls > 0 and r.recompute_calls == 0 for r in self.routers):
                warnings.warn("RouterReplay exited before backward() with gradient checkpointing on: "
                              "recomputation after the context uses live routing; call backward() "
                              "inside the context", RuntimeWarning, stacklevel=2)

    def _restore(self) -> None:
        for r in self.routers:
            if r.handle is not None:
                r.handle.remove()
                r.handle = None
            if r.saved_forward is not None:
                from .ds_gating import unpatch_gate
                unpatch_gate(r.module, r.saved_forward)
                r.saved_forward = None
            if "_router_replay_active" in vars(r.module):  # NOTE: a scoped marker, gone after exit
                del r.module._router_replay_active

    # ---- per call
    def _note_call(self, r: Router) -> bool:
        """Count a router call; True for a forward call, False for a recompute in backward."""
        if _in_backward():
            r.recompute_calls += 1
            return False
        r.forward_calls += 1
        r.grad_forward_calls += int(torch.is_grad_enabled())
        return True

    def _make_hf_hook(self, r: Router):
        def hook(module, args, output):
            if not (isinstance(output, tuple) and len(output) == 3):
                raise TypeError(f"router {r.name!r} returned {type(output).__name__}; expected "
                                "(router_logits, weights, ids) as in transformers 5.x")
            logits, live_w, live_ids = output  # [tokens, E], [tokens, K], [tokens, K]
            forward = self._note_call(r)
            if forward:
                r.live = live_ids
                if self.keep_router_logits:
                    r.logits = logits
            if self.mode != "replay":
                return None
            ids = r.replay_ids(logits.shape[0], logits.device)
            weights = replay_gate_weights(r, logits, ids).to(live_w.dtype)
            return logits, weights, ids
        return hook
