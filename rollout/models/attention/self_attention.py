"""SelfAttention: GQA / MHA projections, q/k norms, clipping and RoPE around the PagedAttention
core (MLA layers use attention/mla.py)."""
from __future__ import annotations

import torch
from torch import nn

from rollout.batch.forward_batch import ForwardBatch
from rollout.models.attention.paged import PagedAttention
from rollout.models.layers import RMSNorm, RotaryEmbedding
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
                                   sliding_window=spec.sliding_window(layer_id), sinks=spec.attention_sinks)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fb: ForwardBatch,
                attn_mask: torch.Tensor | None) -> torch.Tensor:
        """x [N, hidden] -> [N, hidden]."""
        return self.o_proj(self.attn.attend(self.project(x, cos, sin, fb), fb, attn_mask))

    def output(self, attn: torch.Tensor) -> torch.Tensor:
        """attn [N, H*D] (attention core output) -> [N, hidden]."""
        return self.o_proj(attn)

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        """x [N, hidden] -> q [N, H, D] (normed, rotated); this forward's k/v go into the KV pool."""
        q, k, v = self.qkv(x, cos, sin)
        self.attn.write_kv(k, v, fb)
        return q

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [N, hidden] -> q [N, H, D], k [N, kvH, D] (normed, rotated), v [N, kvH, D]; nothing written."""
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
        return q, k, v
