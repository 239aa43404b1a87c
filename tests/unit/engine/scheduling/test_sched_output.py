"""The typed step (backend/engine/scheduling/sched_output.py) alone: a scheduled
request's share read from its Request, how many proposals a step rejected, a step that
changes nothing, and the step as the other ranks get it (for_ranks: plain values only,
expanded back to the same shares; nothing of the scheduler's own)."""

import dataclasses

import pytest
import torch

from backend.engine.request import Request
from backend.engine.scheduling.sched_output import NewRequestData, ScheduledRequest, SchedulerOutput
from backend.engine.spec_decode.draft_tokens import DraftTokens
from backend.sampling_params import SamplingParams


def request(rid: str = "a", prompt=(1, 2, 3, 4, 5), computed: int = 0) -> Request:
    r = Request(request_id=rid, prompt_token_ids=list(prompt), sampling_params=SamplingParams(max_tokens=4, seed=7),
                arrival_time=0.0, max_tokens=4)
    r.num_computed_tokens = computed
    return r


def test_a_share_is_read_from_its_request():
    r = request(computed=2)
    chunk = ScheduledRequest(r, 2)                  # tokens 2..3 of 5: the prompt goes on
    assert (chunk.request_id, chunk.num_computed_tokens, chunk.completes_prompt) == ("a", 2, False)
    assert ScheduledRequest(r, 3).completes_prompt
    assert ScheduledRequest(None, 3, request_id="b").request_id == "b"      # (a runner's test: no request)


@pytest.mark.parametrize("proposed, new_tokens, rejected", [
    ([7, 8, 9], [7, 8, 9, 10], 0),                  # all accepted, and the target's next
    ([7, 8, 9], [7, 5], 2),                         # the second missed
    ([7, 8, 9], [], 0),                             # (a row that sampled nothing)
    ([], [4], 0),
])
def test_rejected_among_the_new_tokens(proposed, new_tokens, rejected):
    assert ScheduledRequest(None, 1 + len(proposed), proposed).rejected_among(new_tokens) == rejected


def test_a_step_that_changes_nothing():
    assert SchedulerOutput().changes_nothing
    for change in (dict(finished_req_ids=["a"]), dict(preempted_req_ids=["a"]), dict(other_block_diffs={"a": (0, [1])}),
                   dict(scheduled=[ScheduledRequest(None, 1, request_id="a")])):
        assert not SchedulerOutput(**change).changes_nothing


def test_the_step_for_the_ranks_holds_plain_values_and_expands_to_the_same_shares():
    r = request(computed=0)
    step = SchedulerOutput.first_step([ScheduledRequest(r, 5, block_ids_start=0, new_block_ids=[3, 4],
                                                        prompt_logprob_start=1, num_prompt_logprob_rows=3)],
                                      finished_req_ids=["z"], other_block_diffs={"b": (2, [9])})
    step.scheduled[0].draft_probs = torch.zeros(1)
    sent = step.for_ranks()
    # No Request, no device tensor, no sampling settings: the rank never samples.
    assert all(not isinstance(v, (Request, torch.Tensor)) for row in sent.scheduled for v in row)
    (new,) = sent.new_requests
    assert (new.sampling_params, new.sampling_row, new.bad_words, new.mm_inputs) == (None, None, None, None)
    assert new.prompt_token_ids == [1, 2, 3, 4, 5] and new.request_id == "a"
    back = sent.step()
    mine = dataclasses.replace(step.scheduled[0], request=None, draft_probs=None)
    assert back.scheduled == [mine]
    assert (back.finished_req_ids, back.other_block_diffs) == (["z"], {"b": (2, [9])})


def test_proposals_on_the_device_cannot_go_to_the_ranks():
    share = ScheduledRequest(None, 3, DraftTokens(torch.zeros(4, dtype=torch.int64), 0, 2), request_id="a")
    with pytest.raises(ValueError, match="on the device"):
        SchedulerOutput([share]).for_ranks()


def test_new_request_data_copies_the_output_it_is_sent_with():
    r = request()
    r.output_token_ids = [9]
    new = NewRequestData.of(r, resumed=True)
    r.output_token_ids.append(10)
    assert new.output_token_ids == [9] and new.resumed and new.prompt_token_ids is r.prompt_token_ids
