"""Hostile input to rollout-serve's front end: nothing a client sends runs unbounded on the event loop
(a /health prober alongside each case), refusals are JSON 4xx naming the field, a handler's bug is a
JSON 500 that keeps the connection, and the pieces behind them (RE2 stop patterns, the rid scheme,
processed top-logprob rows, read deadlines, stale temp dirs) on their own."""
import asyncio
import json
import os
import socket
import subprocess
import sys
import threading
import time

import httpx
import psutil
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.responses import JSONResponse
from starlette.routing import Route

from health_prober import HealthProber
from reliability_server import (ADMIN_KEY, PROBE_GAP_S, admin, assert_idle_and_clean, health_probe,  # noqa: F401
                                server, weight_dir)
from rollout.ipc.temp_dirs import remove_stale_dirs
from rollout.models.loader import _checkpoint_files
from rollout.sampling_params import SamplingParams
from rollout.server.args import ServerArgs
from rollout.server.guard import Guard, timed_protocol
from rollout.server.metrics import Metrics

pytestmark = pytest.mark.timeout(600)
CATASTROPHIC = "([\\s\\S]+)+\u0000"
STALL_BOUND_S = PROBE_GAP_S   # each case's own prober; health_probe (autouse) runs through every test too


# ---- pieces -------------------------------------------------------------------------------------
@pytest.mark.parametrize("pattern", ["(a)\\1", "(?=a)b", "(?<=a)b", "a\\Z", "a++", "(?P=x)"])
def test_stop_regex_re2_cannot_take_is_refused_by_name(pattern):
    with pytest.raises(ValueError, match=r"^stop_regex .* is not supported"):
        SamplingParams(stop_regex=pattern)


def test_catastrophic_stop_regex_matches_in_linear_time():
    rx = SamplingParams(stop_regex=CATASTROPHIC).stop_patterns[0]
    # NOTE: Python's re backtracks exponentially here (hours at this length); RE2 scans once
    assert rx.search("ab" * 200_000) is None
    assert rx.search("xy\u0000").group(0) == "xy\u0000"


def test_weight_map_that_is_not_an_object_is_a_value_error(tmp_path):
    for bad in ([], "model.safetensors", None, {}, {"w": 3}):
        (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": bad}))
        with pytest.raises(ValueError, match="weight_map must be a non-empty object"):
            _checkpoint_files(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="weight_map"):
        _checkpoint_files(tmp_path)


def test_stale_temp_dirs_of_exited_processes_are_removed(tmp_path):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    stale = [tmp_path / f"rollout-{gone.pid}-abc_123", tmp_path / f"rollout-weights-{gone.pid}-x9"]
    live = [tmp_path / f"rollout-{os.getpid()}-keep1", tmp_path / f"rollout-weights-{os.getppid()}-keep2"]
    other = [tmp_path / "rollout-serve-x.log", tmp_path / f"rollout-{gone.pid}"]
    for d in stale + live:
        d.mkdir()
        (d / "weights.safetensors").write_bytes(b"x")
    other[0].write_text("log")
    other[1].mkdir()
    assert remove_stale_dirs(str(tmp_path)) == 2
    assert not any(d.exists() for d in stale) and all(d.exists() for d in live + other)
    # an exited process nobody has reaped yet (a zombie: an orphan under an init that does not reap)
    zombie = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        deadline = time.monotonic() + 30
        while _state(zombie.pid) != "Z" and time.monotonic() < deadline:
            time.sleep(0.01)
        assert _state(zombie.pid) == "Z"
        (tmp_path / f"rollout-weights-{zombie.pid}-z1").mkdir()
        assert remove_stale_dirs(str(tmp_path)) == 1 and all(d.exists() for d in live + other)
    finally:
        zombie.wait()


def _state(pid):
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def test_server_flags_are_checked():
    for kw in ({"timeout_read": 0}, {"timeout_read": 1.5}, {"shutdown_drain_s": -1},
               {"shutdown_drain_s": float("nan")}, {"shutdown_drain_s": True}):
        with pytest.raises(ValueError, match=next(iter(kw))):
            ServerArgs(**kw)
    args = ServerArgs.from_cli(["--timeout-read", "5", "--shutdown-drain-s", "2.5"])
    assert args.timeout_read == 5 and args.shutdown_drain_s == 2.5


# ---- a real uvicorn on loopback, with a tiny app ------------------------------------------------
class _Loopback:
    """A uvicorn server in a thread on a free loopback port (Guard in front, read deadlines)."""

    def __init__(self, app, timeout_read=60):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, log_level="critical", http=timed_protocol(timeout_read), lifespan="off")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self):
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(10)


