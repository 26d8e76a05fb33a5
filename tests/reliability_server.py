"""The reliability tests' server (embedded tiny model, float32, routing on, 4 running requests at
most, admin key) and their checks: every request answered, KV back to idle, routing exact; and
`health_probe`, which a test module imports to run a /health prober through each of its tests on
that server (the prober's worst gap, RSS back within a bound, KV back to idle)."""
import asyncio
import random

import httpx
import psutil
import pytest

from health_prober import HealthProber

from capture.codec import decode_routed_experts
from oracle import hf_router_topk, same_sets
from rollout.config import DEFAULT_MODEL_PATH
from server_proc import ServerProcess, wait_idle

ADMIN_KEY = "reliability-admin"
GREEDY = {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True}


def prompts(seed, lengths, vocab=576):
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


@pytest.fixture(scope="module")
def weight_dir(tmp_path_factory):
    """A directory the server's /update_weights_from_disk may read (--allowed-weight-dirs)."""
    return tmp_path_factory.mktemp("weights")


@pytest.fixture(scope="module")
def server(weight_dir):
    with ServerProcess(["--enable-return-routed-experts", "--enable-debug-endpoints", "--admin-api-key", ADMIN_KEY,
                        "--dtype", "float32", "--max-running-requests", "4",
                        "--allowed-weight-dirs", str(weight_dir)]) as srv:
        yield srv
        assert srv.alive, srv.log()


@pytest.fixture(scope="module")
def admin(server):
    with httpx.Client(base_url=server.url, timeout=120, headers={"Authorization": f"Bearer {ADMIN_KEY}"}) as c:
        yield c


@pytest.fixture(scope="module")
def shape(admin):
    info = admin.get("/model_info").json()
    return info["num_hidden_layers"], info["num_experts_per_tok"]


# NOTE: what a loaded 2-core CI host holds (the tests' worst gaps measured there: docs/benchmarks.md,
# Hostile input); the ~100 ms target is the benchmark's (scripts/bench_hostile.py), on a quiet host
PROBE_GAP_S = 1.0
PROBE_RSS_BYTES = 300 * 2**20


@pytest.fixture(autouse=True)
def health_probe(request):
    """Around each test that uses `server`: a /health prober on its own connection; afterwards it
    saw no failure and no gap over PROBE_GAP_S, the server's RSS is within PROBE_RSS_BYTES of where
    it was, and nothing runs, waits or holds KV."""
    if "server" not in request.fixturenames:
        yield None
        return
    server = request.getfixturevalue("server")
    proc = psutil.Process(server._server.proc.pid)
    before = proc.memory_info().rss
    with HealthProber(server.url, period_s=0.02) as prober:
        yield prober
    assert not prober.failures and prober.probes > 0, prober.failures[:5]
    assert prober.worst_s < PROBE_GAP_S, f"/health took {prober.worst_s:.2f} s"
    with httpx.Client(base_url=server.url, timeout=120, headers={"Authorization": f"Bearer {ADMIN_KEY}"}) as c:
        assert_idle_and_clean(c)
    grown = proc.memory_info().rss - before
    assert grown < PROBE_RSS_BYTES, f"RSS grew {grown / 2**20:.0f} MB"


def assert_idle_and_clean(admin):
    wait_idle(admin, timeout=120)
    assert admin.post("/flush_cache").status_code == 200
    state = admin.get("/debug/integrity").json()
    assert state["ok"] and state["kv_used"] == 0 and state["running"] == 0 and state["waiting"] == 0, state


def check_routing(out, shape):
    """Completed: T - 1 rows, transformers' router top-k for the whole sequence."""
    meta = out["meta_info"]
    seq = out["_prompt"] + out["output_ids"]
    rows = decode_routed_experts(meta["routed_experts"], "int32", num_layers=shape[0], top_k=shape[1])
    assert rows.shape[0] == len(seq) - 1
    ref = hf_router_topk(DEFAULT_MODEL_PATH, seq[:-1], shape[1], shape[0])
    assert same_sets(rows, ref)


async def generate_all(url, bodies):
    async with httpx.AsyncClient(base_url=url, timeout=300) as c:
        async def one(body):
            r = await c.post("/generate", json=body)
            assert r.status_code == 200, r.text
            return {**r.json(), "_prompt": body["input_ids"]}
        return await asyncio.gather(*(one(b) for b in bodies))


