"""Prefill/decode disaggregation between two real engines in this process, their
blocks copied over NIXL (UCX, host memory): greedy tokens equal one aggregated engine's
with chunked prefill on both sides, prefix hits on the decode side and preemption
there; a failed copy falls back to computing the prompt; kept blocks are released by
the decode side's notification or expire; every pool ends free."""

import os
import time

import pytest
import torch

from backend.config import EngineArgs
from backend.engine.engine_loop import EngineLoop
from backend.engine.kv_transfer.disagg import KVReceiver, KVSender, _signature, transport_for
from backend.engine.llm_engine import LLMEngine
from backend.sampling_params import SamplingParams
from tests.conftest import assert_pool_free, random_prompts


def _need_nixl():
    try:
        from backend.engine.kv_transfer.nixl_transport import _nixl
        _nixl()
    except ImportError:
        if os.environ.get("CI"):
            pytest.fail("nixl-cu12 is not installed (`make dynamo` installs it)")
        pytest.skip("nixl-cu12 is not installed (`make dynamo` installs it)")


GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def engines(tiny_ckpt):
    _need_nixl()
    # Chunked prefill on both sides (64-token steps, prompts of up to 200); the decode
    # engine's pool is small enough to preempt under a batch.
    def make(num_kv_blocks):
        return EngineLoop(LLMEngine(EngineArgs(model=tiny_ckpt, num_kv_blocks=num_kv_blocks, max_model_len=512,
                                               max_num_batched_tokens=64, max_num_seqs=8))).start()
    prefill, decode, reference = make(96), make(48), make(96)
    sender = KVSender(prefill, transport_for(prefill, "test-prefill"))
    receiver = KVReceiver(decode, transport_for(decode, "test-decode"), timeout_s=5.0)
    yield prefill, decode, reference, sender, receiver
    sender.stop()
    for loop in (prefill, decode, reference):
        loop.stop()


def run(loop, prompt, params, request_id):
    return list(loop.add_request(prompt, params, request_id))[-1]


def disaggregated(engines, prompt, request_id, params=GREEDY):
    prefill, decode, _, sender, receiver = engines
    out = run(prefill, prompt, KVSender.prefill_params(params), f"{request_id}-p")
    kv = sender.handoff_params(f"{request_id}-p", out)
    assert len(kv["remote_block_ids"]) == len(prompt) // 16        # (every full block it computed)
    return kv, receiver.receive(prompt, params, kv)


def same_bytes(a, b) -> int:
    """How many blocks both engines cache under one hash; fails unless each holds equal
    K/V bytes in both (every layer)."""
    def snapshot(loop):
        return loop.call(lambda: {h: blk.block_id for h, blk in loop.engine.kv_cache.pool.cached.items()
                                  if not blk.pending}).result()
    mine, theirs = snapshot(a), snapshot(b)
    common = mine.keys() & theirs.keys()
    for h in common:
        for la, lb in zip(a.engine.runner.kv_caches, b.engine.runner.kv_caches):
            assert torch.equal(la.key[mine[h]], lb.key[theirs[h]]) and torch.equal(la.value[mine[h]],
                                                                                   lb.value[theirs[h]])
    return len(common)


