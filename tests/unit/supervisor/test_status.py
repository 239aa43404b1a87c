import json

from clients.tritonserver import free_port
from supervisor.status import FAILED, SERVING, STOPPING, Failure, StatusServer, SupervisorStatus
from supervisor.triton_api import http_request


def get(port, path):
    return http_request(f"http://127.0.0.1:{port}{path}")


def test_prometheus_text_counts_failures_and_recoveries():
    s = SupervisorStatus()
    s.on_failure(Failure("backend_died", 'pid 7 "gone"\nbadly', "llm"))
    s.on_attempt()
    s.on_recovered(6.5)
    text = s.prometheus()
    assert 'llm_backend_failures_total{kind="backend_died"} 1' in text
    assert "llm_backend_recoveries_total 1" in text
    assert "llm_backend_recovery_attempts_total 1" in text
    assert "llm_backend_last_recovery_seconds 6.5" in text
    assert 'llm_backend_state{state="serving"} 1' in text and 'llm_backend_state{state="recovering"} 0' in text
    assert 'cause="pid 7 \\"gone\\"\\nbadly"' in text  # label values escaped


def test_listens_on_an_ipv6_host():
    """`serve --host ::1` starts the supervisor's server on ::1 (the stdlib's server class
    is IPv4-only), and its URL, as `local_address` writes it, reaches it."""
    from clients.tritonserver import local_address
    import socket

    import pytest
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError as e:
        pytest.skip(f"this machine has no IPv6 loopback: {e}")
    s, port = SupervisorStatus(), free_port()
    srv = StatusServer(port, s, lambda: True, host="::1").start()
    try:
        assert http_request(f"http://{local_address('::1')}:{port}/live")[0] == 200
    finally:
        srv.stop()


def test_endpoints_follow_the_state():
    s, triton_ready = SupervisorStatus(), [True]
    port = free_port()
    srv = StatusServer(port, s, lambda: triton_ready[0], host="127.0.0.1").start()
    try:
        assert get(port, "/ready")[0] == 503  # starting
        s.set_state(SERVING)
        assert get(port, "/ready")[0] == 200 and get(port, "/live")[0] == 200
        triton_ready[0] = False
        code, body = get(port, "/ready")
        assert code == 503 and "tritonserver is not ready" in body
        triton_ready[0] = True
        s.on_failure(Failure("engine_stalled", "no step for 2s", "llm"))
        code, body = get(port, "/ready")
        assert code == 503 and "engine_stalled" in json.loads(body)["reason"]
        assert get(port, "/live")[0] == 200  # live while recovering
        s.set_state(FAILED, "gave up")
        code, body = get(port, "/live")
        assert code == 503 and json.loads(body)["reason"] == "gave up"
        status = json.loads(get(port, "/status")[1])
        assert status["failures"] == {"engine_stalled": 1} and status["last_failure"]["model"] == "llm"
        assert "llm_backend_failures_total" in get(port, "/metrics")[1]
        assert get(port, "/nope")[0] == 404
    finally:
        srv.stop()


def test_a_late_heartbeat_is_the_reason_even_when_tritonserver_turned_not_ready_too():
    """Triton pings its stubs as well: a hung stub can make it not ready before the
    heartbeat is late enough to count. /ready then names the heartbeat once it is."""
    s, late = SupervisorStatus(state=SERVING), [""]
    port = free_port()
    srv = StatusServer(port, s, lambda: False, host="127.0.0.1", backend_not_ready=lambda: late[0]).start()
    try:
        code, body = get(port, "/ready")
        assert code == 503 and json.loads(body)["reason"] == "tritonserver is not ready"
        late[0] = "the backend process of 'llm_0_0' (pid 7) has sent no heartbeat for 6s"
        code, body = get(port, "/ready")
        assert code == 503 and json.loads(body)["reason"] == late[0]
    finally:
        srv.stop()


