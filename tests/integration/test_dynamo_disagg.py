"""Prefill/decode disaggregation under NVIDIA Dynamo. Starts real processes on loopback:
NATS and etcd (Debian's packages), one of our prefill workers and one decode worker
(`python -m backend.dynamo_worker --disaggregation-mode prefill|decode`), whose KV
blocks move over NIXL (UCX, host memory), and Dynamo's frontend in front of them. Both
workers chunk their prefills (64-token steps); the decode worker's pool is small
enough to preempt. The official `openai` client talks to the frontend. No tritonserver.
"""

from __future__ import annotations

import os
import signal
from concurrent.futures import ThreadPoolExecutor

import pytest

from clients.dynamo_local import models_listed, start_frontend, start_services, start_worker
from tests.helpers.dynamo_services import exit_report, greedy, offline, require_services  # noqa: F401
from tests.integration.conftest import build_repo

pytestmark = pytest.mark.timeout(600)

# Prompts the trained reference model continues with text (documentation-like prose),
# each a few full blocks long.
PROMPTS = [
    "The with statement is used to wrap the execution of a block with methods defined by a context manager. "
    "This allows common try, except and finally usage patterns to be encapsulated. The with statement",
    "A module is a file containing Python definitions and statements. The file name is the module name with "
    "the suffix .py appended. Within a module, the module's name is available as the value of",
    "Lists are mutable sequences, typically used to store collections of homogeneous items. Lists may be "
    "constructed in several ways: using a pair of square brackets to denote the empty list, using",
    "The for statement is used to iterate over the elements of a sequence (such as a string, tuple or list) "
    "or other iterable object. The expression list is evaluated once; it should yield",
]


# Tests that ran in this module (the decode worker's counters are read when it stops, last).
RAN: set[str] = set()


class Disaggregated:
    def __init__(self, stack, prefill, decode, frontend):
        self.stack, self.prefill, self.decode, self.frontend = stack, prefill, decode, frontend

    def client(self, timeout_s: float = 120):
        import openai
        return openai.OpenAI(base_url=f"http://127.0.0.1:{self.frontend.port}/v1", api_key="none", max_retries=0,
                             timeout=timeout_s)


@pytest.fixture(scope="module")
def disaggregated(tmp_path_factory, trained_ckpt):
    require_services()
    root = tmp_path_factory.mktemp("disagg")
    # One model, two entries: the decode worker's pool holds 24 blocks (preemption under a
    # batch); the layout (block size, dtype) is the same, so blocks mean the same bytes.
    repo = build_repo(root / "repo", trained_ckpt, num_kv_blocks=192, max_model_len=1024,
                      max_num_batched_tokens=64)
    build_repo(root / "repo", trained_ckpt, output=str(root / "repo" / "decode"), name="decode",
               num_kv_blocks=24, max_model_len=384, max_num_batched_tokens=64)
    stack = start_services(str(root))
    try:
        prefill = start_worker(stack, "prefill", repo, "llm", "prefill")
        decode = start_worker(stack, "decode", repo, "decode", "decode", served_model_name="llm")
        frontend = start_frontend(stack, "frontend", "kv")
        stack.wait_for(lambda: models_listed(frontend.port, "llm"), "the frontend lists llm")
        stack.wait_for(lambda: "serving llm" in prefill.log() and "serving llm" in decode.log(), "both workers")
        yield Disaggregated(stack, prefill, decode, frontend)
    finally:
        stack.stop_all()


def test_greedy_text_equals_one_engine_and_the_prompt_came_over_nixl(disaggregated, offline):
    client = disaggregated.client()
    for prompt in PROMPTS:
        got = client.completions.create(model="llm", prompt=prompt, max_tokens=24, temperature=0)
        want = greedy(offline, prompt, 24)
        assert got.choices[0].text == want.text, prompt
        assert got.usage.completion_tokens == len(want.token_ids)
        # The decode worker's prompt was served from blocks the prefill worker computed.
        assert got.usage.prompt_tokens_details.cached_tokens >= 16 * ((len(want.prompt_token_ids) - 1) // 16)
    # A prompt under one block: nothing to hand over; the decode worker computes it.
    got = client.completions.create(model="llm", prompt="The with statement", max_tokens=16, temperature=0)
    assert got.choices[0].text == greedy(offline, "The with statement", 16).text
    # A prompt that extends one already sent: the decode worker has its first blocks.
    longer = PROMPTS[0] + " a context manager's enter method"
    got = client.completions.create(model="llm", prompt=longer, max_tokens=16, temperature=0)
    assert got.choices[0].text == greedy(offline, longer, 16).text


def test_under_preemption_on_the_decode_worker_text_stays_equal(disaggregated, offline):
    client = disaggregated.client()
    prompts = [f"In the reference manual, part {i}. {p}" for i, p in enumerate(PROMPTS)]    # (new to both)

    def ask(prompt):
        return client.completions.create(model="llm", prompt=prompt, max_tokens=80, temperature=0,
                                         extra_body={"ignore_eos": True}).choices[0].text
    with ThreadPoolExecutor(len(prompts)) as pool:
        got = list(pool.map(ask, prompts))
    assert got == [greedy(offline, p, 80, ignore_eos=True).text for p in prompts]
    RAN.add("preemption")       # (its preemptions are counted when the decode worker stops)


def test_a_prefill_worker_killed_mid_transfer_fails_nothing_and_nothing_leaks(disaggregated):
    """Requests in flight when the prefill worker dies end (an answer, or Dynamo's clear
    error) within their time; none hangs. The decode worker ends with its pool free."""
    import openai
    client = disaggregated.client(timeout_s=90)
    first = client.completions.create(model="llm", prompt="Before the failure. " + PROMPTS[1], max_tokens=4,
                                      temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens > 0          # (its blocks came over NIXL)
    prompts = [f"Variant {i}: {p}" for i, p in enumerate(PROMPTS * 3)]       # (no worker has seen them)

    def ask(prompt):
        try:
            return client.completions.create(model="llm", prompt=prompt, max_tokens=16, temperature=0).choices[0].text
        except openai.APIStatusError as e:
            assert e.status_code >= 400 and str(e)
            return e
    with ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(ask, p) for p in prompts]
        os.kill(disaggregated.prefill.process.pid, signal.SIGKILL)
        outcomes = [f.result(timeout=120) for f in futures]     # (a hang fails here)
    assert len(outcomes) == len(prompts)
    disaggregated.decode.stop()
    report = exit_report(disaggregated.decode.log())
    assert report["used"] == 0
    assert report["received"] > 0
    if "preemption" in RAN:
        assert report["preemptions"] > 0
