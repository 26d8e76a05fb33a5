"""RequestState: the front end's side of one request (text, stop strings, what reached the caller),
and RequestTable: the requests in flight, by uid and by rid.

The engine sends ReqUpdates (raw token ids, logprobs, routing rows); this turns them into the
StreamChunks and the RolloutOutput the caller sees. Stop strings are found here: on a hit the
output is cut after the token that completed the string (its logprobs and routing rows with it)
and the caller is told to abort the request in the engine.

Each sample of a call is one RequestState with its own integer uid (the engine's key). A rid
finds every uid it names: a sample's rid (rid_k for the samples of an n > 1 request), and the
caller's rid of an n > 1 request (its group_rid), which names all of its samples. The table is
shared by the caller's threads and the engine client's receiver thread: every access holds its lock.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch

from rollout.frontend.detokenizer import IncrementalDetokenizer
from rollout.frontend.engine_client import RidInFlightError
from rollout.ipc.messages import ReqUpdate, float_list, int_list
from rollout.generate_io import FinishReason, RolloutOutput, StreamChunk
from rollout.sampling_params import SamplingParams


@dataclass(frozen=True)
class RoutingShape:
    num_layers: int
    top_k: int
    num_experts: int
    moe_layer_ids: tuple[int, ...]


class RequestState:
    def __init__(self, *, uid: int, rid: str, group_rid: str, prompt_ids: list[int], params: SamplingParams,
                 stream: bool, stream_interval: int, return_logprob: bool, top_logprobs_num: int,
                 return_routed_experts: bool, routed_experts_start_len: int,
                 decode: Callable[[list[int], bool], str], routing: Optional[RoutingShape],
                 prompt_logprob_start: int = -1, arrival: float = 0.0):
        self.uid, self.rid, self.prompt_ids, self.params = uid, rid, prompt_ids, params
        self.group_rid = group_rid           # the caller's rid (rid_k are its n > 1 samples)
        self.prompt_logprob_start = prompt_logprob_start
        self.arrival = arrival or time.time()   # time.time() of the call that made it
        self.stream, self.interval = stream, stream_interval
        self.return_logprob, self.top_logprobs_num = return_logprob, top_logprobs_num
        self.start_len = routed_experts_start_len
        self.routing = routing if return_routed_experts else None
        self.sink: Optional[Callable[[Any], None]] = None   # set when submitted
        self._decode = decode
        self.watch = bool(params.stop or params.stop_patterns)    # stop strings / patterns to find
        self.detok = IncrementalDetokenizer(lambda ids: decode(ids, params.skip_special_tokens)) \
            if stream or self.watch else None
        self._stop_window = max((len(s) for s in params.stop), default=0) + 16
        self.output_ids: list[int] = []
        self.logprobs: list[float] = []
        self.top: list[list[tuple[float, int]]] = []
        self.rows: list[np.ndarray] = []       # routing parts, [n, L, K] each
        self.num_rows = 0
        self.weight_versions: list[list] = []   # [[version, first output index], ...]
        self.routed = False    # whether the engine sent routing (not for an abort before any KV was computed)
        self.input_lp: dict[str, Any] = {}   # prompt logprobs, once the engine sent them
        self.sent_tokens = 0
        self.sent_text_len = 0
        self.sent_rows = 0
        self.done = False
        self.output: Optional[RolloutOutput] = None   # once done

    @property
    def emit_interval(self) -> int:
        """How often the engine must send deltas: every token when stop strings are watched."""
        if self.watch:
            return 1
        return self.interval if self.stream else 0

    def apply(self, upd: ReqUpdate) -> tuple[list[Any], bool]:
        """Items for the sink, and whether a stop string hit (the engine must abort the request)."""
        assert not self.done, self.rid
        new_ids = int_list(upd.output_ids)
        lps = float_list(upd.logprobs) if upd.logprobs is not None else None
        tops = None
        if upd.top_n:
            t_ids = np.frombuffer(upd.top_ids, dtype=np.int32).reshape(-1, upd.top_n).tolist()
            t_lps = np.frombuffer(upd.top_logprobs, dtype=np.float32).reshape(-1, upd.top_n)
            tops = _top_rows(t_lps, t_ids)
        if upd.routing is not None and self.routing is not None:
            self.routed = True
            r = self.routing
            part = np.frombuffer(upd.routing, dtype=np.dtype(upd.routing_dtype)).reshape(-1, r.num_layers, r.top_k)
            if part.shape[0]:
                self.rows.append(part)
                self.num_rows += part.shape[0]
        if upd.input_logprobs is not None:
            self.input_lp = self._input_logprobs(upd)
        if upd.weight_versions:
            self.weight_versions.extend(upd.weight_versions)
        hit: Optional[str] = None
        for i, tok in enumerate(new_ids):
            self.output_ids.append(tok)
            if lps is not None:
                self.logprobs.append(lps[i])
            if tops is not None:
                self.top.append(tops[i])
            if self.watch and len(self.output_ids) >= self.params.min_new_tokens:
                hit = self._stop_hit()
                if hit is not None:
                    break
        if hit is not None:
            # NOTE: rows exist for positions < prompt + len(output) - 1 (the last token never went forward)
            self._trim_rows(len(self.prompt_ids) + len(self.output_ids) - 1 - self.start_len)
            reason = FinishReason("stop", matched=hit)
            return self._finish(reason, upd), True
        if upd.finished:
            reason = FinishReason(upd.finish_type, upd.finish_matched, upd.finish_message, upd.finish_err_type,
                                  upd.finish_status_code)
            return self._finish(reason, upd), False
        if self.stream and self.detok is not None and not self.watch:
            self.detok.step(self.output_ids)
        if self.stream and len(self.output_ids) - self.sent_tokens >= self.interval:
            return [self._chunk(finished=False)], False
        return [], False

    def _stop_hit(self) -> Optional[str]:
        """The stop string (or the text a stop_regex matched) the output now contains, if any."""
        self.detok.step(self.output_ids)
        text = self.detok.text
        window = text[-self._stop_window:]
        hit = next((s for s in self.params.stop if s in window), None)
        if hit is None:
            for rx in self.params.stop_patterns:
                m = rx.search(text)
                if m is not None:
                    return m.group(0)
        return hit

    def _trim_rows(self, keep: int) -> None:
        if self.routing is None or self.num_rows <= keep:
            return
        rows = np.concatenate(self.rows)[:max(0, keep)]
        self.rows, self.num_rows = [rows], rows.shape[0]

    def _routing_tensor(self, lo: int) -> Optional[torch.Tensor]:
        if self.routing is None or not self.routed:
            return None
        r = self.routing
        # NOTE: only the parts that reach row `lo` are copied (a stream asks for its newest rows
        # every chunk; concatenating them all each time is quadratic in the output length)
        tail, end = [], self.num_rows
        for part in reversed(self.rows):
            if end <= lo:
                break
            begin = end - part.shape[0]
            tail.append(part[max(0, lo - begin):])
            end = begin
        if not tail:
            return torch.from_numpy(np.empty((0, r.num_layers, r.top_k), np.int32))
        rows = tail[0] if len(tail) == 1 else np.concatenate(tail[::-1])
        return torch.from_numpy(rows.astype(np.int32))

    def _finish(self, reason: FinishReason, upd: ReqUpdate) -> list[Any]:
        self.done = True
        text = self._decode(self.output_ids, self.params.skip_special_tokens)
        if reason.type == "stop" and isinstance(reason.matched, str) and not self.params.no_stop_trim:
            cut = text.find(reason.matched)
            if cut >= 0:
                text = text[:cut]
        output = RolloutOutput(
            rid=self.rid, prompt_ids=list(self.prompt_ids), output_ids=list(self.output_ids), text=text,
            finish_reason=reason.type, finish_info=reason.to_dict(len(self.output_ids)),
            output_logprobs=list(self.logprobs) if self.return_logprob else None,
            output_top_logprobs=list(self.top) if self.top_logprobs_num else None,
            cached_tokens=upd.cached_tokens, weight_version=upd.weight_version,
            # NOTE: a stop string may have cut tokens a later version sampled
            weight_versions=[[v, i] for v, i in self.weight_versions if i < len(self.output_ids)],
            routed_experts=self._routing_tensor(0), routed_experts_start_len=self.start_len,
            num_experts=self.routing.num_experts if self.routing else 0,
            moe_layer_ids=self.routing.moe_layer_ids if self.routing else (), num_retractions=upd.num_retractions,
            **(dict(zip(("spec_verify_ct", "spec_num_proposed_drafts", "spec_num_correct_drafts"), upd.spec))
               if upd.spec else {}),
            e2e_latency=time.time() - self.arrival, **(self.input_lp or self._input_logprobs(upd)))
        self.output = output
        if self.stream:
            return [self._chunk(finished=True, output=output)]
        return [output]

    def _input_logprobs(self, upd: ReqUpdate) -> dict[str, Any]:
        """Prompt logprobs (logprob_start_len >= 0), as the engine sends them with the final update."""
        if self.prompt_logprob_start < 0:
            return {}
        out: dict[str, Any] = {"input_logprobs": float_list(upd.input_logprobs), "input_top_logprobs": []}
        if upd.input_top_ids:
            n = self.top_logprobs_num
            ids = np.frombuffer(upd.input_top_ids, dtype=np.int32).reshape(-1, n).tolist()
            lps = np.frombuffer(upd.input_top_logprobs, dtype=np.float32).reshape(-1, n)
            out["input_top_logprobs"] = _top_rows(lps, ids)
        return out

    def _chunk(self, *, finished: bool, output: Optional[RolloutOutput] = None) -> StreamChunk:
        lo = self.sent_tokens
        if output is not None:
            # NOTE: the last chunk completes the full text (flushed bytes, stop-string trim)
            full = output.text
        else:
            full = self.detok.text if self.detok is not None else ""
        text = full[self.sent_text_len:] if len(full) >= self.sent_text_len else ""
        self.sent_text_len = len(full)
        routed = self._routing_tensor(self.sent_rows)
        chunk = StreamChunk(
            rid=self.rid, output_ids=self.output_ids[lo:], text=text,
            output_logprobs=self.logprobs[lo:] if self.return_logprob else None,
            output_top_logprobs=self.top[lo:] if self.top_logprobs_num else None,
            routed_experts=routed, routed_experts_start=self.start_len + self.sent_rows,
            finished=finished, output=output)
        self.sent_tokens = len(self.output_ids)
        self.sent_rows = self.num_rows
        return chunk


def _top_rows(lps: np.ndarray, ids: list[list[int]]) -> list[list[tuple[float, int]]]:
    """[(logprob, id), ...] per position. NOTE: with logprob_mode "processed" a truncating top_k / top_p /
    min_p leaves alternatives at -inf (probability 0, never sampled): they are left out, so a row may
    hold fewer than top_logprobs_num entries, and no list carries a null."""
    if np.isneginf(lps).any():
        return [[(lp, t) for lp, t in zip(a, b) if lp != float("-inf")] for a, b in zip(lps.tolist(), ids)]
    return [list(zip(a, b)) for a, b in zip(lps.tolist(), ids)]


Deliveries = list[tuple[Callable[[Any], None], list[Any]]]


class RequestTable:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._states: dict[int, RequestState] = {}
        self._rids: dict[str, list[int]] = {}

    def __len__(self) -> int:
        return len(self._states)

    def add(self, states: Sequence[RequestState], sink: Callable[[Any], None]) -> None:
        """Registers one call's requests, all answering to sink; none if any rid is in flight."""
        with self._lock:
            clash = [st.rid for st in states if st.rid in self._rids or st.group_rid in self._rids]
            if clash:
                raise RidInFlightError(f"rid {clash[0]!r} is already in flight; rids must be unique")
            for st in states:
                st.sink = sink
                self._states[st.uid] = st
                for key in {st.rid, st.group_rid}:
                    self._rids.setdefault(key, []).append(st.uid)

    def discard(self, states: Sequence[RequestState]) -> None:
        """Forgets requests the engine never received."""
        with self._lock:
            for st in states:
                if st.uid in self._states:
                    self._forget(st)

    def apply(self, updates: list[ReqUpdate]) -> tuple[Deliveries, list[int], list[RolloutOutput]]:
        """Applies the engine's updates: (sink, items) to deliver, the uids that hit a stop string
        (the engine must abort them) and the outputs of the requests that finished. Finished requests
        leave the table."""
        deliveries: Deliveries = []
        stopped: list[int] = []
        finished: list[RolloutOutput] = []
        with self._lock:
            for upd in updates:
                st = self._states.get(upd.uid)
                if st is None:
                    continue  # NOTE: finished here already (a stop string hit); the engine's abort follows
                items, stop_hit = st.apply(upd)
                if stop_hit:
                    stopped.append(upd.uid)
                if st.done:
                    self._forget(st)
                    finished.append(st.output)
                if items:
                    deliveries.append((st.sink, items))
        return deliveries, stopped, finished

    def uids(self) -> list[int]:
        with self._lock:
            return list(self._states)

    def uids_of(self, rids: Sequence[str]) -> list[int]:
        with self._lock:
            return [uid for r in rids for uid in self._rids.get(r, ())]

    def clear(self) -> list[RequestState]:
        """Empties the table (the engine died); the requests that were in it."""
        with self._lock:
            states = list(self._states.values())
            self._states.clear()
            self._rids.clear()
        return states

    def _forget(self, st: RequestState) -> None:
        del self._states[st.uid]
        for key in {st.rid, st.group_rid}:
            uids = self._rids.get(key)
            if uids is not None:
                uids.remove(st.uid)
                if not uids:
                    del self._rids[key]
