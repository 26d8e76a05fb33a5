"""MoeCausalLM: embeddings -> decoder layers -> norm -> lm_head, over a ForwardBatch; each
DecoderLayer is SelfAttention (projections, q/k norms, RoPE) then the MLP or MoE, pre-norm."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from rollout import exact as exact_ops
from rollout.batch.forward_batch import ForwardBatch
from rollout.models import opaque_step
from rollout.models.attention.mla import MLASelfAttention
from rollout.models.attention.paged import PagedAttention
from rollout.models.attention.self_attention import SelfAttention
from rollout.models.layers import GatedMLP, RMSNorm, RotaryEmbedding
from rollout.models.moe.block import SparseMoE
from rollout.models.moe.experts import FusedExperts
from rollout.models.registry import ModelInfo
from rollout.models.spec import ModelSpec


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.self_attn = MLASelfAttention(spec, layer_id) if spec.mla is not None else SelfAttention(spec, layer_id)
        self.attn_width = spec.attention_widths[1]     # the attention core's output per token
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.is_moe = layer_id in spec.moe_layer_ids
        if self.is_moe:
            self.mlp = SparseMoE(spec, layer_id)
        else:
            self.mlp = GatedMLP(spec.hidden_size, spec.intermediate_size)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fb: ForwardBatch,
                attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        """x [N, hidden] -> [N, hidden]; same op order as HF (no fused add+norm) for bf16 parity."""
        if fb.opaque is not None:
            # a compiled forward: the KV write and the attention core are one opaque op
            q, k, v = self.self_attn.qkv(self.input_layernorm(x), cos, sin)
            return self.finish(x, opaque_step.attention(fb.opaque, self.layer_id, self.attn_width, q, k, v), fb)
        q = self.attention_input(x, cos, sin, fb)
        return self.finish(x, self.self_attn.attn.attend(q, fb, attn_mask), fb)

    # The three parts of forward, for runners that cut the forward at the attention core (prefill
    # CUDA graphs): attention_input and finish are token-wise; only attend needs the step's grid.
    def attention_input(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        """x [N, hidden] -> q [N, H, D]; writes this layer's KV into the KV pool."""
        return self.self_attn.project(self.input_layernorm(x), cos, sin, fb)

    def finish(self, x: torch.Tensor, attn: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        """x [N, hidden] (the layer's input), attn [N, H*D] (attention core output) -> [N, hidden]."""
        x = x + self.self_attn.output(attn)
        h = self.post_attention_layernorm(x)
        if not self.is_moe:
            return x + self.mlp(h)
        return x + (self.mlp(h, fb) if fb.opaque is None else opaque_step.sparse_moe(fb.opaque, self.layer_id, h))


class MoeCausalLM(nn.Module):
    """Shared body of the supported MoE decoders; subclasses only parse their config.

    Parameter names follow HF (model.layers.{i}.self_attn.q_proj.weight, ...), except the fused
    experts: model.layers.{i}.mlp.experts.w13 [E, 2I, H] and .w2 [E, H, I] (see loader.py).
    """

    # (regex, replacement) applied to checkpoint names before mapping (e.g. Mixtral's block_sparse_moe)
    hf_renames: tuple[tuple[str, str], ...] = ()
    exact = False   # lm_head through rollout.exact.linear (deterministic inference)
    # quantization_config.quant_method values its checkpoints may declare (rollout/models/quant/)
    quantized_formats: tuple[str, ...] = ("fp8", "compressed-tensors")

    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.spec = spec
        self.model = nn.Module()
        # NOTE: no random init (the loader writes every weight): Embedding's normal_ imports
        # torch._dynamo, over a second of every engine's startup, even on the meta device
        self.model.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size,
                                               _weight=torch.empty(spec.vocab_size, spec.hidden_size))
        self.model.layers = nn.ModuleList(DecoderLayer(spec, i) for i in range(spec.num_hidden_layers))
        self.model.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        # NOTE: tied embeddings have no lm_head module at all (so no tie can break on .to/.to_empty);
        # the checkpoint's lm_head.weight, if any, is ignored, as HF does.
        if not spec.tie_word_embeddings:
            self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(spec.rotary_dim, spec.rope_theta, spec.rope_scaling)

    @classmethod
    def spec_from_config(cls, cfg: dict, generation_config: dict | None = None) -> ModelSpec:
        raise NotImplementedError

    @classmethod
    def from_config(cls, cfg: dict, generation_config: dict | None = None) -> "MoeCausalLM":
        return cls(cls.spec_from_config(cfg, generation_config))

    def quantize_fp8(self, scheme, modules: set[str] | None = None) -> None:
        """Hold weights in FP8 (call on the unloaded (meta) model): the named modules (a checkpoint's
        FP8 linears and experts), or with modules=None every linear but the lm_head and every
        expert weight (online quantization). The routers are never quantized."""
        from rollout.models.quant.fp8 import quantize_linears  # noqa: PLC0415

        for name, module in self.named_modules():
            if isinstance(module, FusedExperts) and (modules is None or name in modules):
                module.quantize_fp8(scheme)
        quantize_linears(self, scheme, modules)

    def shard_experts(self, rank: int, size: int) -> None:
        """Expert parallel: keep only rank `rank` of `size`'s share of every MoE layer's experts.
        Call on the unloaded (meta) model; the loader then reads only those experts."""
        from rollout.models.moe.ep_group import expert_range
        for module in self.model.layers.modules():   # NOTE: an attached MTP layer (mtp.py) keeps all its experts
            if isinstance(module, FusedExperts):
                module.shard(*expert_range(module.num_experts, rank, size))

    @property
    def info(self) -> ModelInfo:
        return self.spec.info

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.spec.tie_word_embeddings else self.lm_head.weight

    @torch.no_grad()
    def forward(self, fb: ForwardBatch, return_all_logits: bool = False) -> torch.Tensor:
        """-> float32 logits [B, vocab] at fb.logits_indices, or [N, vocab] with return_all_logits."""
        x, cos, sin = self.embed(fb)
        # NOTE: a compiled forward's attention op makes its masks itself (they have the step's grid)
        masks = self.attention_masks(fb) if fb.opaque is None else [None] * len(self.model.layers)
        for layer, mask in zip(self.model.layers, masks):
            x = layer(x, cos, sin, fb, mask)
        if getattr(fb.kv_pool, "hidden", None) is not None:
            # NOTE: the logits below norm only their own rows, as without hidden states kept
            self.store_hidden(self.model.norm(x), fb)
        if not return_all_logits:
            x = x[fb.logits_indices]                                        # [B, hidden]
        return self.logits(self.model.norm(x))

    @staticmethod
    def store_hidden(normed: torch.Tensor, fb: ForwardBatch) -> None:
        """Every token's final-normed hidden state [N, hidden] into its KV slot, for a pool that keeps
        them (NEXTN drafts: rollout/core/mtp_drafter.py). The logits are computed as without it."""
        if getattr(fb.kv_pool, "hidden", None) is not None:
            fb.kv_pool.write_hidden(fb.out_cache_loc, normed)

    # The parts of forward, for runners that run it piecewise (see runners/piecewise_backend.py).
    def embed(self, fb: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> hidden states [N, hidden] and RoPE cos, sin [N, 1, spec.rotary_dim] (RotaryEmbedding.rotation)."""
        x = self.model.embed_tokens(fb.input_ids)                           # [N, hidden]
        cos, sin = self.rotary.rotation(fb.positions, x.dtype)              # [N, 1, D] x2
        return x, cos, sin

    def attention_masks(self, fb: ForwardBatch) -> list[torch.Tensor | None]:
        """Per layer: None (fb.attn_mask) or its sliding-window mask (one per distinct window);
        None for layers whose attention reads no mask (a kernel backend knows the layer's window)."""
        by_window: dict[int, torch.Tensor] = {}
        masks: list[torch.Tensor | None] = []
        for layer in self.model.layers:
            attn = layer.self_attn.attn
            window = attn.sliding_window if attn.reads_mask(fb) else None
            if window is not None and window not in by_window:
                by_window[window] = PagedAttention.sliding_window_mask(fb, window)
            masks.append(None if window is None else by_window[window])
        return masks

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final-normed hidden states [B, hidden] -> float32 logits [B, vocab]."""
        return (exact_ops.linear if self.exact else F.linear)(hidden, self.lm_head_weight).float()
