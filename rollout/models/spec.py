"""ModelSpec: one normalised description of an MoE decoder, parsed from an HF config.json."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from capture.routing_shape import routing_shape
from rollout.models.registry import ModelInfo
from rollout.models.rope_scaling import YarnScaling

QK_NORM_MODES = ("none", "head", "full")
SCORING = ("softmax", "sigmoid", "topk_softmax")   # rollout/models/moe/routing.py


@dataclass(frozen=True, kw_only=True)
class MLASpec:
    """Multi-head latent attention (DeepSeek-V2/V3): the KV cache holds kv_lora_rank + qk_rope_head_dim
    values per token and layer (the normed latent and the rotated rope key)."""

    q_lora_rank: Optional[int]       # None: a plain q_proj
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool = True     # rope dims laid out in pairs (x0, x1), (x2, x3), ...
    softmax_scale: float

    @property
    def latent_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    architecture: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...]
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: str = "none"            # "head": RMSNorm over head_dim (Qwen3); "full": over q/k projection (OLMoE)
    clip_qkv: float | None = None
    sliding_windows: tuple[int | None, ...] = ()   # per layer; () = no sliding window anywhere
    intermediate_size: int = 0       # dense MLP layers
    num_experts: int
    top_k: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int = 0
    renormalize: bool
    moe_layer_ids: tuple[int, ...]
    # DeepSeek-V3 / GLM-4.5: sigmoid scoring with a correction bias inside groups (topk.grouped_sigmoid_topk),
    # ungated shared experts (mlp.shared_experts), partial / YaRN RoPE, MLA, MTP layers to skip
    scoring: str = "softmax"
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    shared_experts_intermediate_size: int = 0
    # gpt-oss: a biased router (top-k of the logits, then softmax), experts with biases and the
    # clamped SwiGLU, learned attention sinks
    router_bias: bool = False
    expert_bias: bool = False
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.702
    attention_sinks: bool = False
    partial_rotary_factor: float = 1.0
    rope_scaling: Optional[YarnScaling] = None
    mla: Optional[MLASpec] = None
    skipped_checkpoint_layers: tuple[int, ...] = ()   # e.g. multi-token-prediction layers

    def __post_init__(self):
        if self.num_attention_heads % self.num_kv_heads:
            raise ValueError(f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads={self.num_kv_heads}")
        if self.qk_norm not in QK_NORM_MODES:
            raise ValueError(f"qk_norm must be one of {QK_NORM_MODES}, got {self.qk_norm!r}")
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError(f"num_experts_per_tok={self.top_k} must be in [1, num_experts={self.num_experts}]")
        if self.sliding_windows and len(self.sliding_windows) != self.num_hidden_layers:
            raise ValueError("sliding_windows needs one entry per layer")
        if self.scoring not in SCORING:
            raise ValueError(f"scoring_func must be one of {SCORING}, got {self.scoring!r}")
        if self.n_group < 1 or self.num_experts % self.n_group or not 1 <= self.topk_group <= self.n_group:
            raise ValueError(f"n_group={self.n_group} must divide n_routed_experts={self.num_experts} and "
                             f"topk_group={self.topk_group} must be in [1, n_group]")
        if self.top_k > self.topk_group * (self.num_experts // self.n_group):
            raise ValueError(f"num_experts_per_tok={self.top_k} must be <= topk_group x experts per group "
                             f"= {self.topk_group * (self.num_experts // self.n_group)}")
        if self.rotary_dim % 2 or self.rotary_dim <= 0:
            raise ValueError(f"the rotary dimension ({self.rotary_dim}) must be even and > 0")
        dense = set(range(self.num_hidden_layers)) - set(self.moe_layer_ids)
        if dense and self.intermediate_size <= 0:
            raise ValueError(f"dense layers {sorted(dense)} need intermediate_size > 0")

    def sliding_window(self, layer_id: int) -> int | None:
        return self.sliding_windows[layer_id] if self.sliding_windows else None

    @property
    def rotary_dim(self) -> int:
        """Dims of each head that RoPE rotates (MLA: the rope part of q/k)."""
        if self.mla is not None:
            return self.mla.qk_rope_head_dim
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def attention_widths(self) -> tuple[int, int]:
        """(query width per head, attention core output width per token) as the attention core
        sees them: MLA attends in the latent space (its queries absorb W_UK)."""
        if self.mla is not None:
            return self.mla.latent_dim, self.num_attention_heads * self.mla.kv_lora_rank
        return self.head_dim, self.num_attention_heads * self.head_dim

    @property
    def info(self) -> ModelInfo:
        return ModelInfo(
            architecture=self.architecture, num_hidden_layers=self.num_hidden_layers,
            num_experts=self.num_experts, top_k=self.top_k, moe_layer_ids=self.moe_layer_ids,
            vocab_size=self.vocab_size, hidden_size=self.hidden_size,
            num_attention_heads=self.num_attention_heads, num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim, max_position_embeddings=self.max_position_embeddings,
            eos_token_ids=self.eos_token_ids, kv_latent_dim=self.mla.latent_dim if self.mla else 0)


def require(cfg: dict, key: str):
    if cfg.get(key) is None:
        raise ValueError(f"config.json is missing required field {key!r}")
    return cfg[key]


def rope_theta(cfg: dict, default: float, scaled_ok: bool = False) -> float:
    """rope_theta from HF 5.x `rope_parameters` or the older top-level rope_theta/rope_scaling.
    scaled_ok: the model reads its scaling itself (rope_scaling.rope_parameters)."""
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or {}
    rope_type = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type != "default" and not scaled_ok:
        raise ValueError(f"rope type {rope_type!r} is not supported (only 'default')")
    return float(params.get("rope_theta", cfg.get("rope_theta", default)))


def eos_token_ids(cfg: dict, generation_config: dict | None) -> tuple[int, ...]:
    ids: list[int] = []
    for source in (cfg, generation_config or {}):
        eos = source.get("eos_token_id")
        for t in ([] if eos is None else [eos] if isinstance(eos, int) else eos):
            if t not in ids:
                ids.append(int(t))
    return tuple(ids)


def common_fields(cfg: dict, generation_config: dict | None, *, default_theta: float = 10000.0,
                  default_eps: float = 1e-6, default_max_pos: int = 4096, scaled_rope_ok: bool = False) -> dict:
    """Fields every supported decoder reads the same way (HF semantics, incl. head_dim fallback)."""
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {cfg['hidden_act']!r} is not supported (only 'silu')")
    hidden = int(require(cfg, "hidden_size"))
    heads = int(require(cfg, "num_attention_heads"))
    return dict(
        architecture=cfg["architectures"][0],
        vocab_size=int(require(cfg, "vocab_size")),
        hidden_size=hidden,
        num_hidden_layers=int(require(cfg, "num_hidden_layers")),
        num_attention_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        rms_norm_eps=float(cfg.get("rms_norm_eps", default_eps)),
        rope_theta=rope_theta(cfg, default_theta, scaled_rope_ok),
        max_position_embeddings=int(cfg.get("max_position_embeddings", default_max_pos)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        eos_token_ids=eos_token_ids(cfg, generation_config),
    )


def routing_fields(cfg: dict) -> dict:
    """num_experts, top_k and moe_layer_ids as capture.routing_shape reads them (the one rule the
    config file and the trainer's client read too)."""
    shape = routing_shape(cfg)
    return dict(num_experts=shape.num_experts, top_k=shape.top_k, moe_layer_ids=shape.moe_layer_ids)
