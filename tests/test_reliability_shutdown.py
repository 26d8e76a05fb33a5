"""rollout-serve's lifecycle: SIGTERM / SIGINT drain then abort with exact partials (streams end with an
error event and [DONE]), exit 0 / 130, nothing left in the temp directory; kill -9 of the server or of
an engine holding spilled weights leaves nothing a restart does not clean; a bad index.json keeps
the old weights serving; memory comes back after huge answers. Each server gets a private TMPDIR,
so "nothing left" is checked exactly."""
import json
import os
import signal
import socket
import threading
import time

import httpx
import psutil
import pytest

from capture.codec import decode_routed_experts
from health_prober import HealthProber
from reliability_server import PROBE_GAP_S
from oracle import hf_router_topk, same_sets
from rollout.config import DEFAULT_MODEL_PATH
from server_proc import ServerProcess, pid_alive, wait_idle

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
ADMIN = "shutdown-admin"
HEADERS = {"Authorization": f"Bearer {ADMIN}"}
PROMPT = [11, 57, 203, 9, 88]
LONG = {"temperature": 0.0, "max_new_tokens": 1900, "ignore_eos": True}


def _server(tmp, *flags):
    return ServerProcess(["--enable-return-routed-experts", "--dtype", "float32", "--max-running-requests", "8",
                          "--admin-api-key", ADMIN, *flags], env={"TMPDIR": str(tmp)})


def _left(tmp):
    return sorted(os.listdir(tmp))


def _shape(url):
    info = httpx.get(url + "/model_info", headers=HEADERS).json()
    return info["num_hidden_layers"], info["num_experts_per_tok"]


def _sse(text):
    return [line[6:] for line in text.splitlines() if line.startswith("data: ")]


