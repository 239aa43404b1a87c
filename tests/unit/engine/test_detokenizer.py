"""Streaming text equals decoding all tokens at once: no half UTF-8 characters, no
dropped spaces."""

import pytest

from backend.engine.detokenizer import IncrementalDetokenizer
from backend.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def tokenizer(tiny_ckpt):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(tiny_ckpt)


@pytest.mark.parametrize("text", [
    "Hello world, this is a test of the streaming detokenizer.",
    "ünïcödé 你好 🙂 — multi-byte characters split across byte tokens",
    "  leading spaces and\nnew lines\n\n  indented",
])
def test_stream_concatenation_equals_full_decode(tokenizer, text):
    ids = tokenizer.encode(text)
    prompt, gen = ids[:3], ids[3:]
    d = IncrementalDetokenizer(tokenizer, prompt, SamplingParams())
    pieces = []
    for t in gen:
        d.add_token(t)
        piece = d.take_delta(finished=False)
        assert "\ufffd" not in piece
        pieces.append(piece)
    pieces.append(d.take_delta(finished=True))
    assert "".join(pieces) == tokenizer.decode(gen)


def test_multibyte_character_is_held_until_complete(tokenizer):
    ids = tokenizer.encode("a🙂")
    d = IncrementalDetokenizer(tokenizer, ids[:1], SamplingParams())
    emitted = []
    for t in ids[1:]:
        d.add_token(t)
        emitted.append(d.take_delta(finished=False))
    assert len(ids) > 3  # the emoji really is several byte tokens
    assert emitted[:-1] == [""] * (len(emitted) - 1) and emitted[-1] == "🙂"


def test_stop_string_is_never_streamed_partially(tokenizer):
    text = "one two three STOP four"
    ids = tokenizer.encode(text)
    d = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=["STOP"]))
    streamed = ""
    for t in ids:
        hit = d.add_token(t)
        streamed += d.take_delta(finished=hit is not None)
        if hit:
            break
    assert hit == "STOP"
    assert streamed == "one two three "


def test_without_tokenizer_only_ids():
    d = IncrementalDetokenizer(None, [1, 2], SamplingParams())
    assert d.add_token(5) is None and d.take_delta(True) == ""


@pytest.mark.parametrize("skip_special", [True, False])
def test_fast_decoder_gives_the_wrappers_text(tokenizer, skip_special):
    """The Rust decode the engine calls directly returns what transformers' decode does,
    on random windows (special tokens included) and on a whole streamed output."""
    import random

    from backend.engine.detokenizer import fast_decoder
    fast = fast_decoder(tokenizer)
    assert fast is not None
    rng = random.Random(0)
    vocab = len(tokenizer)
    for _ in range(300):
        ids = [rng.randrange(vocab) for _ in range(rng.randint(1, 7))]
        assert fast(ids, skip_special) == tokenizer.decode(ids, skip_special_tokens=skip_special,
                                                           clean_up_tokenization_spaces=False)
    ids = tokenizer.encode("ünïcödé 你好 🙂 streaming through the fast path")
    params = SamplingParams(skip_special_tokens=skip_special)
    slow, quick = IncrementalDetokenizer(tokenizer, [], params), IncrementalDetokenizer(tokenizer, [], params, fast)
    for t in ids:
        slow.add_token(t)
        quick.add_token(t)
    assert quick.output_text == slow.output_text


def test_no_fast_decoder_without_a_fast_tokenizer():
    from backend.engine.detokenizer import fast_decoder
    assert fast_decoder(None) is None


@pytest.mark.parametrize("text", ["Hello world, streamed with candidates.", "ünïcödé 你好 🙂 byte tokens"])
def test_peeked_candidates_give_each_tokens_text_once(tokenizer, text):
    """A token's logprob candidates are peeked before it is added (the sampled token among
    them): the text and the stream are those without peeks, and adding a peeked token
    decodes nothing more; a candidate peeked before an earlier token was added is not
    reused after it (the window moved)."""
    ids = tokenizer.encode(text)
    plain = IncrementalDetokenizer(tokenizer, ids[:3], SamplingParams())
    calls = []
    peeking = IncrementalDetokenizer(tokenizer, ids[:3], SamplingParams(),
                                     decode=lambda w, skip: calls.append(len(w)) or tokenizer.decode(
                                         w, skip_special_tokens=skip, clean_up_tokenization_spaces=False))
    for t in ids[3:]:
        plain.add_token(t)
        texts = [peeking.peek(c) for c in (t, t + 1, 7)]
        assert texts[0] == peeking.peek(t)              # (asked again: the same)
        before = len(calls)
        peeking.add_token(t)
        assert len(calls) == before                     # its text came from the peek
        assert peeking.output_text == plain.output_text
    assert peeking.take_delta(finished=True) == plain.take_delta(finished=True)
