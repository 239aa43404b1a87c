"""Two "nodes" on this machine: the head is the engine in this process, the worker node a
separate process tree started by the headless command (`python -m backend.parallel.node`),
meeting over the head's TCP store on loopback. Pipeline stage 1 runs on the worker node.
The tokens are transformers' (so one rank's); killing the worker node's processes fails
every request in flight with an error naming the node, within the health timeout; a
node that never joins fails the load after the join timeout, naming it."""

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from backend import EngineArgs, SamplingParams
from backend.engine.engine_loop import EngineLoop
from backend.engine.errors import EngineDeadError
from backend.engine.llm_engine import LLMEngine
from tests.conftest import ROOT, assert_pool_free, random_prompts
from tests.helpers.checkpoints import hf_greedy, make_checkpoint

HEALTH_S = 2.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _args(path: str, port: int, **kw) -> EngineArgs:
    return EngineArgs.create(model=path, pipeline_parallel_size=2, nnodes=2, master_addr="127.0.0.1",
                             master_port=port, block_size=4, num_kv_blocks=200, max_num_seqs=8,
                             max_num_batched_tokens=32, dtype="float32", node_health_timeout_s=HEALTH_S, **kw)


def test_worker_node_serves_stage_one_and_its_death_fails_requests(ckpt_dir):
    path = make_checkpoint(str(ckpt_dir / "pp_qwen2_3l"), "qwen2", num_hidden_layers=3)
    prompts = random_prompts(3, [5, 40, 17], seed=2)
    expected = hf_greedy(path, prompts, 8)
    port = _free_port()
    # The worker node first: it waits for the head's store (as a LeaderWorkerSet worker may).
    env = {**os.environ, "PYTHONPATH": ROOT, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "NODE_RANK": "1"}
    node = subprocess.Popen([sys.executable, "-m", "backend.parallel.node", "--nnodes", "2", "--join-timeout-s", "60"],
                            env=env, start_new_session=True, stderr=subprocess.PIPE, text=True)
    engine = loop = None
    try:
        engine = LLMEngine(_args(path, port))
        loop = EngineLoop(engine).start()
        greedy = SamplingParams(max_tokens=8, min_tokens=8, temperature=0)
        streams = [loop.add_request(p, greedy, f"g{i}") for i, p in enumerate(prompts)]
        assert [list(s)[-1].token_ids for s in streams] == expected
        assert engine.stats()["bytes_per_rank"][1][1] > 0           # stage 1's KV lives on the node

        long = SamplingParams(max_tokens=400, min_tokens=400, temperature=0)
        streams = [loop.add_request(p, long, f"k{i}") for i, p in enumerate(prompts)]
        first = iter(streams[0])
        next(first)                                                 # generation is under way
        os.killpg(node.pid, signal.SIGKILL)
        t0 = time.monotonic()
        finals = [list(first)[-1]] + [list(s)[-1] for s in streams[1:]]
        waited = time.monotonic() - t0
        assert waited < HEALTH_S + 3, waited
        for out in finals:
            assert isinstance(out.error, EngineDeadError) and "worker node 1 (rank 1)" in str(out.error), out.error
        assert not loop.is_alive
        assert_pool_free(engine)
        print(f"worker node killed: requests failed after {waited:.2f} s: {finals[0].error}")
    finally:
        if loop is not None:
            loop.stop()
        if engine is not None:
            engine.shutdown()
        if node.poll() is None:
            os.killpg(node.pid, signal.SIGKILL)
        node.wait()


def test_a_node_that_never_joins_fails_the_load_naming_it(ckpt_dir):
    path = make_checkpoint(str(ckpt_dir / "pp_qwen2_3l"), "qwen2", num_hidden_layers=3)
    t0 = time.monotonic()
    with pytest.raises(EngineDeadError, match=r"worker node 1 \(rank 1\) did not join within 1\.5 s"):
        LLMEngine(_args(path, _free_port(), node_join_timeout_s=1.5))
    assert time.monotonic() - t0 < 10