@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 0), (signal.SIGINT, 130)])
def test_signal_drains_then_aborts_with_exact_partials(tmp_path, sig, code):
    srv = _server(tmp_path, "--shutdown-drain-s", "4").start()
    proc = srv._server.proc
    try:
        url = srv.url
        shape = _shape(url)
        ref = httpx.post(url + "/generate", json={"input_ids": PROMPT, "sampling_params": {**LONG, "max_new_tokens": 24}},
                         timeout=120).json()["output_ids"]
        results = {}

        def call(name, path, body, stream):
            try:
                with httpx.stream("POST", url + path, json=body, timeout=120) as r:
                    results[name] = (r.status_code, r.read().decode())
            except httpx.HTTPError as exc:
                results[name] = ("lost", repr(exc))

        gen = {"input_ids": PROMPT, "sampling_params": LONG, "return_routed_experts": True}
        jobs = [(f"gen{i}", "/generate", gen, False) for i in range(3)]
        jobs += [(f"stream{i}", "/generate", {**gen, "stream": True}, True) for i in range(2)]
        jobs += [("chat", "/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                                   "max_tokens": 1900, "stream": True, "ignore_eos": True}, True)]
        jobs += [("short", "/generate", {"input_ids": PROMPT, "sampling_params": {**LONG, "max_new_tokens": 4}}, False)]
        threads = [threading.Thread(target=call, args=j) for j in jobs]
        with HealthProber(url) as prober:         # NOTE: up to the signal (the shutdown closes its connection)
            for t in threads[:-1]:
                t.start()
            time.sleep(2.0)
            threads[-1].start()                   # arrives just before the signal: finishes in the drain
            time.sleep(0.3)
        assert not prober.failures and prober.worst_s < PROBE_GAP_S, (prober.failures[:3], prober.worst_s)
        # NOTE: SIGINT to the whole group, as a terminal's Ctrl-C: the engine must outlive it
        os.killpg(proc.pid, sig) if sig == signal.SIGINT else proc.send_signal(sig)
        port, refused = int(url.rsplit(":", 1)[1]), False
        deadline = time.monotonic() + 3.0     # NOTE: well inside the 4 s drain: the listener closes first
        while not refused and time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                time.sleep(0.05)
            except ConnectionRefusedError:
                refused = True
        assert refused and proc.poll() is None, "new connections still accepted during the drain"
        for t in threads:
            t.join(120)
        assert proc.wait(60) == code, srv.log()[-3000:]
        log = srv.log()
    finally:
        srv.stop()
    bad = {k: (v[0], v[1][-300:]) for k, v in results.items() if v[0] != 200}
    assert len(results) == len(jobs) and not bad, (bad, log[-3000:])
    short = json.loads(results["short"][1])
    assert short["meta_info"]["finish_reason"]["type"] == "length" and short["output_ids"] == ref[:4]
    for i in range(3):
        out = json.loads(results[f"gen{i}"][1])
        meta = out["meta_info"]
        assert meta["finish_reason"]["type"] == "abort" and 0 < len(out["output_ids"]) < 1900, meta["finish_reason"]
        n = min(len(ref), len(out["output_ids"]))
        assert out["output_ids"][:n] == ref[:n]
        rows = decode_routed_experts(meta["routed_experts"], "int32", num_layers=shape[0], top_k=shape[1])
        seq = PROMPT + out["output_ids"]
        assert rows.shape[0] == len(seq) - 1
        if i == 0:
            assert same_sets(rows, hf_router_topk(DEFAULT_MODEL_PATH, seq[:-1], shape[1], shape[0]))
    for name in ("stream0", "stream1", "chat"):
        events = _sse(results[name][1])
        assert events[-1] == "[DONE]", events[-3:]
        err = json.loads(events[-2])["error"]
        assert err["code"] == 503 and "shutting down" in err["message"], err
        last = json.loads(events[-3])
        reason = last["meta_info"]["finish_reason"]["type"] if name != "chat" else last["choices"][0]["finish_reason"]
        assert reason == "abort", last
    assert not [n for n in _left(tmp_path) if n.startswith("rollout-")], _left(tmp_path)


def test_kill9_leaves_nothing_a_restart_does_not_clean(tmp_path):
    # an engine OOM-killed while its weights are released: the server exits 1 and removes them
    srv = _server(tmp_path).start()
    try:
        with HealthProber(srv.url) as prober:
            r = httpx.post(srv.url + "/release_memory_occupation", json={}, headers=HEADERS, timeout=60)
            assert r.status_code == 200, r.text
            assert httpx.get(srv.url + "/health_generate", timeout=60).status_code == 503
        assert not prober.failures and prober.worst_s < PROBE_GAP_S, (prober.failures[:3], prober.worst_s)
        assert any(n.startswith("rollout-weights-") for n in _left(tmp_path)), _left(tmp_path)
        engine = psutil.Process(srv._server.proc.pid).children()[0]
        engine.kill()
        assert srv._server.proc.wait(60) == 1, srv.log()[-2000:]
    finally:
        srv.stop()
    assert not [n for n in _left(tmp_path) if n.startswith("rollout-")], _left(tmp_path)
    # kill -9 of the whole server (its engines too) while released: its directories stay ...
    srv = _server(tmp_path).start()
    try:
        assert httpx.post(srv.url + "/release_memory_occupation", json={}, headers=HEADERS,
                          timeout=60).status_code == 200
        engines = [p.pid for p in psutil.Process(srv._server.proc.pid).children(recursive=True)]
        srv._server.kill()
    finally:
        srv.stop()
    deadline = time.monotonic() + 30          # NOTE: a restart follows the crash: the engines' exit is done
    while any(pid_alive(p) for p in engines) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = [n for n in _left(tmp_path) if n.startswith("rollout-")]
    assert any(n.startswith("rollout-weights-") for n in left) and len(left) == 2, left
    # ... until the next server starts; SIGTERM then leaves nothing, also while its weights are released
    with _server(tmp_path) as srv:
        assert not set(left) & set(_left(tmp_path)), _left(tmp_path)
        assert httpx.get(srv.url + "/health_generate", timeout=60).status_code == 200
        assert httpx.post(srv.url + "/release_memory_occupation", json={}, headers=HEADERS,
                          timeout=60).status_code == 200
        assert any(n.startswith("rollout-weights-") for n in _left(tmp_path)), _left(tmp_path)
        proc = srv._server.proc
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    assert not [n for n in _left(tmp_path) if n.startswith("rollout-")], _left(tmp_path)


def test_bad_index_keeps_weights_and_memory_returns_after_huge_answers(tmp_path):
    ckpts = tmp_path / "ckpts"
    ckpts.mkdir()
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    with _server(tmp, "--allowed-weight-dirs", str(ckpts)) as srv, \
            httpx.Client(base_url=srv.url, headers=HEADERS, timeout=300) as c:
        greedy = {"input_ids": PROMPT, "sampling_params": {**LONG, "max_new_tokens": 8}}
        before = c.post("/generate", json=greedy).json()["output_ids"]
        for i, bad in enumerate([[], "model.safetensors", None]):
            d = ckpts / f"bad{i}"
            d.mkdir()
            (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": bad}))
            r = c.post("/update_weights_from_disk", json={"model_path": str(d)})
            assert r.status_code == 400 and r.json()["success"] is False, r.text
            assert "weight_map" in r.json()["message"]
            assert c.post("/generate", json=greedy).json()["output_ids"] == before
        big = {"input_ids": PROMPT, "return_logprob": True, "top_logprobs_num": 20, "return_routed_experts": True,
               "sampling_params": {"max_new_tokens": 16, "n": 128, "temperature": 1.0, "ignore_eos": True}}
        huge = "the quick brown fox " * 1_500_000          # 30 MB, under --max-request-bytes
        refused = [("/generate", {"text": huge, "sampling_params": {"max_new_tokens": 2}}, "text"),
                   ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": huge}]},
                    "messages")]
        rss = psutil.Process(srv._server.proc.pid)
        c.post("/generate", json={**big, "sampling_params": {**big["sampling_params"], "n": 2}})   # warm
        base = rss.memory_info().rss
        with HealthProber(srv.url) as prober:
            for path, body, param in refused:
                r = c.post(path, json=body)
                assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text[:300]
                assert r.json()["error"]["message"].startswith(f"{param} has {len(huge)} characters"), r.text[:300]
            after_refused = rss.memory_info().rss
            r = c.post("/generate", json=big)
            assert r.status_code == 200 and len(r.json()) == 128, r.text[:300]
            assert all(len(o["output_ids"]) == 16 and len(o["meta_info"]["output_top_logprobs"]) == 16
                       for o in r.json())
            del r
        wait_idle(c, timeout=120)
        assert c.post("/flush_cache").status_code == 200
        assert c.get("/get_load").json()[0]["num_tokens"] == 0
        time.sleep(1.0)
        for grown in (after_refused - base, rss.memory_info().rss - base):
            assert grown < 150 * 2**20, grown / 2**20
        assert not prober.failures and prober.worst_s < PROBE_GAP_S, (prober.failures[:3], prober.worst_s)


def test_engine_death_ends_openai_and_generate_streams_with_an_error_event(tmp_path):
    """The engine killed mid-stream: each /v1/chat/completions, /v1/completions and /generate stream
    ends with a 503 error event and [DONE]; /health fails and the server exits 1, its files removed."""
    srv = _server(tmp_path).start()
    proc = srv._server.proc
    streams = {"chat": ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                                 "max_tokens": 1900, "ignore_eos": True, "stream": True}),
               "completions": ("/v1/completions", {"model": "m", "prompt": "hello", "max_tokens": 1900,
                                                   "ignore_eos": True, "stream": True}),
               "generate": ("/generate", {"input_ids": PROMPT, "sampling_params": LONG, "stream": True})}
    results, started = {}, {name: threading.Event() for name in streams}

    def call(name):
        path, body = streams[name]
        lines = []
        try:
            with httpx.stream("POST", srv.url + path, json=body, timeout=120) as r:
                for line in r.iter_lines():
                    lines.append(line)
                    if len(lines) > 6:
                        started[name].set()
            results[name] = (r.status_code, lines)
        except httpx.HTTPError as exc:
            results[name] = ("lost", [repr(exc)])
        started[name].set()

    threads = [threading.Thread(target=call, args=(name,)) for name in streams]
    try:
        for t in threads:
            t.start()
        assert all(e.wait(120) for e in started.values())
        psutil.Process(proc.pid).children()[0].kill()
        for t in threads:
            t.join(60)
        try:
            assert httpx.get(srv.url + "/health", timeout=5).status_code != 200
        except httpx.HTTPError:
            pass   # already gone
        assert proc.wait(60) == 1, srv.log()[-2000:]
    finally:
        srv.stop()
    for name in streams:
        status, lines = results[name]
        assert status == 200, (name, lines[-3:])
        events = [line[6:] for line in lines if line.startswith("data: ")]
        assert events[-1] == "[DONE]", (name, events[-3:])
        err = json.loads(events[-2])["error"]
        assert err["code"] == 503 and err["type"] == "server_error", (name, err)
        assert len(events) > 3, (name, events)     # the stream had begun: partial chunks came first
    assert not [n for n in _left(tmp_path) if n.startswith("rollout-")], _left(tmp_path)
