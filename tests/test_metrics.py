"""A server you can watch: /metrics through prometheus_client with SGLang's names and histograms, the
line logged when the server is ready, the periodic batch lines, and a real Prometheus scraping it.

One rollout-serve (embedded tiny MoE, --log-level info) serves the module; every count is checked
as the difference between two scrapes around the requests that made it.
"""
import json
import shutil
import subprocess
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from rollout.config import DEFAULT_MODEL_PATH
from rollout.core.token_latency import Bucketed, TokenLatency
from rollout.generate_io import RolloutOutput
from rollout.ipc.control_values import ITL_BUCKETS, TTFT_BUCKETS
from rollout.server.metrics import E2E_BUCKETS, Metrics
from server_proc import ServerProcess, free_port, sse_events, wait_idle

pytestmark = pytest.mark.timeout(300)
LONG = {"temperature": 0.0, "max_new_tokens": 48, "ignore_eos": True}
HISTOGRAMS = {"sglang:time_to_first_token_seconds": TTFT_BUCKETS, "sglang:inter_token_latency_seconds": ITL_BUCKETS,
              "sglang:e2e_request_latency_seconds": E2E_BUCKETS}


@pytest.fixture(scope="module")
def server():
    with ServerProcess(["--log-level", "info", "--enable-return-routed-experts"]) as srv:
        yield srv
        assert srv.alive, srv.log()


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


def scrape(client) -> tuple[dict, dict]:
    """(every sample by (name, sorted labels), every family's type by name)."""
    samples, types = {}, {}
    for family in text_string_to_metric_families(client.get("/metrics").text):
        types[family.name] = family.type
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples, types


def value(samples: dict, name: str, **labels) -> float:
    """The sum of the samples of `name` whose labels include `labels`."""
    hits = [v for (n, ls), v in samples.items() if n == name and set(labels.items()) <= set(ls)]
    assert hits, f"{name} {labels} missing"
    return sum(hits)


def buckets(samples: dict, name: str) -> list[tuple[float, float]]:
    out = [(float(dict(ls)["le"]), v) for (n, ls), v in samples.items() if n == name + "_bucket"]
    return sorted(out)


def run_workload(client) -> list[dict]:
    """Non-streamed (n = 2, concurrently), streamed and OpenAI requests; each sample's meta_info."""
    metas: list[dict] = []
    lock = threading.Lock()

    def generate(prompt):
        r = client.post("/generate", json={"input_ids": prompt, "sampling_params": {**LONG, "n": 2}})
        assert r.status_code == 200, r.text
        with lock:
            metas.extend(item["meta_info"] for item in r.json())

    threads = [threading.Thread(target=generate, args=(p,)) for p in ([5, 6, 7, 8, 9], [11, 12, 13, 14, 15, 16, 17])]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    with client.stream("POST", "/generate", json={"text": "Q: 12+7= A:", "stream": True,
                                                   "sampling_params": {**LONG, "max_new_tokens": 9}}) as r:
        metas.append([e for e in sse_events(r)][-1]["meta_info"])
    usage = client.post("/v1/completions", json={"model": "tiny-moe", "prompt": [21, 22, 23], "max_tokens": 5,
                                                 "temperature": 0}).json()["usage"]
    metas.append({"prompt_tokens": usage["prompt_tokens"], "completion_tokens": usage["completion_tokens"]})
    return metas


