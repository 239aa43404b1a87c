"""backend/engine/spec_decode/draft_model.py's draw: rows no token processor changes and
that draw greedily take the logits' argmax without the sampler's per-row preparation;
any other row goes through the sampler (the engine-level exactness of drafting:
test_speculative_engine.py)."""

from types import SimpleNamespace

import torch

from backend.engine.sampling.sampling_row import SamplingRow
from backend.engine.spec_decode.draft_model import draw_proposals, plain_greedy
from backend.sampling_params import SamplingParams

V = 8


def _row(**params):
    return SimpleNamespace(sampling_row=SamplingRow.of(SamplingParams(**params), [2], V))


class _Sampler:
    """Records what reached it; draws token 5 for every row."""

    def __init__(self):
        self.prepared = []

    def prepare(self, requests, vocab_size):
        self.prepared.append(len(requests))
        return None

    def sample_with_distributions(self, logits, batch):
        return torch.full((logits.shape[0],), 5), None


def test_which_rows_draw_the_argmax_directly():
    assert plain_greedy(_row(temperature=0), V)
    assert plain_greedy(_row(temperature=0, ignore_eos=True), V)
    assert not plain_greedy(_row(temperature=0.7), V)                        # sampled
    assert not plain_greedy(_row(temperature=0, repetition_penalty=1.3), V)  # a token processor
    assert not plain_greedy(_row(temperature=0, min_tokens=3), V)            # EOS masked for a while
    assert not plain_greedy(_row(temperature=0, logit_bias={3: 5.0}), V)
    assert not plain_greedy(_row(temperature=0), V + 1)                      # another vocabulary's row
    assert not plain_greedy(SimpleNamespace(sampling_row=None), V)


def test_plain_greedy_rows_skip_the_sampler_and_others_use_it():
    logits = torch.randn(3, V + 4)          # (a drafter's padded vocabulary: never past V)
    logits[:, V:] = 100.0
    sampler = _Sampler()
    tokens, probs = draw_proposals(sampler, logits, [_row(temperature=0)] * 3, V)
    assert tokens.tolist() == logits[:, :V].argmax(-1).tolist() and probs is None and sampler.prepared == []
    tokens, _ = draw_proposals(sampler, logits, [_row(temperature=0), _row(temperature=0, presence_penalty=1.0),
                                                 _row(temperature=0)], V)
    assert tokens.tolist() == [5, 5, 5] and sampler.prepared == [3]
