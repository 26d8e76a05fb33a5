"""The engine in its own process: typed messages, death of the engine process, clean shutdown."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from oracle import hf_router_topk, same_sets
from rollout import EngineDeadError, Rollout
from rollout.ipc.messages import AbortReqs, AddReqs, Call, Codec, ReqSpec, ReqUpdate, StepOut, ints
from server_proc import pid_alive
from tiny_models import make_engine, random_prompts as prompts

ROOT = Path(__file__).resolve().parent.parent
GREEDY = {"temperature": 0.0, "ignore_eos": True}


def test_messages_round_trip_as_msgpack_with_raw_arrays():
    codec = Codec()
    spec = ReqSpec(uid=7, rid="a", prompt_ids=ints([1, 2, 3]), params={"temperature": 0.5, "stop": []}, seed=3,
                   return_logprob=True, top_logprobs_num=2, return_routed_experts=True, routed_experts_start_len=1,
                   emit_interval=0, max_total_len=64)
    for msg in (AddReqs([spec]), AbortReqs([7, 8], "why"), Call(3, "pause", ["retract"])):
        assert codec.to_engine.decode(codec.encoder.encode(msg)) == msg
    rows = np.arange(24, dtype=np.int16).reshape(2, 3, 4)
    out = StepOut(updates=[ReqUpdate(uid=7, output_ids=ints([5, 6]), routing=rows.tobytes(), finished=True,
                                     finish_type="stop", finish_matched=6)], steps=4)
    back = codec.from_engine.decode(codec.encoder.encode(out))
    assert back == out and np.array_equal(np.frombuffer(back.updates[0].routing, np.int16).reshape(2, 3, 4), rows)


def test_engine_builds_the_front_ends_sampling_params_without_checking_them_again():
    """req_from_spec trusts a decoded ReqSpec: SamplingParams.trusted gives SamplingParams(**fields)
    (the same value, sequences as tuples, the sampler's key), and no check runs on it."""
    import dataclasses

    from rollout.core.engine_proc import req_from_spec
    from rollout.sampling_params import SamplingParams

    codec = Codec()
    cases = [SamplingParams(), SamplingParams(temperature=0.0, max_new_tokens=3, stop_token_ids=[5, 9]),
             SamplingParams(temperature=0.7, top_p=0.9, top_k=20, min_p=0.05, min_new_tokens=2, sampling_seed=11,
                            repetition_penalty=1.1, logprob_mode="processed", ignore_eos=True),
             SamplingParams(stop_regex=[r"\d+"], stream_interval=4, presence_penalty=0.5)]
    for ref in cases:
        fields = {f.name: getattr(ref, f.name) for f in dataclasses.fields(ref)}
        spec = ReqSpec(uid=1, rid="a", prompt_ids=ints([1, 2]), params=fields, seed=0, return_logprob=False,
                       top_logprobs_num=0, return_routed_experts=False, routed_experts_start_len=0,
                       emit_interval=0, max_total_len=64)
        got = req_from_spec(codec.to_engine.decode(codec.encoder.encode(AddReqs([spec]))).reqs[0]).params
        assert got == ref and got.sampler_key == ref.sampler_key and got.stop_patterns == ref.stop_patterns
        assert all(type(getattr(got, n)) is tuple for n in ("stop", "stop_token_ids", "stop_regex"))
    # NOTE: no validation: an out-of-range value the front end would have refused passes through
    assert SamplingParams.trusted({"temperature": 500.0}).temperature == 500.0
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=500.0)


def test_every_control_call_names_an_engine_core_method():
    """The one allow-list: each name in CALLS is an EngineCore method, and every call the front end
    sends is in it."""
    import re

    from rollout.core.engine_core import EngineCore
    from rollout.core.engine_proc import CALLS, COLLECTIVE

    assert COLLECTIVE <= CALLS
    for name in CALLS:
        assert callable(getattr(EngineCore, name, None)) and not isinstance(
            getattr(EngineCore, name), property), name
    sent = {m for f in (ROOT / "rollout" / "frontend").glob("*.py")
            for m in re.findall(r'_call\("([a-z_]+)"', f.read_text())}
    assert sent and sent <= CALLS, sorted(sent - CALLS)


