import json

from clients.tritonserver import free_port
from supervisor.status import FAILED, SERVING, Failure, StatusServer, SupervisorStatus
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
