"""A draft model's proposals left on the device (backend/engine/spec_decode/draft_tokens.py):
slices that stay there, the device writes the verifying step makes of them, and the
engine's output with penalties and bad words read through them."""

import pytest
import torch

from backend import LLM, SamplingParams
from backend.engine.runner.buffers import GrowingStagedBuffer
from backend.engine.spec_decode.draft_tokens import DraftTokens, device_fill
from tests.conftest import assert_pool_free, random_prompts
from tests.helpers.checkpoints import make_checkpoint
from tests.helpers.dispatch_count import count_dispatches


def test_slices_stay_on_the_device_until_read():
    base = torch.tensor([5, 6, 7, 8, 9, 10])
    t = DraftTokens(base, 1, 4)                     # 6, 7, 8, 9
    with count_dispatches() as counts:
        head, tail, empty = t[:2], t[2:], t[4:]
        assert (len(t), len(head), len(tail), len(empty), bool(empty)) == (4, 2, 2, 0, False)
    assert counts.num_syncs == 0
    assert (head.start, head.length, tail.start, tail.length) == (1, 2, 3, 2)
    assert head.base is base and tail.base is base
    assert list(t) == [6, 7, 8, 9] and t[1] == 7 and tail == [8, 9] and t[-1:] == [9]
    with pytest.raises(ValueError):
        t[::2]


def test_one_read_serves_every_slice_and_sibling():
    """Bad words read a verification row's proposals back (row j: the first j): every
    slice, and every request's proposals from the same draft step, share one copy."""
    base, read = torch.tensor([5, 6, 7, 8, 9, 10]), [None]
    first, second = DraftTokens(base, 0, 4, read), DraftTokens(base, 4, 2, read)
    with count_dispatches() as counts:
        rows = [list(first[:j]) for j in range(5)] + [list(second[:j]) for j in range(3)]
    assert counts.num_syncs == 1, dict(counts.syncs)
    assert rows == [[], [5], [5, 6], [5, 6, 7], [5, 6, 7, 8], [], [9], [9, 10]]


def test_device_fill_writes_proposals_of_several_draft_steps_without_a_sync():
    """Proposals drawn by two draft steps (a request skipped a step keeps older ones)
    land at their positions; nothing is read back to the host."""
    older, newer = torch.tensor([70, 71, 72]), torch.tensor([10, 11, 12, 13, 14])
    dest = torch.full((12,), -1, dtype=torch.int32)
    entries = [(0, DraftTokens(newer, 2, 3)), (4, DraftTokens(older, 0, 2)), (7, DraftTokens(newer, 0, 0)),
               (9, DraftTokens(newer, 0, 2))]
    staging = GrowingStagedBuffer(torch.int64, torch.device("cpu"))
    with count_dispatches() as counts:
        device_fill(dest, entries, staging)
    assert counts.num_syncs == 0, dict(counts.syncs)
    assert dest.tolist() == [12, 13, 14, -1, 70, 71, -1, -1, -1, 10, 11, -1]
    device_fill(dest, [], staging)                  # nothing to write


@pytest.fixture(scope="module")
def target(ckpt_dir):
    return make_checkpoint(str(ckpt_dir / "llama_repetitive"), "llama", initializer_range=0.05)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_penalties_and_bad_words_read_the_proposals_the_draft_left_on_the_device(target, async_scheduling):
    """Greedy requests with repetition and frequency penalties and two-token bad words:
    the same tokens as without speculation. Their verification rows count proposals they
    have only on the device (penalties) or read them back (a bad word's prefix): a row
    that saw other proposals than the ones verified would draw another token than plain
    decoding does. The draft is the target, so most rows are reached (the draft's second
    and third proposals do not count its first in their own penalties, so a few are
    rejected). The proposals reach the scheduler as DraftTokens."""
    prompts = random_prompts(6, [9, 30, 4, 17, 2, 24], seed=5)
    engine = dict(block_size=4, num_kv_blocks=120, max_num_seqs=8, max_num_batched_tokens=64, dtype="float32")
    params = [SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, repetition_penalty=1.3),
              SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, frequency_penalty=0.8),
              SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)] * 2
    plain = [o.token_ids for o in LLM(target, **engine).generate(prompts, params)]
    # Ban a pair each output made: the requests' second token after its first.
    params = [p.model_copy(update={"bad_words_token_ids": [[out[5], out[6]]]}) if i % 3 == 2 else p
              for i, (p, out) in enumerate(zip(params, plain))]
    plain = [o.token_ids for o in LLM(target, **engine).generate(prompts, params)]
    spec = {"method": "draft_model", "model": target, "num_speculative_tokens": 3}
    llm = LLM(target, speculative_config=spec, async_scheduling=async_scheduling, **engine)
    scheduler, kinds = llm.engine.scheduler, set()
    real = scheduler.set_proposals

    def set_proposals(proposals):
        kinds.update(type(tokens) for tokens, _ in proposals.tokens.values())
        return real(proposals)
    scheduler.set_proposals = set_proposals
    outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == plain
    stats = llm.stats()
    assert kinds == {DraftTokens}
    assert stats["spec_decode_num_draft_tokens"] > 30 and stats["spec_decode_acceptance_rate"] > 0.8, stats
    assert_pool_free(llm)
