"""The batch the random-head tests share (tests/helpers/spec_batch.py) and its reference:
transformers' greedy tokens from each module's own `target` checkpoint. A module that
defines `prompts` or `reference` itself uses its own."""

import pytest

from tests.helpers.checkpoints import hf_greedy
from tests.helpers.spec_batch import MAX_NEW, spec_prompts


@pytest.fixture(scope="module")
def prompts():
    return spec_prompts()


@pytest.fixture(scope="module")
def reference(target, prompts):
    return hf_greedy(target, prompts, MAX_NEW)