def test_backend_ready_leaves_the_sidecars_out():
    """Issue 49 item 10: the OpenAI frontend (a sidecar) fails fast on `backend_ready`,
    which only a hung backend process (a late heartbeat) or a recovery turns false: not
    a sidecar down (nor the frontend's own readiness), not tritonserver's readiness (false
    while any model loads), not starting or stopping (a drain lets requests finish)."""
    s, late, triton_ready = SupervisorStatus(), [""], [False]
    port = free_port()
    srv = StatusServer(port, s, lambda: triton_ready[0], host="127.0.0.1",
                       backend_not_ready=lambda: late[0]).start()

    def backend():
        code, body = get(port, "/ready?scope=backend")
        body = json.loads(body)
        assert (code == 200) == body["ready"] == body["backend_ready"], (code, body)
        return body["backend_ready"], body["backend_reason"]
    try:
        assert get(port, "/ready")[0] == 503 and backend() == (True, "")      # starting
        s.set_state(SERVING)
        assert get(port, "/ready")[0] == 503 and backend() == (True, "")      # a model loading
        triton_ready[0] = True
        body = json.loads(get(port, "/ready")[1])
        assert body["ready"] and body["backend_ready"] and body["backend_reason"] == ""
        s.set_sidecars({"openai": {"state": "down", "pid": None, "restarts": 1, "last_exit": 1}})
        code, body = get(port, "/ready")
        body = json.loads(body)
        assert code == 503 and "openai" in body["reason"] and body["backend_ready"], body
        assert backend() == (True, "")
        s.set_sidecars({})
        late[0] = "the backend process of 'llm_0_0' (pid 7) has sent no heartbeat for 6s"
        body = json.loads(get(port, "/ready")[1])
        assert not body["backend_ready"] and body["backend_reason"] == late[0]
        assert backend() == (False, late[0])
        late[0] = ""
        s.on_failure(Failure("backend_died", "pid 7 exited", "llm"))
        ready, reason = backend()
        assert not ready and "backend_died" in reason
        s.set_state(STOPPING)
        assert backend() == (True, "")
    finally:
        srv.stop()


FLOOD_SERVER = """
import resource, sys, time
from supervisor import status
resource.setrlimit(resource.RLIMIT_NOFILE, (64, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
status.MAX_CONNECTIONS, status.READ_TIMEOUT_S = 32, 0.5     # (MAX_PER_CLIENT: 16)
s = status.SupervisorStatus(state=status.SERVING)
status.StatusServer(int(sys.argv[1]), s, lambda: True).start()
print("up", flush=True)
time.sleep(60)
"""


def test_idle_connections_past_the_descriptor_limit_leave_the_port_serving():
    """The red team's flood: a thread per idle connection, unbounded, ran the supervisor
    out of descriptors (1,024) until it exited. Here the limit is 64 and an attacker keeps
    300 idle connections coming: the extra ones are closed, the idle ones time out, and a
    probe from another address (a kubelet's) is answered at once meanwhile."""
    import collections
    import http.client
    import socket
    import subprocess
    import sys
    import threading
    import time
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-c", FLOOD_SERVER, str(port)], stdout=subprocess.PIPE)
    stop, opened = threading.Event(), [0]

    def flood():
        socks = collections.deque()
        while not stop.is_set():
            try:
                socks.append(socket.create_connection(("127.0.0.1", port), timeout=2))
                opened[0] += 1
            except OSError:
                pass
            if len(socks) > 300:
                socks.popleft().close()
        for sock in socks:
            sock.close()

    def probe() -> tuple[int, float]:
        t0 = time.monotonic()
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5, source_address=("127.0.0.2", 0))
        try:
            conn.request("GET", "/live")
            return conn.getresponse().status, time.monotonic() - t0
        finally:
            conn.close()

    attacker = threading.Thread(target=flood)
    try:
        assert proc.stdout.readline() == b"up\n"
        attacker.start()
        while opened[0] < 300:
            time.sleep(0.01)
        answers = [probe() for _ in range(5)]
        assert all(code == 200 and seconds < 1.0 for code, seconds in answers), answers
        stop.set()
        attacker.join(10)
        time.sleep(1.0)                             # past the read timeout
        assert proc.poll() is None
        assert get(port, "/live")[0] == 200         # (the attacker's address too, once it stops)
    finally:
        stop.set()
        if attacker.is_alive():
            attacker.join(10)
        proc.kill()
        proc.wait()


def test_trickling_clients_hold_no_slot_past_the_deadline_nor_more_than_their_share(monkeypatch):
    """A byte every 1.9 s beat the 2 s read timeout and held a slot for ever; 256 such
    clients would close every probe (review)."""
    import socket
    import threading
    import time
    from supervisor import status as st
    monkeypatch.setattr(st, "MAX_PER_CLIENT", 4)
    monkeypatch.setattr(st, "REQUEST_DEADLINE_S", 0.6)
    monkeypatch.setattr(st, "READ_TIMEOUT_S", 0.5)
    s = SupervisorStatus(state=SERVING)
    port = free_port()
    srv = StatusServer(port, s, lambda: True).start()
    stop = threading.Event()
    socks = [socket.create_connection(("127.0.0.1", port)) for _ in range(8)]   # past this client's 4

    def trickle():
        while not stop.is_set():
            for sock in socks:
                try:
                    sock.send(b"G")
                except OSError:
                    pass
            time.sleep(0.2)

    t = threading.Thread(target=trickle, daemon=True)
    t.start()
    try:
        time.sleep(1.0)                                   # past the deadline: their slots are free
        closed = 0
        for sock in socks:
            sock.settimeout(0.5)
            try:
                closed += sock.recv(1) == b""
            except OSError:
                closed += 1
        assert closed == 8
        assert get(port, "/live")[0] == 200
    finally:
        stop.set()
        for sock in socks:
            sock.close()
        srv.stop()