def test_histograms_and_counters_count_the_requests(client):
    wait_idle(client)
    before, _ = scrape(client)
    metas = run_workload(client)
    wait_idle(client)
    after, types = scrape(client)

    def delta(name, **labels):
        return value(after, name, **labels) - (value(before, name, **labels) if any(
            n == name for n, _ in before) else 0)

    requests, generated = len(metas), sum(m["completion_tokens"] for m in metas)
    assert requests == 6 and all(m["completion_tokens"] > 0 for m in metas)
    for name, bounds in HISTOGRAMS.items():
        assert types[name] == "histogram", name
        got = buckets(after, name)
        assert [b for b, _ in got] == [*bounds, float("inf")], name
        assert all(a <= b for (_, a), (_, b) in zip(got, got[1:])), name   # cumulative
        assert got[-1][1] == value(after, name + "_count"), name
    assert delta("sglang:e2e_request_latency_seconds_count") == requests
    assert delta("sglang:time_to_first_token_seconds_count") == requests
    assert delta("sglang:inter_token_latency_seconds_count") == generated - requests
    # each request's first token came before its end
    assert 0 < delta("sglang:time_to_first_token_seconds_sum") < delta("sglang:e2e_request_latency_seconds_sum")
    assert delta("sglang:generation_tokens_total") == generated
    assert delta("sglang:prompt_tokens_total") == sum(m["prompt_tokens"] for m in metas)
    assert delta("sglang:num_requests_total") == requests
    assert delta("sglang:num_aborted_requests_total") == 0
    assert delta("sglang:realtime_tokens_total", mode="decode") == generated
    assert delta("rollout_requests_finished_total") == requests
    assert delta("rollout_generation_tokens_total") == generated
    for name in ("sglang:prompt_tokens", "sglang:generation_tokens", "sglang:num_requests"):
        assert types[name] == "counter", name
    labels = dict(next(ls for (n, ls) in after if n == "sglang:num_running_reqs"))
    assert labels == {"model_name": "tiny-moe", "engine_type": "unified", "tp_rank": "0", "pp_rank": "0",
                      "moe_ep_rank": "0"}


def test_gauges_follow_the_load(client):
    info = client.get("/model_info").json()
    done = threading.Event()

    def long_request():
        client.post("/generate", json={"input_ids": [7, 8, 9], "sampling_params": {**LONG, "max_new_tokens": 400}})
        done.set()

    threading.Thread(target=long_request, daemon=True).start()
    deadline = time.monotonic() + 60
    while True:   # NOTE: the throughput is the batch log's, over its latest look (one a second)
        samples, types = scrape(client)
        if value(samples, "sglang:num_running_reqs") == 1 and value(samples, "sglang:gen_throughput") > 0:
            break
        assert time.monotonic() < deadline and not done.is_set(), samples
        time.sleep(0.2)
    assert 0 < value(samples, "sglang:num_used_tokens") <= info["max_total_num_tokens"]
    assert 0 < value(samples, "sglang:token_usage") <= 1
    client.post("/abort_request", json={"abort_all": True})
    assert done.wait(30)
    wait_idle(client)
    samples, types = scrape(client)
    for name in ("sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:token_usage", "sglang:gen_throughput",
                 "sglang:cache_hit_rate", "sglang:max_total_num_tokens"):
        assert types[name] == "gauge", name
    assert value(samples, "sglang:num_running_reqs") == value(samples, "sglang:num_queue_reqs") == 0
    assert value(samples, "sglang:max_total_num_tokens") == info["max_total_num_tokens"]
    assert 0 <= value(samples, "sglang:token_usage") <= 1 and 0 <= value(samples, "sglang:cache_hit_rate") <= 1
    assert value(samples, "sglang:num_aborted_requests_total") >= 1
    # idle: a second later the throughput reads 0
    time.sleep(2.5)
    assert value(scrape(client)[0], "sglang:gen_throughput") == 0


def test_ready_line_and_batch_lines_at_info(server, client):
    log = server.log()
    ready = [line for line in log.splitlines() if "INFO rollout.server: ready: model" in line]
    assert len(ready) == 1, log
    assert "(Qwen3MoeForCausalLM, " in ready[0] and "KV cache" in ready[0] and "routed-expert capture" in ready[0]
    assert ready[0].endswith(f"dp 1, serving {server.url}"), ready[0]
    r = client.post("/generate", json={"input_ids": [3, 4, 5, 6], "sampling_params": {**LONG, "n": 4}})
    assert r.status_code == 200
    deadline = time.monotonic() + 15
    while not ("Decode batch, #running-req:" in server.log() and "Prefill batch, #new-seq:" in server.log()):
        assert time.monotonic() < deadline, server.log()[-3000:]
        time.sleep(0.2)
    decode = next(line for line in server.log().splitlines() if "Decode batch" in line)
    assert "gen throughput (token/s): " in decode and "#queue-req: " in decode and "token usage: " in decode
    prefill = next(line for line in server.log().splitlines() if "Prefill batch" in line)
    assert "#new-token: " in prefill and "#cached-token: " in prefill and "cache hit rate: " in prefill


