"""backend/dynamo_worker/handlers.py and worker.py without Dynamo: the generate handler over a real
EngineLoop (tokens as the engine's own stream gives them, an abandoned stream aborted
and its blocks freed), and KV events switched on for the router."""

import asyncio
import time

import pytest

from backend.config import ConfigError, EngineArgs
from backend.dynamo_worker.handlers import GenerateHandler
from backend.dynamo_worker.worker import with_kv_events
from backend.engine.engine_loop import EngineLoop
from backend.engine.llm_engine import LLMEngine
from backend.sampling_params import SamplingParams
from tests.conftest import assert_pool_free

PROMPT = [5, 17, 33, 8, 90, 41, 12, 7, 66, 3, 29, 54, 18, 11, 77, 23, 45]


@pytest.fixture(scope="module")
def loop(tiny_ckpt):
    engine_loop = EngineLoop(LLMEngine(EngineArgs(model=tiny_ckpt, num_kv_blocks=32, max_model_len=256))).start()
    yield engine_loop
    engine_loop.stop()


def collect(handler, request, keep=None):
    async def main():
        chunks = []
        gen = handler.generate(request)
        async for chunk in gen:
            chunks.append(chunk)
            if keep is not None and len(chunks) == keep:
                await gen.aclose()          # what Dynamo does when the client goes
                break
        return chunks
    return asyncio.run(main())


def wait_pool_free(engine, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while engine.stats()["num_used_blocks"] and time.monotonic() < deadline:
        time.sleep(0.02)
    assert_pool_free(engine)


def test_tokens_are_the_engines_own_and_the_last_chunk_has_usage(loop):
    handler = GenerateHandler(loop)
    chunks = collect(handler, {"token_ids": PROMPT, "sampling_options": {"temperature": 0},
                               "stop_conditions": {"max_tokens": 8, "ignore_eos": True}})
    want = list(loop.add_request(PROMPT, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), "ref"))[-1]
    assert [t for c in chunks for t in c["token_ids"]] == want.token_ids
    assert chunks[-1]["finish_reason"] == "length"
    assert chunks[-1]["completion_usage"]["completion_tokens"] == 8
    assert chunks[-1]["completion_usage"]["prompt_tokens"] == len(PROMPT)
    assert (handler.counts.num_finished, handler.counts.num_cancelled) == (1, 0)
    wait_pool_free(loop.engine)


def test_an_abandoned_stream_is_aborted_and_its_blocks_freed(loop):
    handler = GenerateHandler(loop)
    chunks = collect(handler, {"token_ids": PROMPT, "stop_conditions": {"max_tokens": 200, "ignore_eos": True}},
                     keep=2)
    assert len(chunks) == 2 and handler.counts.num_cancelled == 1
    wait_pool_free(loop.engine)


def test_a_bad_request_is_one_error_chunk(loop):
    handler = GenerateHandler(loop)
    assert collect(handler, {"token_ids": PROMPT, "sampling_options": {"n": 2}}) == [
        {"index": 0, "token_ids": [], "finish_reason": "error: n: Dynamo's frontend asks a worker for one "
                                                       "sequence at a time (n=1)"}]
    too_long = collect(handler, {"token_ids": PROMPT * 20, "stop_conditions": {"max_tokens": 4}})
    assert too_long[-1]["finish_reason"].startswith("error: ")
    wait_pool_free(loop.engine)


def test_kv_events_are_switched_on_unless_the_entry_configures_them(tiny_ckpt):
    on = with_kv_events(EngineArgs(model=tiny_ckpt))
    assert on.kv_events_config.enable_kv_cache_events and on.kv_events_config.endpoint.startswith("ipc://")
    own = EngineArgs(model=tiny_ckpt, kv_events_config={"enable_kv_cache_events": True,
                                                        "endpoint": "tcp://127.0.0.1:5999"})
    assert with_kv_events(own) is own
    with pytest.raises(ConfigError, match="enable_prefix_caching"):
        with_kv_events(EngineArgs(model=tiny_ckpt, enable_prefix_caching=False))


def test_the_events_socket_folder_goes_when_the_worker_exits(tiny_ckpt):
    """Each worker run left its private socket's folder in /tmp."""
    import os
    import subprocess
    import sys
    code = ("from backend.config import EngineArgs; from backend.dynamo_worker.worker import with_kv_events; "
            f"print(with_kv_events(EngineArgs(model={tiny_ckpt!r})).kv_events_config.endpoint)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    folder = os.path.dirname(out.stdout.strip().removeprefix("ipc://"))
    assert folder.startswith(os.path.join(os.path.dirname(folder), "paged-llm-kv-"))
    assert not os.path.exists(folder)
