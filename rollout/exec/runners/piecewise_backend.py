"""PiecewiseBackend: prefill buckets run as pieces cut at each layer's attention core.

A prefill step's attention grid ([requests, new tokens, context]) differs every step, so a whole
forward cannot be one CUDA graph without a grid of the worst case (requests x bucket tokens x
context length: far too large). Everything else in a prefill forward is token-wise and has the
bucket's static shape, so the forward is cut into L + 1 pieces:

    piece 0:   embed, RoPE tables, layer 0 up to its q (k/v written to the KV pool)
    piece i:   the rest of layer i-1 (o_proj, residual, norm, MLP/MoE with its DP gather and
               routed-expert capture), then layer i up to its q
    piece L:   the rest of layer L-1 and the final norm

with the attention core of layer i run eagerly between piece i and piece i+1 over the step's own
grid. The pieces read and write static buffers (hidden states, q, attention output, RoPE tables),
shared by every bucket (sized for the largest); on a GPU each piece of each bucket is one CUDA
graph, all in one memory pool, captured largest bucket first. On CPU the same pieces run as plain
calls over the same buffers, so this path (cuts, buffers, padding) runs in CI. The lm_head runs
eagerly on the rows of the requests' last tokens only.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Hashable, Optional

import torch

from rollout.batch.forward_batch import ForwardBatch
from rollout.exec.runners.graph_backend import GraphMemoryPool


class PiecewiseBackend:
    WARMUP_RUNS = 2

    def __init__(self, model: torch.nn.Module, *, max_tokens: int, device: torch.device, use_graphs: bool,
                 pool: Optional[GraphMemoryPool] = None):
        self.model = model
        self.uses_graphs = use_graphs
        spec = model.spec
        dtype = next(model.parameters()).dtype
        heads = spec.num_attention_heads
        q_width, attn_width = spec.attention_widths     # MLA: latent-space queries and outputs

        def buf(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        self.x = buf(max_tokens, spec.hidden_size)              # hidden states between pieces
        self.q = buf(max_tokens, heads, q_width)                # the next attention core's queries
        self.attn = buf(max_tokens, attn_width)                 # the last attention core's output
        self.cos, self.sin = buf(max_tokens, 1, spec.rotary_dim), buf(max_tokens, 1, spec.rotary_dim)
        self.graphs: dict[Hashable, list[torch.cuda.CUDAGraph]] = {}
        self.pool = pool or GraphMemoryPool()

    @property
    def num_layers(self) -> int:
        return len(self.model.model.layers)

    def pieces(self, fb: ForwardBatch) -> list[Callable[[], None]]:
        """The L + 1 token-wise pieces of fb's forward, each reading and writing the static buffers."""
        n = fb.num_tokens
        x, q, attn, cos, sin = self.x[:n], self.q[:n], self.attn[:n], self.cos[:n], self.sin[:n]
        layers = self.model.model.layers

        def first() -> None:
            x0, c, s = self.model.embed(fb)
            cos.copy_(c)
            sin.copy_(s)
            x.copy_(x0)
            q.copy_(layers[0].attention_input(x0, c, s, fb))

        def between(i: int) -> Callable[[], None]:
            def piece() -> None:
                xi = layers[i - 1].finish(x, attn, fb)
                x.copy_(xi)
                q.copy_(layers[i].attention_input(xi, cos, sin, fb))
            return piece

        def last() -> None:
            x.copy_(self.model.model.norm(layers[-1].finish(x, attn, fb)))
            self.model.store_hidden(x, fb)

        return [first] + [between(i) for i in range(1, len(layers))] + [last]

    def _attend(self, layer: int, fb: ForwardBatch, mask: torch.Tensor | None) -> None:
        n = fb.num_tokens
        core = self.model.model.layers[layer].self_attn.attn
        self.attn[:n].copy_(core.attend(self.q[:n], fb, mask))

    def _execute(self, steps: list[Callable[[], None]], fb: ForwardBatch) -> torch.Tensor:
        masks = self.model.attention_masks(fb)
        for i, step in enumerate(steps):
            step()
            if i < self.num_layers:
                self._attend(i, fb, masks[i])
        return self.model.logits(self.x[:fb.num_tokens][fb.logits_indices])

    @torch.inference_mode()
    def capture(self, key: Hashable, fb: ForwardBatch) -> None:
        if not self.uses_graphs:
            self._execute(self.pieces(fb), fb)  # a warm-up forward over the static buffers
            return
        assert key not in self.graphs, key
        # NOTE: no host syncs inside a graph: the MoE takes a sync-free path (FusedExperts.choose_impl).
        fb = dataclasses.replace(fb, graph_safe=True)
        pieces = self.pieces(fb)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(self.WARMUP_RUNS):
                self._execute(pieces, fb)
        torch.cuda.current_stream().wait_stream(stream)
        graphs = []
        for piece in pieces:  # nothing runs while capturing: the attention cores are not needed
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool.handle):
                piece()
            self.pool.adopt(graph)
            graphs.append(graph)
        self.graphs[key] = graphs

    def run(self, key: Hashable, fb: ForwardBatch) -> torch.Tensor:
        """fb: the step's batch in the bucket's static input buffers -> float32 logits [B, vocab]."""
        if self.uses_graphs:
            return self._execute([graph.replay for graph in self.graphs[key]], fb)
        return self._execute(self.pieces(fb), fb)
