"""supervisor/sidecars.py with real child processes: a sidecar that exits is noticed,
reported down, and started again after its backoff."""

import sys
import time

from supervisor.sidecars import Sidecar, Sidecars
from supervisor.status import SERVING, SupervisorStatus

SLEEPER = [sys.executable, "-c", "import time; time.sleep(60)"]


def wait_until(cond, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline
        time.sleep(0.02)


def test_a_killed_sidecar_is_reported_then_restarted():
    cars = Sidecars([Sidecar("openai", SLEEPER, env={})])
    cars.sidecars[0].backoff_s = 0.2
    status = SupervisorStatus(state=SERVING)
    cars.start()
    try:
        first = cars.sidecars[0].proc
        cars.poll()
        assert cars.snapshot()["openai"]["state"] == "running"
        first.kill()
        first.wait()
        cars.poll()                                   # found dead: logged, a restart scheduled
        status.set_sidecars(cars.snapshot())
        assert cars.snapshot()["openai"]["state"] == "down"
        assert status.sidecars_down() == "sidecar 'openai' is down (last exit code -9)"
        assert status.snapshot()["sidecars"]["openai"] == {"state": "down", "pid": None, "restarts": 0,
                                                          "last_exit": -9}
        assert 'llm_sidecar_up{name="openai"} 0' in status.prometheus()
        wait_until(lambda: (cars.poll(), cars.sidecars[0].up)[1])
        assert cars.sidecars[0].proc.pid != first.pid and cars.sidecars[0].restarts == 1
        status.set_sidecars(cars.snapshot())
        assert status.sidecars_down() == "" and 'llm_sidecar_restarts_total{name="openai"} 1' in status.prometheus()
    finally:
        cars.stop()
    assert cars.snapshot()["openai"]["state"] == "down"


def test_a_sidecar_that_keeps_dying_backs_off():
    cars = Sidecars([Sidecar("guard", [sys.executable, "-c", "raise SystemExit(3)"], env={})], max_backoff_s=0.4)
    cars.sidecars[0].backoff_s = 0.1
    cars.start()
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline:
        cars.poll()
        time.sleep(0.01)
    car = cars.sidecars[0]
    assert car.last_exit == 3
    # 0.1 + 0.2 + 0.4 + 0.4 ... plus start-up time: a handful of restarts, not hundreds
    assert 2 <= car.restarts <= 8 and car.backoff_s == 0.4
    cars.stop()


def test_a_sidecar_that_cannot_start_is_tried_again():
    calls = []

    def popen(*args, **kwargs):
        calls.append(args)
        raise OSError(24, "Too many open files")

    cars = Sidecars([Sidecar("openai", SLEEPER, env={})], popen=popen)
    cars.sidecars[0].backoff_s = 0.05
    cars.start()
    assert cars.snapshot()["openai"]["state"] == "down"
    time.sleep(0.06)
    cars.poll()
    assert len(calls) == 2


def test_ready_waits_for_a_running_sidecar_to_serve():
    """/ready turned 200 about 3 s before the OpenAI API stopped answering 503."""
    import threading
    from http.server import BaseHTTPRequestHandler, HTTPServer

    from clients.tritonserver import free_port
    from supervisor.status import StatusServer
    from supervisor.triton_api import http_request
    answer = [503]

    class Health(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            self.send_response(answer[0])
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    health_port, status_port = free_port(), free_port()
    health = HTTPServer(("127.0.0.1", health_port), Health)
    threading.Thread(target=health.serve_forever, daemon=True).start()
    cars = Sidecars([Sidecar("openai", SLEEPER, env={}, ready_url=f"http://127.0.0.1:{health_port}/health")])
    status = SupervisorStatus(state=SERVING)
    cars.start()
    srv = StatusServer(status_port, status, lambda: True, not_ready=cars.not_ready).start()
    try:
        status.set_sidecars(cars.snapshot())
        code, body = http_request(f"http://127.0.0.1:{status_port}/ready")
        assert code == 503 and "sidecar 'openai' is not ready yet" in body
        answer[0] = 200
        assert http_request(f"http://127.0.0.1:{status_port}/ready")[0] == 200
    finally:
        srv.stop()
        health.shutdown()
        cars.stop()