def wait_free(*loops, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    for loop in loops:
        while loop.engine.stats()["num_used_blocks"] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert_pool_free(loop.engine)


def test_greedy_tokens_equal_one_aggregated_engine_and_the_blocks_are_the_prefill_engines(engines):
    prefill, decode, reference, _, _ = engines
    for i, prompt in enumerate(random_prompts(3, [150, 200, 97], vocab=300, seed=1)):
        kv, copied = disaggregated(engines, prompt, f"a{i}")
        assert copied == len(kv["remote_block_ids"]) > 0
        # The decode engine caches the same blocks (by hash), holding the prefill engine's bytes.
        assert decode.call(lambda p=prompt: decode.engine.reserve_import(p, GREEDY, 99)).result() is None
        assert same_bytes(prefill, decode) >= copied
        got = run(decode, prompt, GREEDY, f"a{i}-d")
        want = run(reference, prompt, GREEDY, f"a{i}-r")
        assert got.token_ids == want.token_ids
        assert got.num_cached_tokens == copied * 16
    wait_free(prefill, decode, reference)


def test_blocks_the_decode_engine_has_are_not_copied_again(engines):
    _, decode, reference, _, _ = engines
    shared = random_prompts(1, [128], vocab=300, seed=7)[0]
    first, second = shared + [5, 6, 7], shared + [9, 10, 11] + random_prompts(1, [40], seed=8)[0]
    _, copied_first = disaggregated(engines, first, "p0")
    assert run(decode, first, GREEDY, "p0-d").token_ids == run(reference, first, GREEDY, "p0-r").token_ids
    _, copied_second = disaggregated(engines, second, "p1")
    assert copied_first == 8 and copied_second == 2        # the shared 8 blocks were there already
    got = run(decode, second, GREEDY, "p1-d")
    assert got.token_ids == run(reference, second, GREEDY, "p1-r").token_ids
    assert got.num_cached_tokens == 10 * 16
    wait_free(*engines[:3])


def test_under_preemption_on_the_decode_engine_tokens_stay_equal(engines):
    _, decode, reference, _, _ = engines
    prompts = random_prompts(6, [120, 90, 150], vocab=300, seed=3)
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        disaggregated(engines, prompt, f"b{i}", params)
    before = decode.engine.stats()["num_preemptions"]
    streams = [decode.add_request(p, params, f"b{i}-d") for i, p in enumerate(prompts)]
    got = [list(s)[-1].token_ids for s in streams]
    assert decode.engine.stats()["num_preemptions"] > before       # 48 blocks for 6 x ~12
    assert got == [run(reference, p, params, f"b{i}-r").token_ids for i, p in enumerate(prompts)]
    wait_free(*engines[:3])


def test_a_failed_copy_computes_the_prompt_here_and_nothing_leaks(engines):
    prefill, decode, reference, sender, receiver = engines
    prompt = random_prompts(1, [150], vocab=300, seed=11)[0]
    out = run(prefill, prompt, KVSender.prefill_params(GREEDY), "c-p")
    kv = sender.handoff_params("c-p", out)
    # A prefill engine that is not there (its agent unknown): the copy fails at once, and
    # no one can tell it to let its blocks go.
    gone = {**kv, "engine_id": "nobody", "agent_metadata": "bm90IG1ldGFkYXRh"}
    assert receiver.receive(prompt, GREEDY, gone) == 0
    assert "c-p" in prefill.engine.handoff.held
    # The same handoff again (even with another layout): refused, a handoff is read once.
    assert receiver.receive(prompt, GREEDY, {**kv, "layout": "something else"}) == 0
    # A cache of another layout: refused before any copy; the prefill engine is told.
    out = run(prefill, prompt, KVSender.prefill_params(GREEDY), "c2-p")
    assert receiver.receive(prompt, GREEDY, {**sender.handoff_params("c2-p", out), "layout": "something else"}) == 0
    prefill.call(lambda: prefill.engine.handoff.expire(float("inf"))).result()     # (the first: nobody told)
    got = run(decode, prompt, GREEDY, "c-d")
    assert got.token_ids == run(reference, prompt, GREEDY, "c-r").token_ids and got.num_cached_tokens == 0
    wait_free(prefill, decode, reference)
    # Blocks no decode engine claims expire.
    run(prefill, prompt, KVSender.prefill_params(GREEDY), "e-p")
    assert prefill.engine.stats()["kv_handoff_held_requests"] == 1
    prefill.call(lambda: prefill.engine.handoff.expire(float("inf"))).result()
    assert prefill.engine.stats()["kv_handoff_expired"] >= 1
    wait_free(prefill)


def test_a_prompt_under_one_block_is_computed_by_the_decode_engine(engines):
    prefill, decode, reference, sender, receiver = engines
    prompt = random_prompts(1, [12], vocab=300, seed=13)[0]
    out = run(prefill, prompt, KVSender.prefill_params(GREEDY), "s-p")
    kv = sender.handoff_params("s-p", out)
    assert kv["remote_block_ids"] == [] and kv["do_remote_prefill"]
    assert receiver.receive(prompt, GREEDY, kv) == 0
    assert run(decode, prompt, GREEDY, "s-d").token_ids == run(reference, prompt, GREEDY, "s-r").token_ids
    wait_free(prefill, decode, reference)


def test_kept_blocks_wait_for_the_decode_engines_notification(engines):
    prefill, _, _, sender, _ = engines
    prompt = random_prompts(1, [100], vocab=300, seed=12)[0]
    released = sender.num_released
    kv, copied = disaggregated(engines, prompt, "d")
    assert copied == 6
    deadline = time.monotonic() + 5
    while sender.num_released == released and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sender.num_released == released + 1
    wait_free(prefill)


def test_a_prefill_engine_that_died_leaves_the_prompt_to_the_decode_engine(engines, tiny_ckpt):
    """The prefill engine (another process) computed the prompt, then died before the
    decode engine read its blocks: the read fails within the receiver's time limit and
    the decode engine computes the prompt itself."""
    import multiprocessing
    from tests.helpers.disagg_child import prefill_then_wait
    _, decode, reference, _, receiver = engines
    prompt = random_prompts(1, [140], vocab=300, seed=21)[0]
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    process = ctx.Process(target=prefill_then_wait, args=(tiny_ckpt, prompt, child), daemon=True)
    process.start()
    try:
        assert parent.poll(120), "the prefill engine did not answer"
        kv = parent.recv()
    finally:
        process.kill()
        process.join()
    assert kv is not None and len(kv["remote_block_ids"]) == 8
    fallbacks = receiver.num_fallbacks
    start = time.monotonic()
    assert receiver.receive(prompt, GREEDY, kv) == 0
    assert time.monotonic() - start < receiver.timeout_s + 5
    assert receiver.num_fallbacks == fallbacks + 1
    got = run(decode, prompt, GREEDY, "f-d")
    assert got.token_ids == run(reference, prompt, GREEDY, "f-r").token_ids and got.num_cached_tokens == 0
    wait_free(decode, reference)


def test_a_signed_deployment_reads_only_signed_unexpired_handoffs(engines, monkeypatch):
    """With PAGED_LLM_KV_TRANSFER_KEY's secret on both sides, a handoff is read only if its
    signature holds and its blocks are kept long enough; else the prompt is computed here."""
    prefill, decode, reference, signer, _ = engines
    monkeypatch.setattr(signer, "secret", b"k1")
    checker = KVReceiver(decode, engines[4].transport, timeout_s=5.0, secret=b"k1")
    prompt = random_prompts(1, [100], vocab=300, seed=31)[0]
    out = run(prefill, prompt, KVSender.prefill_params(GREEDY), "g-p")
    kv = signer.handoff_params("g-p", out)
    assert checker.receive(prompt, GREEDY, {**kv, "bases": [b + 16 for b in kv["bases"]]}) == 0     # tampered
    assert checker.receive(prompt, GREEDY, {**kv, "signature": "0" * 64}) == 0
    late = {**kv, "expires_at": kv["expires_at"] - 3600}
    late["signature"] = _signature(late, b"k1")
    assert checker.receive(prompt, GREEDY, late) == 0                                               # expired
    other = random_prompts(1, [100], vocab=300, seed=32)[0]
    assert checker.receive(other, GREEDY, kv) == 0              # signed, but for another prompt
    assert checker.num_fallbacks == 4
    assert checker.receive(prompt, GREEDY, kv) == 6
    assert checker.receive(prompt, GREEDY, kv) == 0             # read once
    got = run(decode, prompt, GREEDY, "g-d")
    assert got.token_ids == run(reference, prompt, GREEDY, "g-r").token_ids and got.num_cached_tokens == 96
    prefill.call(lambda: prefill.engine.handoff.expire(float("inf"))).result()
    wait_free(prefill, decode, reference)
