"""A prefill engine in a child process (spawned), for tests that kill it: it computes one
prompt, sends the decode side its handoff parameters, and waits to be killed."""

from __future__ import annotations

import time


def prefill_then_wait(checkpoint: str, prompt: list[int], conn) -> None:
    from backend.config import EngineArgs
    from backend.engine.engine_loop import EngineLoop
    from backend.engine.kv_transfer.disagg import KVSender, transport_for
    from backend.engine.llm_engine import LLMEngine
    from backend.sampling_params import SamplingParams
    loop = EngineLoop(LLMEngine(EngineArgs(model=checkpoint, num_kv_blocks=64, max_model_len=512))).start()
    sender = KVSender(loop, transport_for(loop, "doomed-prefill"))
    params = KVSender.prefill_params(SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    out = list(loop.add_request(prompt, params, "doomed"))[-1]
    conn.send(sender.handoff_params("doomed", out))
    time.sleep(600)
