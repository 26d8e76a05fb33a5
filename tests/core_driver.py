"""Drives an EngineCore directly (no front end process): requests in, RolloutOutputs out, through
the same RequestState the front end uses to assemble the engine's updates."""
from __future__ import annotations

from rollout.core.engine_core import EngineCore
from rollout.frontend.request_state import RequestState, RoutingShape
from rollout.generate_io import RolloutOutput
from rollout.core.request import Req


class CoreDriver:
    def __init__(self, core: EngineCore):
        self.core = core
        info = core.info
        self.routing = RoutingShape(info.num_hidden_layers, info.top_k, info.num_experts,
                                    tuple(info.moe_layer_ids)) if core.capturer is not None else None
        self.states: dict[int, RequestState] = {}
        self.outputs: dict[str, RolloutOutput] = {}
        self.items: list = []      # everything delivered, in order (outputs, or chunks when streamed)

    def add(self, req: Req, *, stream: bool = False) -> None:
        st = RequestState(uid=req.uid, rid=req.rid, group_rid=req.rid, prompt_ids=list(req.prompt_ids),
                          params=req.params, stream=stream, stream_interval=1, return_logprob=req.return_logprob,
                          top_logprobs_num=req.top_logprobs_num, return_routed_experts=req.return_routed_experts,
                          routed_experts_start_len=req.routed_experts_start_len,
                          decode=lambda ids, skip: "", routing=self.routing)
        req.emit_interval = st.emit_interval

        def sink(item) -> None:
            self.items.append(item)
            out = getattr(item, "output", item) if stream else item
            if out is not None:
                self.outputs[out.rid] = out
        st.sink = sink
        self.states[req.uid] = st
        self.core.add_request(req)

    def absorb(self) -> None:
        for upd in self.core.take_updates():
            st = self.states[upd.uid]
            items, _ = st.apply(upd)
            for item in items:
                st.sink(item)

    def step(self) -> None:
        self.core.step()
        self.absorb()

    def run(self) -> None:
        while self.core.has_work():
            self.step()
        self.absorb()
