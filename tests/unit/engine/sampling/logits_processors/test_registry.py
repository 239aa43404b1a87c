"""What every registered logits processor promises (base.py): its parameter is a field
of SamplingParams and of the OpenAI request models, with one name each; its default
leaves every distribution unchanged bit for bit; its profile value turns it on."""

import pytest
import torch

from backend.engine.sampling.logits_processors import PROCESSORS
from backend.sampling_params import SamplingParams, _CoreSamplingParams
from frontend.openai_api.protocol import ChatCompletionRequest, CompletionRequest, _CommonFields

NAMES = [p.name for p in PROCESSORS]


def test_names_are_unique_and_new():
    assert len(set(NAMES)) == len(NAMES)
    assert not set(NAMES) & set(_CoreSamplingParams.model_fields)
    assert not set(NAMES) & set(_CommonFields.model_fields)


@pytest.mark.parametrize("processor", PROCESSORS, ids=NAMES)
def test_parameter_reaches_every_request_model(processor):
    for model in (SamplingParams, CompletionRequest, ChatCompletionRequest):
        field = model.model_fields[processor.name]
        assert field.default == processor.neutral, model.__name__
    assert getattr(SamplingParams(), processor.name) == processor.neutral
    assert getattr(SamplingParams(**{processor.name: processor.profile_value}), processor.name) \
        == processor.profile_value


@pytest.mark.parametrize("processor", PROCESSORS, ids=NAMES)
def test_neutral_rows_unchanged_and_the_profile_value_acts(processor):
    g = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(6, 64, generator=g) * 3, dim=-1)
    probs[:, :5] = 0.0                                  # tokens an earlier step dropped
    values = torch.full((6, 1), processor.neutral)
    values[3] = processor.profile_value
    out = processor.apply(probs.clone(), values)
    keep = torch.arange(6) != 3
    assert torch.equal(out[keep], probs[keep])
    assert not processor.is_on(processor.neutral) and processor.is_on(processor.profile_value)
    assert (out[3] == 0).sum() > (probs[3] == 0).sum(), "the profile value drops no token"
    assert (out[3] > 0).any()
