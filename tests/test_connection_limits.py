"""A real rollout-serve's connection limits: --timeout-read closes partial-header, partial-body and
silent connections within its deadline, and --max-connections answers a connection past the cap
with a JSON 503 (then closes it), the connections within it served on."""
import socket
import time

import httpx
import pytest

from rollout.server.args import FD_RESERVE, MIN_CONNECTIONS, ServerArgs, default_max_connections
from server_proc import ServerProcess

pytestmark = pytest.mark.timeout(300)
CAP = 8
READ_S = 2


@pytest.fixture(scope="module")
def server():
    with ServerProcess(["--max-connections", str(CAP), "--timeout-read", str(READ_S)]) as srv:
        yield srv
        assert srv.alive, srv.log()


def _port(srv):
    return int(srv.url.rsplit(":", 1)[1])


def _closed_after(sock, limit_s):
    """Seconds until the server closed `sock` (None: still open after limit_s)."""
    t0 = time.monotonic()
    sock.settimeout(limit_s)
    try:
        while sock.recv(4096):
            pass
    except ConnectionResetError:
        pass
    except socket.timeout:
        return None
    return time.monotonic() - t0


def test_max_connections_flag_and_default():
    assert ServerArgs.from_cli(["--max-connections", "100"]).connection_cap == 100
    assert ServerArgs().connection_cap == default_max_connections() >= MIN_CONNECTIONS
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ValueError, match="max_connections"):
            ServerArgs(max_connections=bad)
    import resource
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert default_max_connections() == max(MIN_CONNECTIONS, soft - FD_RESERVE)


def test_read_deadline_closes_slow_and_silent_connections(server):
    port = _port(server)
    silent = socket.create_connection(("127.0.0.1", port))
    header = socket.create_connection(("127.0.0.1", port))
    header.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
    body = socket.create_connection(("127.0.0.1", port))
    body.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n"
                 b"\r\n{\"input_ids\"")
    for s in (silent, header, body):
        took = _closed_after(s, READ_S + 8)
        assert took is not None, "connection still open well past --timeout-read"
        s.close()
    with httpx.Client(base_url=server.url, timeout=60) as c:
        assert c.get("/health").status_code == 200


def test_connection_past_the_cap_gets_a_json_503(server):
    port = _port(server)
    held = [socket.create_connection(("127.0.0.1", port)) for _ in range(CAP)]
    try:
        time.sleep(0.2)    # NOTE: accepted by the server before the next one connects
        with httpx.Client(base_url=server.url, timeout=30) as c:
            r = c.get("/health")
        assert r.status_code == 503 and r.headers["content-type"] == "application/json", r.text
        err = r.json()["error"]
        assert err["code"] == 503 and "--max-connections" in err["message"], err
        # a connection within the cap is served
        held[0].sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        held[0].settimeout(10)
        assert held[0].recv(4096).startswith(b"HTTP/1.1 200")
    finally:
        for s in held:
            s.close()
    deadline = time.monotonic() + 10
    while True:    # NOTE: the server sees the closes shortly after
        with httpx.Client(base_url=server.url, timeout=30) as c:
            if c.get("/health").status_code == 200:
                break
        assert time.monotonic() < deadline, "the cap still refuses after the connections closed"
        time.sleep(0.1)
