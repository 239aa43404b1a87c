"""A supervised tritonserver (as `make serve` runs it) serving the default model split
over two ranks (tensor_parallel_size=2, gloo on CPU): a rank killed from outside fails
every stream in flight at once, the model leaves service, the supervisor loads it again
with fresh ranks, and nothing is left running after the server stops. (The streaming
tests themselves run against a two-rank server in test_serving.py.)"""

import os
import signal
import time

from clients.tritonserver import TritonServer
from tests.helpers.faults import backend_pid
from tests.integration.conftest import build_repo, metric
from tests.integration.test_recovery import Streams, assert_recovered, greedy, supervisor_json, wait_until


def rank_pids(stub_pid: int) -> list[int]:
    """The stub's tensor-parallel ranks: its children started by multiprocessing's spawn."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        if ppid == stub_pid and b"spawn_main" in cmdline:
            found.append(int(entry))
    return found


def test_a_killed_rank_fails_the_streams_and_the_model_comes_back(tmp_path, tiny_ckpt):
    repo = build_repo(tmp_path / "repo", tiny_ckpt, tensor_parallel_size=2)
    srv = TritonServer(repo, log_path=str(tmp_path / "server.log"), supervised=True)
    t0 = time.monotonic()
    srv.start()
    load_time = time.monotonic() - t0
    try:
        reference = greedy(srv)
        streams = Streams(srv, 4)
        wait_until(lambda: metric(srv, "vllm:num_requests_running") == 4, 30)
        (rank1,) = rank_pids(backend_pid(repo))
        t_kill = time.monotonic()
        os.kill(rank1, signal.SIGKILL)
        streams.join(10)
        assert len(streams.ended) == 4, "a stream hung"
        assert all(streams.ended[i] - t_kill < 5 for i in range(4))
        for r in streams.results.values():
            assert r.error and f"tensor parallel rank 1 (pid {rank1}) exited with code -9" in r.error, r.error
        unhealthy = wait_until(lambda: supervisor_json(srv, "/ready")[0] == 503, 5)
        assert_recovered(srv, reference, load_time, t_kill)
        (new_rank1,) = rank_pids(backend_pid(repo))
        assert new_rank1 != rank1
        status = supervisor_json(srv, "/status")[1]
        assert status["failures"] == {"engine_failed": 1} and status["recoveries"] == 1, status
        print(f"streams failed {max(streams.ended.values()) - t_kill:.2f}s after the kill, model out of service "
              f"after {unhealthy:.2f}s, serving again after {time.monotonic() - t_kill:.1f}s; a stream got: "
              f"{streams.results[0].error}")
    finally:
        srv.stop()
    wait_until(lambda: not os.path.exists(f"/proc/{new_rank1}"), 10)    # unloading stopped the rank