def test_decode_lines_every_decode_log_interval_steps(caplog):
    """--decode-log-interval N: one Decode batch line per N decode steps (counted from the last line)."""
    import dataclasses
    import logging

    from rollout.server.args import ServerArgs
    from rollout.server.batch_log import BatchLog

    class Engine:
        steps_done = decode = 0

        def stats(self):
            return {"num_decode_forwards": self.decode, "generated_tokens": 8 * self.decode, "prefill_new_seqs": 0,
                    "prefill_new_tokens": 0, "prefill_cached_tokens": 0, "kv_used": 40, "kv_evictable": 0,
                    "kv_total": 100, "running": 8, "waiting": 0}

    engine = Engine()
    log = BatchLog(engine, poll_s=3600, decode_log_interval=5)
    log.start()
    log.stop()
    lines = []
    with caplog.at_level(logging.INFO, logger="rollout.server"):
        for decode_steps in [1] * 12 + [7]:
            engine.steps_done += decode_steps
            engine.decode += decode_steps
            log.poll()
            lines.append(sum("Decode batch, #running-req: 8, #token: 40, token usage: 0.40" in r.message
                             for r in caplog.records))
    assert lines == [0, 0, 0, 0, 1, 1, 1, 1, 1, 2, 2, 2, 3], lines
    assert ServerArgs.from_cli(["--decode-log-interval", "5"]).decode_log_interval == 5
    default = ServerArgs.from_cli([])
    assert default.decode_log_interval == 40                                             # SGLang's default
    with pytest.raises(ValueError, match=r"decode_log_interval must be an integer in \[1, .*got 0"):
        dataclasses.replace(default, decode_log_interval=0)


def test_text_format_keeps_sglang_names_when_openmetrics_is_asked(client):
    """Prometheus asks for OpenMetrics first; prometheus_client's OpenMetrics writer would rename
    the samples sglang_* (a real scrape found it): the classic text format is served."""
    r = client.get("/metrics", headers={"Accept": "application/openmetrics-text;version=1.0.0,"
                                                  "text/plain;version=0.0.4;q=0.5,*/*;q=0.1"})
    assert r.headers["content-type"].startswith("text/plain; version=0.0.4"), r.headers
    assert "\nsglang:num_running_reqs{" in r.text and "sglang_num_running_reqs" not in r.text


def test_weight_update_time(client):
    before = scrape(client)[0]
    r = client.post("/update_weights_from_disk", json={"model_path": DEFAULT_MODEL_PATH})
    assert r.status_code == 200 and r.json()["success"], r.text
    after = scrape(client)[0]
    count = ("rollout_weight_update_seconds_count", (("source", "disk"),))
    assert after[count] - before.get(count, 0) == 1
    assert after[("rollout_weight_update_seconds_sum", (("source", "disk"),))] > 0


def test_servers_in_one_process_keep_their_own_registries():
    out = RolloutOutput(rid="r", prompt_ids=[1, 2, 3], output_ids=[4, 5], text="", finish_reason="length",
                        e2e_latency=0.5)
    a, b = Metrics(set(), None, model_name="a"), Metrics(set(), None, model_name="b")
    a.finished([out, out])
    b.finished([out])
    for metrics, n in ((a, 2), (b, 1)):
        families = {f.name: f for f in text_string_to_metric_families(metrics.render().decode())}
        (count,) = [s for s in families["sglang:e2e_request_latency_seconds"].samples if s.name.endswith("_count")]
        assert count.value == n and count.labels["model_name"] == metrics.labels["model_name"]


