"""A text prompt is refused for its length before it is tokenized whole
(backend/engine/prompt_length.py): a 16 MB prompt was tokenized in full, 27-46 s, before
the engine refused it (issue 31)."""

import time

import pytest
from transformers import AutoTokenizer

from backend.engine.errors import InvalidRequestError
from backend.engine.prompt_length import CHUNK_CHARS, tokenize_within


@pytest.fixture(scope="module")
def tokenize(tiny_ckpt):
    tok = AutoTokenizer.from_pretrained(tiny_ckpt)
    seen = []

    def counting(text):
        seen.append(len(text))
        return tok.encode(text)
    counting.seen = seen
    return counting


def test_a_16_mb_prompt_is_refused_after_tokenizing_a_bounded_part(tokenize):
    text = "The pass statement does nothing at all. " * (16 * 2**20 // 40)
    tokenize.seen.clear()
    start = time.perf_counter()
    with pytest.raises(InvalidRequestError, match=r"max_model_len is 1024, which must leave room"):
        tokenize_within(tokenize, text, 1024)
    assert time.perf_counter() - start < 2.0
    assert sum(tokenize.seen) <= 1024 * 8 + CHUNK_CHARS     # about max_model_len tokens' worth, not 16 MB


@pytest.mark.parametrize("words", [10, 3000, 6000])
def test_a_prompt_that_fits_gets_the_tokenizers_own_ids(tokenize, words):
    """Below max_model_len nothing is refused (chunk counts run a little high: BOS, cuts)
    and the ids are those of the whole text, chunked or not."""
    text = " ".join(f"w{i % 97}" for i in range(words))
    whole = tokenize(text)
    assert tokenize_within(tokenize, text, len(whole) + 1) == whole
