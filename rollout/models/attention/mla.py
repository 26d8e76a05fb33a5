"""MLASelfAttention: DeepSeek-V2/V3 multi-head latent attention, with W_UK / W_UV absorbed.

Per token: q = q_b(norm(q_a(x))) (or q_proj(x)) split into q_nope [H, nope] and q_rope [H, P];
kv_a_proj_with_mqa(x) = [latent R | k_rope P]; the normed latent and the rotated rope key go
into the KV pool (R + P values per token and layer: never the per-head K/V). kv_b_proj holds
W_UK [H, nope, R] and W_UV [H, v, R]: the query absorbs W_UK (q_nope @ W_UK -> [H, R]), so
q . k = q_lat . latent + q_rope . k_rope, and attention runs in the latent space
(latent_attention.py) with values = latents; W_UV then maps each head's output to [H, v] before
o_proj. Same scores and outputs as expanding K/V per head (transformers' way), up to rounding.
"""
from __future__ import annotations

import torch
from torch import nn

from rollout import exact as exact_ops
from rollout.batch.forward_batch import ForwardBatch
from rollout.models.attention.latent import LatentAttention
from rollout.models.layers import RMSNorm, RotaryEmbedding
from rollout.models.quant.fp8 import dense_weight
from rollout.models.spec import ModelSpec


class MLASelfAttention(nn.Module):
    exact = False   # the absorbed W_UK / W_UV products through rollout.exact.grouped_linear

    def __init__(self, spec: ModelSpec, layer_id: int):
        super().__init__()
        mla = spec.mla
        h = spec.num_attention_heads
        self.num_heads = h
        self.nope, self.rope, self.v_dim, self.rank = (mla.qk_nope_head_dim, mla.qk_rope_head_dim,
                                                       mla.v_head_dim, mla.kv_lora_rank)
        self.interleave = mla.rope_interleave
        qk = self.nope + self.rope
        bias = spec.o_bias
        if mla.q_lora_rank is None:
            self.q_proj = nn.Linear(spec.hidden_size, h * qk, bias=False)
        else:
            self.q_a_proj = nn.Linear(spec.hidden_size, mla.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, 1e-6)
            self.q_b_proj = nn.Linear(mla.q_lora_rank, h * qk, bias=False)
        self.q_lora = mla.q_lora_rank is not None
        self.kv_a_proj_with_mqa = nn.Linear(spec.hidden_size, self.rank + self.rope, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.rank, 1e-6)
        self.kv_b_proj = nn.Linear(self.rank, h * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(h * self.v_dim, spec.hidden_size, bias=bias)
        self.attn = LatentAttention(layer_id=layer_id, num_heads=h, kv_lora_rank=self.rank, rope_dim=self.rope,
                                    scale=mla.softmax_scale)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [N, heads, P]; interleaved pairs are gathered to halves first (then rotate-half RoPE)."""
        if self.interleave:
            x = torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)
        return RotaryEmbedding.apply(x, cos, sin)

    def _w_kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_UK [H, nope, R] and W_UV [H, v, R] (views of kv_b_proj.weight)."""
        w = dense_weight(self.kv_b_proj, self.kv_a_layernorm.weight.dtype).view(self.num_heads, self.nope + self.v_dim,
                                                                                self.rank)
        return w[:, :self.nope], w[:, self.nope:]

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor, None]:
        """x [N, hidden] -> q [N, H, R + P] (latent query, rotated rope query), the latent rows
        [N, R + P] (normed latent, rotated rope key) the KV pool stores, None (no per-head values);
        nothing written (a compiled forward's opaque attention op writes them)."""
        n = x.shape[0]
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if self.q_lora else self.q_proj(x)
        q = q.view(n, self.num_heads, self.nope + self.rope)
        q_nope, q_rope = q.split([self.nope, self.rope], dim=-1)            # [N, H, nope], [N, H, P]
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([self.rank, self.rope], dim=-1)
        latent = self.kv_a_layernorm(latent)                                 # [N, R]
        k_rope = self._rotate(k_rope.view(n, 1, self.rope), cos, sin)        # [N, 1, P]
        rows = torch.cat((latent, k_rope[:, 0]), dim=-1)
        w_uk, _ = self._w_kv()
        if self.exact:
            q_lat = exact_ops.grouped_linear(q_nope.transpose(0, 1), w_uk.transpose(1, 2)).transpose(0, 1)
        else:
            q_lat = torch.einsum("nhd,hdr->nhr", q_nope, w_uk)               # [N, H, R]
        return torch.cat((q_lat, self._rotate(q_rope, cos, sin)), dim=-1), rows, None

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        """x [N, hidden] -> q [N, H, R + P] (latent query, rotated rope query); writes this
        forward's latent + rope key into the KV pool."""
        q, rows, _ = self.qkv(x, cos, sin)
        self.attn.write_latent(rows, fb)
        return q

    def output(self, attn: torch.Tensor) -> torch.Tensor:
        """attn [N, H * R] (attention core output, latent space) -> [N, hidden]."""
        _, w_uv = self._w_kv()
        per_head = attn.view(-1, self.num_heads, self.rank)
        if self.exact:
            heads = exact_ops.grouped_linear(per_head.transpose(0, 1), w_uv).transpose(0, 1)  # [N, H, v]
        else:
            heads = torch.einsum("nhr,hvr->nhv", per_head, w_uv)              # [N, H, v]
        return self.o_proj(heads.reshape(attn.shape[0], self.num_heads * self.v_dim))   # NOTE: 0 rows on an idle DP rank
