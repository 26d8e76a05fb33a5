"""Drives an EngineCore directly (no front end process): requests in, RolloutOutputs out, through
the same RequestState the front end uses to assemble the engine's updates."""
from __future__ import annotations

from rollout.engine_core import EngineCore
from rollout.frontend.request_state import RequestState, RoutingShape
from rollout.output import RolloutOutput
from rollout.request import Req


class CoreDriver:
    def __init__(self, core: EngineCore):
        self.core = core
        info = core.info
        self.routing = RoutingShape(info.num_hidden_layers, info.top_k, info.num_experts,
                                    tuple(info.moe_layer_ids)) if core.capture_enabled else None
        self.states: dict[int, RequestState] = {}
        self.outputs: dict[str, RolloutOutput] = {}

    def add(self, req: Req) -> None:
        st = RequestState(uid=req.uid, rid=req.rid, group_rid=req.rid, prompt_ids=list(req.prompt_ids),
                          params=req.params, stream=False, stream_interval=1, return_logprob=req.return_logprob,
                          top_logprobs_num=req.top_logprobs_num, return_routed_experts=req.return_routed_experts,
                          routed_experts_start_len=req.routed_experts_start_len,
                          decode=lambda ids, skip: "", routing=self.routing)
        st.sink = lambda out: self.outputs.__setitem__(out.rid, out)
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