def _tiny_app():
    async def boom(request):
        raise RuntimeError("a bug")

    async def ok(request):
        return JSONResponse({"ok": True, "body": len(await request.body())})

    # NOTE: as in create_app: Guard inside Starlette's ServerErrorMiddleware (which re-raises after its 500)
    return Starlette(routes=[Route("/boom", boom), Route("/ok", ok, methods=["GET", "POST"])],
                     middleware=[Middleware(Guard, args=ServerArgs(), metrics=Metrics(set(), None))])


def test_handler_bug_is_a_json_500_and_the_connection_serves_on():
    with _Loopback(_tiny_app()) as srv, httpx.Client(base_url=srv.url) as c:
        for _ in range(3):
            r = c.get("/boom")
            assert r.status_code == 500 and r.headers["content-type"] == "application/json"
            assert r.json()["error"] == {"message": "internal error: RuntimeError", "type": "server_error",
                                         "param": None, "code": 500}
            assert c.get("/ok").json()["ok"]          # the same kept-alive connection
        assert c.get("/ok").json()["ok"]


def _closed_within(sock, seconds):
    sock.settimeout(seconds)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True
    except socket.timeout:
        return False


def test_slow_and_silent_connections_are_closed_after_the_read_deadline():
    with _Loopback(_tiny_app(), timeout_read=1) as srv:
        silent = socket.create_connection(("127.0.0.1", srv.port))
        header = socket.create_connection(("127.0.0.1", srv.port))
        header.sendall(b"GET /ok HTTP/1.1\r\nHost: x\r\n")
        body = socket.create_connection(("127.0.0.1", srv.port))
        body.sendall(b"POST /ok HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n0123")
        idle_then_partial = socket.create_connection(("127.0.0.1", srv.port))
        idle_then_partial.sendall(b"GET /ok HTTP/1.1\r\nHost: x\r\n\r\n")
        time.sleep(0.2)
        assert b'"ok":true' in idle_then_partial.recv(4096)
        idle_then_partial.sendall(b"GET /ok HTTP/1.1\r\n")
        for s in (silent, header, body, idle_then_partial):
            assert _closed_within(s, 15), "connection still open well past --timeout-read"
            s.close()
        with httpx.Client(base_url=srv.url) as c:      # serving on; a prompt client is unaffected
            assert c.post("/ok", content=b"x" * 1000).json()["body"] == 1000


# ---- the real server --------------------------------------------------------------------------
def _rss(server):
    return psutil.Process(server._server.proc.pid).memory_info().rss


