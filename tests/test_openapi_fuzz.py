"""schemathesis against the published /openapi.json of a real rollout-serve: every operation it
generates (valid and invalid bodies) is answered without a server error (5xx), and 4xx answers
carry the JSON error body."""
import httpx
import pytest
from hypothesis import HealthCheck, given, settings

from server_proc import ServerProcess, wait_idle

# NOTE: schemathesis is a dev extra, absent from the GPU machine's image: skip, never a collection error
schemathesis = pytest.importorskip("schemathesis")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
# NOTE: operations that change global state (pausing, weights, group rendezvous to any address) are
# left to test_server_fuzz.py, which sends them with a resume/valid-address discipline.
EXCLUDED = ("/pause_generation", "/update_weights_from_disk", "/update_weights_from_tensor",
            "/init_weights_update_group", "/update_weights_from_distributed", "/destroy_weights_update_group",
            "/update_weight_version", "/release_memory_occupation", "/resume_memory_occupation")


@pytest.fixture(scope="module")
def server():
    with ServerProcess(["--enable-return-routed-experts", "--enable-debug-endpoints", "--context-length", "64",
                        "--max-total-tokens", "4096", "--max-request-bytes", str(1 << 20)]) as srv:
        yield srv


@pytest.fixture(scope="module")
def api_schema(server):
    loaded = schemathesis.openapi.from_url(server.url + "/openapi.json")
    loaded.config.update(base_url=server.url)
    return loaded


def test_openapi_operations_never_5xx(api_schema):
    # NOTE: schemathesis' pytest plugin does not load under this pytest; each operation's hypothesis
    # strategy is driven directly instead
    ran = []
    for result in api_schema.get_all_operations():
        op = result.ok()
        if op.path in EXCLUDED:
            continue

        @given(case=op.as_strategy())
        @settings(max_examples=25, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))
        def check(case):
            response = case.call(timeout=120)
            assert response.status_code < 500, (case.path, case.body, response.status_code, response.text[:300])
            if response.status_code >= 400:
                body = response.json()
                assert ("error" in body and body["error"]["message"]) or body.get("success") is False, body

        check()
        ran.append(f"{op.method.upper()} {op.path}")
    assert "POST /generate" in ran and "POST /v1/chat/completions" in ran and len(ran) >= 15, ran


def test_healthy_after(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        c.post("/continue_generation")
        wait_idle(c)
        assert c.post("/flush_cache").status_code == 200
        state = c.get("/debug/integrity").json()
        assert state["ok"] and state["kv_used"] == 0 and state["running"] == 0, state