def test_token_latency_buckets_are_prometheus_le_and_survive_the_batching():
    latency = TokenLatency()
    latency.observe([0.1, 0.05, 0.3, 500.0], [0.002, 0.0021, 9.0])
    ttft, itl = latency.report()["time_to_first_token"], latency.report()["inter_token_latency"]
    assert ttft[0][:3] == [2, 0, 1] and ttft[0][-1] == 1 and ttft[1] == pytest.approx(500.45)   # le: <= bound
    assert itl[0][:2] == [1, 1] and itl[0][-1] == 1 and sum(itl[0]) == 3
    latency.observe([], [0.001] * (Bucketed.FLUSH_AT + 1))    # counted in one go, then one pending
    assert latency.report()["inter_token_latency"][0][0] == Bucketed.FLUSH_AT + 2


# ---- a real Prometheus -----------------------------------------------------------------------------
def test_prometheus_scrapes_the_server(server, client):
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("no prometheus binary (Debian: apt-get install prometheus; scripts/test.sh installs it as root)")
    client.post("/generate", json={"input_ids": [5, 6, 7], "sampling_params": {**LONG, "max_new_tokens": 4}})
    host_port = server.url.removeprefix("http://")
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="prometheus-") as tmp:
        config = Path(tmp) / "prometheus.yml"
        config.write_text(json.dumps({"global": {"scrape_interval": "2s", "scrape_timeout": "2s"},
                                      "scrape_configs": [{"job_name": "rollout",
                                                          "static_configs": [{"targets": [host_port]}]}]}))
        with open(Path(tmp) / "prometheus.log", "w") as log:
            proc = subprocess.Popen([binary, f"--config.file={config}", f"--storage.tsdb.path={tmp}/data",
                                     f"--web.listen-address=127.0.0.1:{port}"], stdout=log, stderr=subprocess.STDOUT)
        try:
            api = f"http://127.0.0.1:{port}/api/v1/query"
            deadline = time.monotonic() + 60
            found: dict = defaultdict(list)
            while not all(found[q] for q in ("sglang:num_running_reqs", "sglang:time_to_first_token_seconds_count")):
                assert proc.poll() is None, (Path(tmp) / "prometheus.log").read_text()
                assert time.monotonic() < deadline, httpx.get(f"http://127.0.0.1:{port}/api/v1/targets").text
                time.sleep(0.5)
                for query in ("sglang:num_running_reqs", "sglang:time_to_first_token_seconds_count"):
                    try:
                        r = httpx.get(api, params={"query": query}, timeout=5)
                    except httpx.HTTPError:
                        continue
                    if r.status_code == 200:
                        found[query] = r.json()["data"]["result"]
            running = found["sglang:num_running_reqs"][0]
            assert running["metric"]["model_name"] == "tiny-moe" and running["metric"]["job"] == "rollout"
            assert float(found["sglang:time_to_first_token_seconds_count"][0]["value"][1]) >= 1
            targets = httpx.get(f"http://127.0.0.1:{port}/api/v1/targets", timeout=5).json()["data"]["activeTargets"]
            assert targets[0]["health"] == "up", targets
        finally:
            proc.terminate()
            proc.wait(30)


@pytest.mark.slow
def test_dp2_gauges_per_rank_and_histograms_summed():
    with ServerProcess(["--dp-size", "2", "--dtype", "float32", "--cpu-threads", "1"]) as srv, \
            httpx.Client(base_url=srv.url, timeout=120) as c:
        for rank in (0, 1, 1):
            r = c.post("/generate", json={"input_ids": [5, 6, 7, 8], "routed_dp_rank": rank,
                                          "sampling_params": {**LONG, "max_new_tokens": 6}})
            assert r.status_code == 200, r.text
        wait_idle(c)
        samples, _ = scrape(c)
        ranks = {dict(ls)["dp_rank"] for (n, ls) in samples if n == "sglang:num_running_reqs"}
        assert ranks == {"0", "1"}
        assert value(samples, "sglang:realtime_tokens_total", mode="decode", dp_rank="0") == 6
        assert value(samples, "sglang:realtime_tokens_total", mode="decode", dp_rank="1") == 12
        assert value(samples, "sglang:time_to_first_token_seconds_count") == 3
        assert value(samples, "sglang:inter_token_latency_seconds_count") == 3 * 5
        assert value(samples, "sglang:max_total_num_tokens", dp_rank="1") > 0
