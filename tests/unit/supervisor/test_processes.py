import os
import subprocess
import sys
import time

from supervisor import processes
from tests.helpers.children import sleeping_child


def test_alive_checks_the_process_and_its_identity():
    p = sleeping_child("llm_0_0")
    try:
        assert processes.alive(p.pid) and processes.alive(p.pid, "llm_0_0")
        assert not processes.alive(p.pid, "llm_1_0")
    finally:
        p.kill()
        p.wait()
    assert not processes.alive(p.pid)


def test_stubs_of_reads_the_stub_argv():
    """argv as the python backend starts its stub: [stub, model.py, shm region, ..., instance]."""
    code = "import time; time.sleep(60)"
    p = subprocess.Popen(["bash", "-c", f'exec -a /x/{processes.STUB_BINARY} {sys.executable} -c "{code}" '
                          "1 1 1 dir handle llm_0_0"])
    try:
        for _ in range(50):
            stubs = processes.stubs_of(os.getpid())
            if stubs:
                break
            time.sleep(0.05)
        assert stubs == [processes.Stub(pid=p.pid, instance="llm_0_0", shm_region=code, model_path="-c")]
        assert stubs[0] in processes.stubs_of()  # without a parent: every stub
    finally:
        p.kill()
        p.wait()


def test_stubs_of_a_dead_server_include_those_it_left_behind(tmp_path):
    """A server that dies leaves its stubs reparented; one stuck in a call to the server
    holds the GIL for ever and never exits (a real tritonserver 24.10 that failed to bind
    its gRPC port after loading `llm`, 2026-11-30). Its argv still names the server, so the
    supervisor's cleanup finds and kills it."""
    stub = tmp_path / processes.STUB_BINARY          # (the kernel names a process after the file it ran)
    stub.symlink_to(sys.executable)
    code = "import time; time.sleep(60)"
    server = subprocess.Popen(["bash", "-c", f'{stub} -c "{code}" 1 1 "$$" dir handle llm_0_0 > /dev/null 2>&1 & '
                               "echo $!"], stdout=subprocess.PIPE, text=True)
    orphan = int(server.stdout.readline())
    server.wait()                                    # the server is gone, its stub lives on
    try:
        for _ in range(100):                         # (until the child has exec'd the "stub")
            if processes._cmdline(orphan)[:1] == [str(stub)]:
                break
            time.sleep(0.02)
        assert processes.alive(orphan) and processes._stat(orphan)[1] != server.pid
        assert [s.pid for s in processes.stubs_of(server.pid)] == [orphan]
        assert processes.stubs_of(server.pid + 100000) == []
        # A lifetime that ended before the stub started is another process's with that pid.
        started = processes.start_ticks(orphan)
        assert [s.pid for s in processes.stubs_of(server.pid, (started, None))] == [orphan]
        assert processes.stubs_of(server.pid, (started - 100, started - 1)) == []
        assert processes.stubs_of(server.pid, (started + 1, None)) == []
    finally:
        processes.kill(orphan)


def test_remove_shm_stays_in_dev_shm(tmp_path):
    victim = tmp_path / "file"
    victim.write_text("x")
    processes.remove_shm(f"../..{victim}")
    assert victim.exists()
    processes.remove_shm("paged_llm_test_region_that_does_not_exist")
