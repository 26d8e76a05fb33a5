"""Control operations under a large queue: aborting 32k queued requests (by id, abort_all) and
pause(abort), with a small request sent meanwhile.

Each scenario starts a fresh engine (embedded tiny MoE model unless --model-path), queues
`--queued` requests (8-token prompts, 64 new tokens, `--max-running` at a time), lets it step,
then issues the control operation. Reported per scenario:
  control_ms    the control call, as its caller sees it (by id: `abort_nowait` sends one message
                with every request; abort_all / pause wait for the engine's reply, which comes
                after the step that runs when it is sent)
  answered_ms   until every queued request has its (abort) answer
  max_gap_ms    the longest time between two finished engine steps from the control call until
                every answer is out (the step loop's worst freeze), next to the median gap of
                the steps before the call (`base_gap_ms`)
  small_ms      a 2-token request sent right after the control call: its latency

  python scripts/bench_abort.py                        # 32768 queued, all three scenarios
  python scripts/bench_abort.py --queued 8192 --json out.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rollout import Rollout  # noqa: E402
from rollout.config import DEFAULT_MODEL_PATH  # noqa: E402

SCENARIOS = ("abort_by_id", "abort_all", "pause_abort")


class StepWatch:
    """Samples Rollout.steps_done from a thread; gaps between finished steps."""

    def __init__(self, engine: Rollout):
        self.engine = engine
        self.stamps: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        last = self.engine.steps_done
        while not self._stop.is_set():
            now = self.engine.steps_done
            if now != last:
                self.stamps.append(time.perf_counter())
                last = now
            time.sleep(0.0002)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def gaps(self, lo: float, hi: float) -> list[float]:
        inside = [t for t in self.stamps if lo <= t <= hi]
        return [b - a for a, b in zip(inside, inside[1:])]


def run(scenario: str, model_path: str, queued: int, max_running: int) -> dict:
    engine = Rollout(model_path, max_running_requests=max_running, chunked_prefill_size=512)
    try:
        answered = [0]
        all_done = threading.Event()
        lock = threading.Lock()

        def sink(item) -> None:
            with lock:
                answered[0] += 1
                if answered[0] == queued:
                    all_done.set()

        prompts = [[3 + (i * 7 + j) % 500 for j in range(8)] for i in range(queued)]
        rids = engine.submit(sink, input_ids=prompts, sampling_params={"max_new_tokens": 64, "ignore_eos": True}).rids
        while engine.steps_done < 20:
            time.sleep(0.001)
        watch = StepWatch(engine)
        time.sleep(0.5)
        t_call = time.perf_counter()
        # NOTE: the engine runs each operation between two steps; the step gaps below show how
        # long it froze the loop
        if scenario == "abort_by_id":
            engine.abort_nowait(rids)
        elif scenario == "abort_all":
            engine.abort_all()
        else:
            engine.pause_generation("abort")
        control = time.perf_counter() - t_call
        t_small = time.perf_counter()
        if scenario == "pause_abort":
            result: dict = {}  # NOTE: sent while paused: it waits in the queue until continue
            small = threading.Thread(target=lambda: result.setdefault("out", engine.generate(
                input_ids=[[5, 6, 7]], sampling_params={"max_new_tokens": 2, "ignore_eos": True})))
            small.start()
            engine.continue_generation()
            small.join()
        else:
            engine.generate(input_ids=[[5, 6, 7]], sampling_params={"max_new_tokens": 2, "ignore_eos": True})
        small_s = time.perf_counter() - t_small
        assert all_done.wait(600), f"{answered[0]} of {queued} answered"
        t_done = time.perf_counter()
        watch.stop()
        base = watch.gaps(t_call - 0.5, t_call)
        during = watch.gaps(t_call, t_done)
        # the step that ran when the call came, and the call's own work, count as one gap
        during.append(min((t for t in watch.stamps if t >= t_call), default=t_done) - t_call)
        engine.check_integrity()
        return {"scenario": scenario, "queued": queued, "max_running": max_running,
                "control_ms": 1e3 * control, "answered_ms": 1e3 * (t_done - t_call),
                "max_gap_ms": 1e3 * max(during), "base_gap_ms": 1e3 * statistics.median(base) if base else None,
                "small_ms": 1e3 * small_s, "aborted": engine.stats()["aborted_requests"]}
    finally:
        engine.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-path", default=DEFAULT_MODEL_PATH)
    ap.add_argument("--queued", type=int, default=32768)
    ap.add_argument("--max-running", type=int, default=128)
    ap.add_argument("--scenarios", nargs="*", default=list(SCENARIOS), choices=SCENARIOS)
    ap.add_argument("--json", default=None, help="write the rows to this file")
    args = ap.parse_args()
    rows = [run(s, args.model_path, args.queued, args.max_running) for s in args.scenarios]
    cols = ("scenario", "queued", "control_ms", "answered_ms", "max_gap_ms", "base_gap_ms", "small_ms", "aborted")
    print(" | ".join(f"{c:>12}" for c in cols))
    for row in rows:
        print(" | ".join(f"{row[c]:>12.1f}" if isinstance(row[c], float) else f"{str(row[c]):>12}" for c in cols))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