def test_engine_killed_mid_load_fails_every_waiter_within_5s(tiny_checkpoint):
    engine = make_engine(tiny_checkpoint("qwen3_moe"))
    (pid,) = engine.engine_pids()
    got: list = []
    done = threading.Event()

    def sink(item):
        got.append(item)
        if len(got) == 8:
            done.set()
    engine.submit(sink, input_ids=prompts(1, [5] * 8), sampling_params={**GREEDY, "max_new_tokens": 500})
    while engine.stats()["generated_tokens"] < 16:
        time.sleep(0.01)
    os.kill(pid, signal.SIGKILL)
    t0 = time.monotonic()
    assert done.wait(5.0)
    assert time.monotonic() - t0 < 5.0 and all(isinstance(x, EngineDeadError) for x in got)
    assert not engine.is_alive
    with pytest.raises(EngineDeadError, match="exited with code -9"):
        engine.generate(input_ids=[[5, 6]])
    engine.shutdown()


def test_shutdown_leaves_no_process_and_concurrent_callers_match_the_oracle(tiny_checkpoint):
    """8 threads of callers at once, each request's routing row by row the router's (transformers)."""
    path = tiny_checkpoint("qwen3_moe")
    engine = make_engine(path)
    (pid,) = engine.engine_pids()
    batches = [prompts(10 + i, [4 + i, 9]) for i in range(8)]
    results: dict = {}

    def caller(i):
        results[i] = engine.generate(input_ids=batches[i], sampling_params={**GREEDY, "max_new_tokens": 6},
                                     return_routed_experts=True, stream=bool(i % 2))
        results[i] = [c.output for c in results[i] if c.finished] if i % 2 else results[i]
    threads = [threading.Thread(target=caller, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    engine.check_integrity()
    engine.shutdown()
    assert not pid_alive(pid)
    for i, outs in results.items():
        for out in outs:
            seq = out.prompt_ids + out.output_ids
            assert out.routed_experts.shape[0] == len(seq) - 1
            assert same_sets(out.routed_experts, hf_router_topk(path, seq[:-1], out.routed_experts.shape[2],
                                                                out.routed_experts.shape[1]))


def test_script_without_main_guard_runs(tmp_path):
    """The engine process is not started by multiprocessing: a caller's script needs no __main__ guard."""
    script = tmp_path / "job.py"
    script.write_text("from rollout import Rollout\n"
                      "with Rollout() as e:\n"
                      "    print('ok', len(e.generate(['hi'], {'max_new_tokens': 2})[0].output_ids))\n")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=180, env=env)
    assert r.returncode == 0 and "ok 2" in r.stdout, r.stderr[-2000:]


def test_stop_string_cuts_tokens_logprobs_and_routing_together(tiny_checkpoint):
    """The front end finds stop strings: the output ends at the token that completed the string, with
    that many logprobs and prompt + output - 1 routing rows, and the engine frees the request."""
    with Rollout(enable_return_routed_experts=True) as engine:
        free = engine.generate(["Q: 12+7= A:"], {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True},
                               return_logprob=True, return_routed_experts=True)[0]
        text = free.text
        assert len(text) > 3
        stop = text[2:4]
        out = engine.generate(["Q: 12+7= A:"], {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True,
                                                "stop": [stop]}, return_logprob=True, return_routed_experts=True)[0]
        engine.check_integrity()
        n = len(out.output_ids)
        assert out.finish_info == {"type": "stop", "matched": stop} and stop not in out.text
        assert out.output_ids == free.output_ids[:n] and n < len(free.output_ids)
        assert out.output_logprobs == free.output_logprobs[:n]
        assert torch.equal(out.routed_experts, free.routed_experts[:len(out.prompt_ids) + n - 1])
        assert engine.stats()["running"] == 0


def test_inproc_client_matches_process_client(tiny_checkpoint):
    path = tiny_checkpoint("olmoe")
    batch = prompts(3, [7, 19])
    params = {"temperature": 1.0, "max_new_tokens": 8, "n": 2, "sampling_seed": 5}
    outs = {}
    for client in ("process", "inproc"):
        with make_engine(path, client=client) as engine:
            outs[client] = engine.generate(input_ids=batch, sampling_params=params, return_logprob=True,
                                           return_routed_experts=True)
    for a, b in zip(outs["process"], outs["inproc"], strict=True):
        assert a.output_ids == b.output_ids and a.output_logprobs == b.output_logprobs
        assert torch.equal(a.routed_experts, b.routed_experts)


def test_cpu_threads_sets_the_engine_process_threads_only(tiny_checkpoint):
    from rollout.config import DEFAULT_MODEL_PATH, EngineConfig

    path = tiny_checkpoint("qwen3_moe")
    with pytest.raises(ValueError, match="cpu_threads"):
        EngineConfig(model_path=DEFAULT_MODEL_PATH, cpu_threads=0)
    usable = len(os.sched_getaffinity(0))
    assert EngineConfig(model_path=DEFAULT_MODEL_PATH).resolved_cpu_threads == usable
    assert EngineConfig(model_path=DEFAULT_MODEL_PATH, dp_size=2).resolved_cpu_threads == max(1, usable // 2)
    mine = torch.get_num_threads()
    with make_engine(path, cpu_threads=1) as engine:
        assert engine.stats()["cpu_threads"] == 1
        out = engine.generate(input_ids=prompts(4, [9]), sampling_params={**GREEDY, "max_new_tokens": 4})
        assert len(out[0].output_ids) == 4
    assert torch.get_num_threads() == mine   # the caller's pool is left alone


def thread_cpus(pid: int) -> list[set[int]]:
    """The CPUs each thread of process `pid` may run on (Cpus_allowed_list, e.g. "0-2,5")."""
    out = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/status") as f:
            text = next(line.split()[1] for line in f if line.startswith("Cpus_allowed_list:"))
        cpus: set[int] = set()
        for part in text.split(","):
            lo, _, hi = part.partition("-")
            cpus.update(range(int(lo), int(hi or lo) + 1))
        out.append(cpus)
    return out


def test_cpu_affinity_pins_every_thread_of_the_engine_process(tiny_checkpoint):
    """cpu_affinity: the engine process and all its threads run on the CPUs given (its torch
    threads default to their number); the caller's own mask and the results are unchanged."""
    from rollout.config import DEFAULT_MODEL_PATH, EngineConfig

    mine = sorted(os.sched_getaffinity(0))
    for bad, says in (((-1,), "cpu_affinity must be an integer >= 0"), ((0, 0), "cpu_affinity must not repeat"),
                      ("0", "cpu_affinity must be a list")):
        with pytest.raises(ValueError, match=says):
            EngineConfig(model_path=DEFAULT_MODEL_PATH, cpu_affinity=bad)
    with pytest.raises(ValueError, match=r"multiple of dp_size=2 CPUs .* got 3"):
        EngineConfig(model_path=DEFAULT_MODEL_PATH, cpu_affinity=(0, 1, 2), dp_size=2)
    cfg = EngineConfig(model_path=DEFAULT_MODEL_PATH, cpu_affinity=(5, 1, 4, 0), dp_size=2)
    assert (cfg.cpu_affinity_of(0), cfg.cpu_affinity_of(1), cfg.resolved_cpu_threads) == ((0, 1), (4, 5), 2)
    path = tiny_checkpoint("qwen3_moe")
    with pytest.raises(ValueError, match=r"cpu_affinity: CPU\(s\) \[4096\] are offline or outside this "
                                         r"process's cpuset, allowed: \[\d"):
        make_engine(path, cpu_affinity=(4096,))
    with pytest.raises(ValueError, match="in-process client has none"):
        make_engine(path, cpu_affinity=(mine[-1],), client="inproc")
    params = {**GREEDY, "max_new_tokens": 6}
    with make_engine(path, cpu_threads=1) as engine:
        want = engine.generate(input_ids=prompts(3, [9, 17]), sampling_params=params, return_logprob=True,
                               return_routed_experts=True)
        assert engine.stats()["cpu_affinity"] == mine
    # as under `taskset -c <first>`: the caller's own mask leaves the engine's CPU out
    os.sched_setaffinity(0, mine[:1])
    try:
        engine = make_engine(path, cpu_affinity=(mine[-1],))
    finally:
        os.sched_setaffinity(0, mine)
    with engine:
        (pid,) = engine.engine_pids()
        assert thread_cpus(pid) == [{mine[-1]}] * len(os.listdir(f"/proc/{pid}/task"))
        assert len(os.listdir(f"/proc/{pid}/task")) > 1   # the main thread and at least ZMQ's I/O thread
        st = engine.stats()
        assert (st["cpu_affinity"], st["cpu_threads"]) == ([mine[-1]], 1)
        got = engine.generate(input_ids=prompts(3, [9, 17]), sampling_params=params, return_logprob=True,
                              return_routed_experts=True)
        assert [(o.output_ids, o.output_logprobs) for o in got] == [(o.output_ids, o.output_logprobs) for o in want]
        assert torch.equal(got[1].routed_experts, want[1].routed_experts)
    assert sorted(os.sched_getaffinity(0)) == mine   # the caller is left where it was


def test_rollout_serve_cpu_affinity_keeps_its_front_end_off_the_engine_cpus():
    """rollout-serve --cpu-affinity: the engine process on the CPUs listed, the server's own
    threads (HTTP, detokenization, ZMQ) on the usable CPUs left; /server_info lists the setting."""
    import httpx

    from server_proc import ServerProcess

    mine = sorted(os.sched_getaffinity(0))
    if len(mine) < 2:
        pytest.skip("needs two usable CPUs")
    with ServerProcess(["--cpu-affinity", str(mine[-1])]) as srv:
        info = httpx.get(srv.url + "/server_info", timeout=30).json()
        r = httpx.post(srv.url + "/generate", json={"text": "hello", "sampling_params": {"max_new_tokens": 4}},
                       timeout=60)
        server = srv._server.proc.pid
        with open(f"/proc/{server}/task/{server}/children") as f:
            (engine,) = [int(p) for p in f.read().split()]
        engine_threads, server_threads = thread_cpus(engine), thread_cpus(server)
    assert info["cpu_affinity"] == [mine[-1]] and r.status_code == 200
    assert engine_threads == [{mine[-1]}] * len(engine_threads)
    assert server_threads == [set(mine[:-1])] * len(server_threads)


def test_a_streaming_step_leaves_the_front_end_a_thread(tiny_checkpoint):
    """cpu_reserve: the forwards that follow a step which sent stream deltas run with fewer threads;
    a non-streaming batch never does (rollout/core/cpu_threads.py)."""
    from rollout.config import DEFAULT_MODEL_PATH, EngineConfig

    with pytest.raises(ValueError, match="cpu_reserve"):
        EngineConfig(model_path=DEFAULT_MODEL_PATH, cpu_reserve=-1)
    path = tiny_checkpoint("qwen3_moe")
    params = {**GREEDY, "max_new_tokens": 6}
    with make_engine(path, cpu_threads=2, cpu_reserve=1) as engine:
        st = engine.stats()
        assert (st["cpu_threads"], st["cpu_threads_front_end_busy"], st["steps_front_end_busy"]) == (2, 1, 0)
        plain = engine.generate(input_ids=prompts(3, [9]), sampling_params=params)
        assert engine.stats()["steps_front_end_busy"] == 0
        chunks = list(engine.generate(input_ids=prompts(3, [9])[:1], sampling_params=params, stream=True))
        # a delta after each of the first 5 tokens, each followed by a forward (the 6th finishes)
        assert engine.stats()["steps_front_end_busy"] == 5
        assert [t for c in chunks for t in c.output_ids] == plain[0].output_ids
    with make_engine(path, cpu_threads=2, cpu_reserve=0) as engine:
        assert engine.stats()["cpu_threads_front_end_busy"] == 2
