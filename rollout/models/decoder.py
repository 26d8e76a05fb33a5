"""SelfAttention (projections, q/k norms, RoPE) and DecoderLayer (pre-norm attention + MLP/MoE)."""
from __future__ import annotations

import torch
from torch import nn

from rollout.batch.forward_batch import ForwardBatch
from rollout.models.attention import PagedAttention
from rollout.models.layers import GatedMLP, RMSNorm, RotaryEmbedding
from rollout.models.mla_attention import MLASelfAttention
from rollout.models.moe import SparseMoE
from rollout.models.sigmoid_moe import GroupedSigmoidMoE
from rollout.models.spec import ModelSpec


class SelfAttention(nn.Module):
    def __init__(self, spec: ModelSpec, layer_id: int):
        super().__init__()
        h, kvh, d = spec.num_attention_heads, spec.num_kv_heads, spec.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = h, kvh, d
        self.q_proj = nn.Linear(spec.hidden_size, h * d, bias=spec.qkv_bias)
        self.k_proj = nn.Linear(spec.hidden_size, kvh * d, bias=spec.qkv_bias)
        self.v_proj = nn.Linear(spec.hidden_size, kvh * d, bias=spec.qkv_bias)
        self.o_proj = nn.Linear(h * d, spec.hidden_size, bias=spec.o_bias)
        self.qk_norm = spec.qk_norm
        if spec.qk_norm == "head":
            self.q_norm = RMSNorm(d, spec.rms_norm_eps)
            self.k_norm = RMSNorm(d, spec.rms_norm_eps)
        elif spec.qk_norm == "full":
            self.q_norm = RMSNorm(h * d, spec.rms_norm_eps)
            self.k_norm = RMSNorm(kvh * d, spec.rms_norm_eps)
        self.clip_qkv = spec.clip_qkv
        self.attn = PagedAttention(layer_id=layer_id, num_heads=h, num_kv_heads=kvh, head_dim=d,
                                   sliding_window=spec.sliding_window(layer_id))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fb: ForwardBatch,
                attn_mask: torch.Tensor | None) -> torch.Tensor:
        """x [N, hidden] -> [N, hidden]."""
        return self.o_proj(self.attn.attend(self.project(x, cos, sin, fb), fb, attn_mask))

    def output(self, attn: torch.Tensor) -> torch.Tensor:
        """attn [N, H*D] (attention core output) -> [N, hidden]."""
        return self.o_proj(attn)

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        """x [N, hidden] -> q [N, H, D] (normed, rotated); this forward's k/v go into the KV pool."""
        n = x.shape[0]
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)          # [N, H*D], [N, kvH*D] x2
        if self.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        if self.clip_qkv is not None:
            c = self.clip_qkv
            q, k, v = q.clamp(-c, c), k.clamp(-c, c), v.clamp(-c, c)
        q = q.view(n, self.num_heads, self.head_dim)
        k = k.view(n, self.num_kv_heads, self.head_dim)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = RotaryEmbedding.apply(q, cos, sin), RotaryEmbedding.apply(k, cos, sin)
        self.attn.write_kv(k, v, fb)
        return q


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.self_attn = MLASelfAttention(spec, layer_id) if spec.mla is not None else SelfAttention(spec, layer_id)
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.is_moe = layer_id in spec.moe_layer_ids
        if self.is_moe and spec.scoring == "sigmoid":
            self.mlp = GroupedSigmoidMoE(spec, layer_id)
        elif self.is_moe:
            self.mlp = SparseMoE(layer_id=layer_id, hidden_size=spec.hidden_size,
                                 intermediate_size=spec.moe_intermediate_size,
                                 num_experts=spec.num_experts, top_k=spec.top_k,
                                 renormalize=spec.renormalize,
                                 shared_intermediate_size=spec.shared_expert_intermediate_size)
        else:
            self.mlp = GatedMLP(spec.hidden_size, spec.intermediate_size)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fb: ForwardBatch,
                attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        """x [N, hidden] -> [N, hidden]; same op order as HF (no fused add+norm) for bf16 parity."""
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
        return x + (self.mlp(h, fb) if self.is_moe else self.mlp(h))
