"""Exact mode's DeepSeek-V3 attention: MLA computed as the engine's deterministic mode computes it.

transformers' DeepseekV3Attention expands the latent KV into per-head keys and values
(kv_b_proj over the latent) and attends per head; the engine (rollout/models/attention/mla.py,
latent_attention.py) absorbs W_UK into the queries and W_UV into the output and attends in the
latent space over one shared KV row [normed latent | rotated rope key] per token. The two agree
only up to rounding, so ExactMLAAttention's forward is the engine's order, op for op, on the
transformers module's own parameters:

    q        = q_b_proj(q_a_layernorm(q_a_proj(x)))  (or q_proj(x)), split [H, nope] | [H, rope]
    latent   = kv_a_layernorm(kv_a_proj_with_mqa(x)[:, :R]); k_rope = rotate(... [:, R:])
    q_lat    = grouped_linear(q_nope per head, W_UK)          W_UK, W_UV: views of kv_b_proj.weight
    rows     = every (token, head) pair's [q_lat | rotate(q_rope)], one KV head [latent | k_rope]
    out      = rollout.exact.attention(rows, kv, kv, causal per sample, softmax_scale)[..., :R]
    o_proj(grouped_linear(out per head, W_UV))

rotate is the engine's: interleaved pairs gathered to halves (rope_interleave), then rotate-half
RoPE with the engine's YaRN cos/sin (exact_model's rotary). softmax_scale is the engine's
(ModelSpec.mla.softmax_scale: (nope + rope)^-0.5 times YaRN's mscale^2), set on the module by
make_trainer_exact as `exact_softmax_scale`. Every op is differentiable.
"""
from __future__ import annotations

import torch
from torch import nn

from rollout import exact as exact_ops

from .exact_grid import PackedGrid

__all__ = ["ExactMLAAttention", "rotate_rope"]


def rotate_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> torch.Tensor:
    """x [N, heads, P], cos/sin [N, 1, P] -> rotated x, as rollout.models.attention.mla._rotate."""
    if interleave:
        x = torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class ExactMLAAttention(nn.Module):
    """Mixin for transformers' DeepseekV3Attention (its parameters, its forward signature)."""

    exact_softmax_scale: float      # set by make_trainer_exact from the engine's ModelSpec
    exact_rope_interleave: bool

    def forward(self, hidden_states: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor],
                attention_mask: torch.Tensor | None = None, cache=None, **kwargs):
        """hidden_states [1, N, hidden] of one packed row (kwargs: its position_ids [1, N])
        -> ([1, N, hidden], None)."""
        if cache is not None:
            raise ValueError("exact MLA attention computes whole packed samples (use_cache must be off)")
        grid = PackedGrid.from_position_ids(kwargs.get("position_ids"), hidden_states.shape[0])
        h, nope, rope, rank = self.num_heads, self.qk_nope_head_dim, self.qk_rope_head_dim, self.kv_lora_rank
        interleave = self.exact_rope_interleave
        x = hidden_states[0]                                                       # [N, hidden]
        n = x.shape[0]
        cos, sin = (t.reshape(n, 1, -1) for t in position_embeddings)              # [N, 1, P]
        q = self.q_proj(x) if self.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_rope = q.view(n, h, nope + rope).split([nope, rope], dim=-1)    # [N, H, nope], [N, H, P]
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([rank, rope], dim=-1)
        latent = self.kv_a_layernorm(latent)                                       # [N, R]
        k_rope = rotate_rope(k_rope.view(n, 1, rope), cos, sin, interleave)        # [N, 1, P]
        kv = torch.cat((latent, k_rope[:, 0]), dim=-1)                             # [N, R + P]: the engine's pool row
        w = self.kv_b_proj.weight.view(h, nope + self.v_head_dim, rank)
        w_uk, w_uv = w[:, :nope], w[:, nope:]                                      # [H, nope, R], [H, v, R]
        q_lat = exact_ops.grouped_linear(q_nope.transpose(0, 1), w_uk.transpose(1, 2)).transpose(0, 1)
        q = torch.cat((q_lat, rotate_rope(q_rope, cos, sin, interleave)), dim=-1)  # [N, H, R + P]
        out = self._latent_attention(grid, q, kv)                                  # [N, H, R]
        heads = exact_ops.grouped_linear(out.transpose(0, 1), w_uv).transpose(0, 1)   # [N, H, v]
        return self.o_proj(heads.reshape(1, n, h * self.v_head_dim)), None

    def _latent_attention(self, grid: PackedGrid, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        """q [N, H, R + P], kv [N, R + P] -> [N, H, R]: per sample, every (token, head) pair is a
        query row of the one KV head (rows token-major, as latent_attention.LatentAttention._grid);
        the values are the same rows, their rope columns dropped from the output."""
        h, d = q.shape[1], q.shape[2]
        s, t = grid.segments, grid.longest
        rows = grid.to_grid(q).reshape(s, 1, t * h, d)                            # [S, 1, T*H, D]
        keys = grid.to_grid(kv).view(s, 1, t, d)                                  # [S, 1, T, D]
        mask = grid.causal_mask()                                                 # [S, T, T]
        row_mask = mask[:, None, :, None, :].expand(s, 1, t, h, t).reshape(s, 1, t * h, t)
        out = exact_ops.attention(rows, keys, keys, row_mask, self.exact_softmax_scale)   # [S, 1, T*H, D]
        return grid.from_grid(out.view(s, t, h, d)[..., :self.kv_lora_rank])