def test_catastrophic_stop_regex_does_not_stall_the_server(server, admin):
    body = {"text": "hello there", "sampling_params": {"max_new_tokens": 48, "temperature": 0,
                                                       "ignore_eos": True, "stop_regex": CATASTROPHIC}}
    with HealthProber(server.url) as prober:
        answers = [admin.post("/generate", json=body) for _ in range(3)]
    assert all(r.status_code == 200 for r in answers), answers[0].text
    assert answers[0].json()["meta_info"]["finish_reason"]["type"] == "length"
    assert prober.probes > 0 and not prober.failures and prober.worst_s < STALL_BOUND_S, prober.worst_s
    bad = admin.post("/generate", json={"text": "hi", "sampling_params": {"stop_regex": "(a)\\1"}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "stop_regex", bad.text
    assert_idle_and_clean(admin)


def test_huge_texts_are_refused_by_field_before_tokenizing(server, admin):
    huge = "the quick brown fox " * 400_000          # 8 MB, under --max-request-bytes
    cases = [("/generate", {"text": huge, "sampling_params": {"max_new_tokens": 2}}, "text", "text has "),
             ("/generate", {"text": ["hi", huge]}, "text", "text[1] has "),
             ("/v1/completions", {"model": "m", "prompt": huge, "max_tokens": 2}, "prompt", "prompt has "),
             ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": huge}]},
              "messages", "messages has ")]
    before = _rss(server)
    with HealthProber(server.url) as prober:
        for path, body, param, start in cases:
            r = admin.post(path, json=body)
            assert r.status_code == 400, (path, r.text[:300])
            err = r.json()["error"]
            assert err["param"] == param and err["message"].startswith(start), (path, err)
        # under the cheap bound but over the context: tokenized off the loop, refused naming `text`
        words = " ".join(f"w{i % 997}x{i % 13}" for i in range(3000))[:26000]
        r = admin.post("/generate", json={"text": words, "sampling_params": {"max_new_tokens": 2}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "text", r.text[:300]
        assert r.json()["error"]["message"].startswith("text has "), r.text[:300]
        r = admin.post("/generate", json={"text": ["hi", words], "sampling_params": {"max_new_tokens": 2}})
        assert r.status_code == 400 and r.json()["error"]["message"].startswith("text[1] has "), r.text[:300]
    assert not prober.failures and prober.worst_s < STALL_BOUND_S, prober.worst_s
    assert _rss(server) - before < 400 * 2**20, (before, _rss(server))
    assert_idle_and_clean(admin)


def test_health_generate_while_memory_is_released_is_503_json(server, admin):
    assert admin.post("/release_memory_occupation", json={}).status_code == 200
    try:
        r = admin.get("/health_generate")
        assert r.status_code == 503 and r.json()["error"]["type"] == "server_error", r.text
        assert "released" in r.json()["error"]["message"]
        assert admin.get("/health").status_code == 200
    finally:
        assert admin.post("/resume_memory_occupation", json={}).status_code == 200
    assert admin.get("/health_generate").status_code == 200


def test_rid_that_names_a_sample_of_another_prompt_is_refused(server, admin):
    body = {"input_ids": [[5, 6, 7], [8, 9, 10]], "rid": ["q", "q_1"],
            "sampling_params": {"max_new_tokens": 2, "n": 2}}
    r = admin.post("/generate", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "rid", r.text
    assert "'q_1' names two requests" in r.json()["error"]["message"]
    ok = admin.post("/generate", json={**body, "rid": ["q", "r"]})
    assert ok.status_code == 200 and [o["meta_info"]["id"] for o in ok.json()] == ["q_0", "q_1", "r_0", "r_1"]
    assert_idle_and_clean(admin)


@pytest.mark.parametrize("truncation", [{"top_k": 2}, {"top_p": 0.3}, {"min_p": 0.5}])
def test_processed_logprobs_with_truncation_carry_no_null(server, admin, truncation):
    body = {"input_ids": [5, 6, 7, 8], "return_logprob": True, "top_logprobs_num": 5, "logprob_start_len": 0,
            "sampling_params": {"max_new_tokens": 6, "temperature": 1.0, "sampling_seed": 3, **truncation,
                                "logprob_mode": "processed", "ignore_eos": True}}
    meta = admin.post("/generate", json=body).json()["meta_info"]
    rows = meta["output_top_logprobs"]
    assert len(rows) == 6 and all(1 <= len(row) <= 5 for row in rows), rows
    if "top_k" in truncation:
        assert all(len(row) == 2 for row in rows), rows
    assert all(isinstance(e[0], float) for row in rows for e in row)
    assert all(isinstance(e[0], float) for e in meta["output_token_logprobs"])


def test_large_answer_is_built_off_the_loop(server, admin):
    body = {"input_ids": [5, 6, 7], "return_logprob": True, "top_logprobs_num": 20, "return_routed_experts": True,
            "sampling_params": {"max_new_tokens": 32, "n": 16, "temperature": 1.0, "ignore_eos": True}}

    async def run():
        async with httpx.AsyncClient(base_url=server.url, timeout=300,
                                     headers={"Authorization": f"Bearer {ADMIN_KEY}"}) as c:
            return await asyncio.gather(*(c.post("/generate", json=body) for _ in range(2)))

    with HealthProber(server.url) as prober:
        answers = asyncio.run(run())
    for r in answers:
        assert r.status_code == 200 and len(r.json()) == 16
        assert all(len(o["meta_info"]["output_top_logprobs"]) == 32 for o in r.json())
    assert not prober.failures and prober.worst_s < STALL_BOUND_S, prober.worst_s
    assert_idle_and_clean(admin)


def test_taken_port_fails_fast_without_traceback():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(os.path.dirname(__file__)),
                                                             os.environ.get("PYTHONPATH", "")])}
        # NOTE: a model path that does not exist: the bind must fail before any load is tried
        p = subprocess.run([sys.executable, "-m", "rollout.server", "--port", str(port), "--host", "127.0.0.1",
                            "--model-path", "/nonexistent-model"], capture_output=True, text=True, timeout=120, env=env)
    assert p.returncode == 1, p.stderr[-2000:]
    assert f"cannot listen on 127.0.0.1:{port}" in p.stderr and "Traceback" not in p.stderr, p.stderr[-2000:]


def test_malformed_weight_map_updates_are_400_and_the_old_weights_serve(server, admin, weight_dir):
    greedy = {"input_ids": [5, 6, 7, 8], "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}}
    before = admin.post("/generate", json=greedy).json()["output_ids"]
    for i, bad in enumerate([[], "model.safetensors", None, {}, {"w": 3}]):
        d = weight_dir / f"bad{i}"
        d.mkdir()
        (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": bad}))
        r = admin.post("/update_weights_from_disk", json={"model_path": str(d)})
        assert r.status_code == 400 and r.json()["success"] is False and "weight_map" in r.json()["message"], r.text
        assert admin.post("/generate", json=greedy).json()["output_ids"] == before


def _events(response):
    return [line[6:] for line in response.iter_lines() if line.startswith("data: ")]


@pytest.mark.slow
@pytest.mark.parametrize("incremental", [False, True])
def test_large_stream_chunks_keep_order_and_content(server, admin, incremental):
    """Chunks past EventEncoder's bound are built off the loop: the same events, in order, as the answer."""
    body = {"input_ids": [5, 6, 7], "return_logprob": True, "top_logprobs_num": 20, "return_routed_experts": True,
            "sampling_params": {"max_new_tokens": 240, "n": 2, "temperature": 0, "ignore_eos": True}}
    whole = admin.post("/generate", json=body).json()
    with admin.stream("POST", "/generate", json={**body, "stream": True,
                                                  "incremental_streaming_output": incremental}) as r:
        events = _events(r)
    assert r.status_code == 200 and events[-1] == "[DONE]", events[-2:]
    chunks = [json.loads(e) for e in events[:-1]]
    for i, want in enumerate(whole):
        mine = [c for c in chunks if c["index"] == i]
        ids = [t for c in mine for t in c["output_ids"]] if incremental else mine[-1]["output_ids"]
        assert ids == want["output_ids"]                                          # greedy: the same tokens
        lengths = [c["meta_info"]["completion_tokens"] for c in mine]
        assert lengths == sorted(lengths) and lengths[-1] == 240, lengths      # in order
        tops = [row for c in mine[:-1] for row in c["meta_info"]["output_top_logprobs"]] if incremental \
            else mine[-2]["meta_info"]["output_top_logprobs"]
        final = mine[-1]["meta_info"]["output_top_logprobs"]
        if incremental:
            assert len(tops) + len(final) == 240
        else:   # the last chunk is built from the whole output, the others from the deltas: they agree
            assert len(final) == 240 and final[:len(tops)] == tops
            for a, b in zip(mine, mine[1:]):                                      # each extends the one before
                ok = b["output_ids"][:len(a["output_ids"])] == a["output_ids"]
                assert ok and b["meta_info"]["output_top_logprobs"][:len(a["output_ids"])] == \
                    a["meta_info"]["output_top_logprobs"]
            assert "routed_experts" in mine[-1]["meta_info"]
