"""Bad words (backend/engine/sampling/bad_words.py): vLLM's tokenization on the request side, the
sampler's masking (a one-token word always, a longer word's last token when the output
ends with the rest of it, nothing when it does not or only the prompt does), with async
scheduling on and off and under speculative decoding; errors that name the field; and
greedy generations of the default model that never contain the banned words and are
unchanged up to the first masked position."""

import pytest
import torch

from backend import LLM, SamplingParams
from backend.engine.sampling.bad_words import BadWords, resolve, tokenize_words
from backend.engine.errors import InvalidRequestError
from backend.engine.runner.request_state import RequestState
from backend.engine.sampling.sampler import Sampler
from backend.engine.spec_decode.rejection_sampler import VerifyRow
from tests.conftest import assert_pool_free
from tests.helpers.sampling import sample_ids

ENGINE = dict(block_size=8, num_kv_blocks=128, max_num_seqs=8, max_num_batched_tokens=64, dtype="float32")


def req(sequences, out=(), prompt=(1,), temperature=0.0) -> RequestState:
    """A runner state with the banned sequences, as intake resolves them from the
    request's bad_words_token_ids."""
    params = SamplingParams(temperature=temperature, bad_words_token_ids=[list(s) for s in sequences] or None)
    r = RequestState(request_id="r", prompt_token_ids=list(prompt), sampling_params=params, max_tokens=100,
                     bad_words=BadWords.from_sequences(sequences) if sequences else None)
    r.output_token_ids = list(out)
    return r


# ------------------------------------------------------------------ the sampler
LOGITS = torch.tensor([[0.0, 5.0, 4.0, 3.0, 2.0, 1.0]])       # greedy: 1, then 2, then 3


def test_single_token_word_is_masked_at_every_step():
    assert sample_ids(Sampler(), LOGITS, [req([[1]])]) == [2]
    assert sample_ids(Sampler(), LOGITS, [req([[1]], out=[4, 4, 4])]) == [2]
    assert sample_ids(Sampler(), LOGITS, [req([[1], [2]])]) == [3]
    assert sample_ids(Sampler(), LOGITS, [req([])]) == [1]


def test_multi_token_word_masks_its_last_token_only_after_its_prefix():
    word = [[4, 5, 1]]
    assert sample_ids(Sampler(), LOGITS, [req(word, out=[3, 4, 5])]) == [2]       # prefix 4 5 just generated
    assert sample_ids(Sampler(), LOGITS, [req(word, out=[4, 5, 3])]) == [1]       # not the last tokens
    assert sample_ids(Sampler(), LOGITS, [req(word, out=[5])]) == [1]            # a shorter output
    assert sample_ids(Sampler(), LOGITS, [req(word, out=[3, 5])]) == [1]         # half the prefix
    # As vLLM: only generated tokens count, a prefix in the prompt bans nothing.
    assert sample_ids(Sampler(), LOGITS, [req(word, out=[5], prompt=[4])]) == [1]
    assert sample_ids(Sampler(), LOGITS, [req(word, out=[], prompt=[4, 5])]) == [1]


def test_each_row_is_masked_by_its_own_words_and_output_in_one_batch():
    logits = LOGITS.repeat(4, 1)
    rows = [req([[1]], out=[2]), req([[2, 1]], out=[2]), req([[2, 1]], out=[3]), req([], out=[2])]
    assert sample_ids(Sampler(), logits, rows) == [2, 2, 1, 1]
    sampled = req([[1], [2], [3], [4], [5]], temperature=1.0)       # only token 0 is left to draw
    assert sample_ids(Sampler(), logits[:2], rows[:1] + [sampled]) == [2, 0]


def test_a_verification_row_counts_its_proposals_as_output():
    base = req([[4, 5, 1], [3, 2]], out=[9, 4])
    assert VerifyRow(base, [5]).output_tail(2) == [4, 5] and VerifyRow(base, [7, 5, 3]).output_tail(2) == [5, 3]
    assert VerifyRow(base, []).output_tail(5) == [9, 4] and base.output_tail(1) == [4]
    assert sample_ids(Sampler(), LOGITS.repeat(3, 1), [base, VerifyRow(base, [5]), VerifyRow(base, [5, 3])]) == [
        1, 2, 1]
    assert sample_ids(Sampler(), LOGITS, [VerifyRow(req([[3, 1]], out=[9]), [3])]) == [2]


# --------------------------------------------------------- the request side
def _encoder(table):
    return lambda text: list(table[text])


def test_words_are_tokenized_bare_and_after_a_space_as_vllm():
    encode = _encoder({"cat": [5], " cat": [6], "big dog": [7, 8], " big dog": [9, 8], "same": [3], " same": [3],
                       "language": [1, 2], " language": [4], "x": [10], " x": [11, 10]})
    assert tokenize_words(["cat", "  big dog", "same"], encode) == [[5], [6], [7, 8], [9, 8], [3]]
    # vLLM keeps the spaced form only at equal length (its issue 32557): here it is kept, so
    # " language", one token, is banned as well.
    assert tokenize_words(["language"], encode) == [[1, 2], [4]]
    assert tokenize_words(["x"], encode) == [[10], [11, 10]]
    with pytest.raises(InvalidRequestError, match="'bad_words': word 0 .* no tokens"):
        tokenize_words(["cat"], lambda text: [])
    with pytest.raises(InvalidRequestError, match="'bad_words' has too many words"):
        tokenize_words([f"w{i}" for i in range(65)], lambda text: [len(text), len(text) + 1])


class _Tok:
    def encode(self, text, add_special_tokens=True):
        assert not add_special_tokens
        return [ord(c) % 50 for c in text]


def test_resolve_checks_the_limits_and_the_vocabulary():
    bw = resolve(SamplingParams(bad_words=["ab"], bad_words_token_ids=[[7], [8, 9]]), _Tok(), 100)
    assert bw.always == (7,) and set(bw.prefixed) == {((47,), 48), ((32, 47), 48), ((8,), 9)}
    assert bw.longest_prefix == 2
    assert resolve(SamplingParams(), _Tok(), 100) is None
    with pytest.raises(InvalidRequestError, match="'bad_words_token_ids' .*bad_words_list.*: token id 100 is outside"):
        resolve(SamplingParams(bad_words_token_ids=[[100]]), _Tok(), 100)
    with pytest.raises(InvalidRequestError, match="'bad_words_token_ids' .* has 1025 tokens in all, more than 1024"):
        resolve(SamplingParams(bad_words_token_ids=[[1] * 1025]), _Tok(), 100)
    with pytest.raises(InvalidRequestError, match="'bad_words' needs the checkpoint's tokenizer"):
        resolve(SamplingParams(bad_words=["x"]), None, 100)


@pytest.mark.parametrize("params, match", [
    (dict(bad_words="cat"), "'bad_words'"), (dict(bad_words=["cat", ""]), "'bad_words'.*non-empty"),
    (dict(bad_words=["  "]), "'bad_words'"), (dict(bad_words=[7]), "'bad_words.0'"),
    (dict(bad_words=["ok", "\ud800"]), "'bad_words'.*surrogate"),
    (dict(bad_words=["w"] * 129), "'bad_words'.*more than 128"), (dict(bad_words=["w" * 20000]), "'bad_words'"),
    (dict(bad_words_token_ids=[[]]), "'bad_words_token_ids'"),
    (dict(bad_words_token_ids=[[-1]]), "'bad_words_token_ids'"),
])
def test_bad_values_name_the_field(params, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams.create(**params)


# ------------------------------------------------------------------ the engine
def _banned_at(tokens: list[int], sequences: list[list[int]]) -> int:
    """The first position whose token completes a banned sequence within the output, or -1."""
    for k in range(len(tokens)):
        for s in sequences:
            if len(s) <= k + 1 and tokens[k + 1 - len(s):k + 1] == s:
                return k
    return -1


@pytest.fixture(scope="module")
def baseline(tiny_ckpt):
    """Greedy generations of the default model without bad words, and the words to ban
    found in them: per prompt, one word of one token and one of several."""
    llm = LLM(tiny_ckpt, **ENGINE)
    prompts = ["The quick brown fox", "1, 2, 3,", "Hello", "Once upon a time", "JSON:", "The end"]
    outs = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0))]
    encode = lambda text: llm.tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    words: list[str] = []               # one word of one token from each of the first three outputs,
    for i, ids in enumerate(outs):      # one of two or three from each of the others
        for k in range(len(ids)):
            n = 1 if i < 3 else 2 + k % 2
            word = llm.tokenizer.decode(ids[k:k + n]).strip()
            if (k + n <= len(ids) and len(word) > 3 and word.isalpha() and ids[k:k + n] in tokenize_words(
                    [word], encode) and not any(word in w or w in word for w in words)):
                words.append(word)
                break
    assert len(words) == len(prompts), words
    return llm, prompts, outs, words


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_greedy_generations_never_contain_the_banned_words(tiny_ckpt, baseline, async_scheduling):
    _, prompts, base, words = baseline
    llm = LLM(tiny_ckpt, async_scheduling=async_scheduling, **ENGINE)
    encode = lambda text: llm.tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    sequences = tokenize_words(words, encode)
    outs = llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0, bad_words=words))
    masked_after_prefix = 0
    for want, out in zip(base, outs):
        got = out.token_ids
        assert _banned_at(got, sequences) == -1 and not any(w in out.text for w in words), (words, out.text)
        k = _banned_at(want, sequences)
        assert k >= 0                               # each output had a word
        assert got[:k] == want[:k] and got[k] != want[k]
        masked_after_prefix += all(want[k] not in s or len(s) > 1 for s in sequences)
    assert masked_after_prefix >= 2             # masked by a multi-token word (its prefix generated)
    # a multi-token word's prefix just generated (the token the step before sampled):
    # with async scheduling the sampler runs after that token is applied.
    first = base[0]
    for ids, unchanged in (([first[3], first[4]], False), ([first[2], first[4]], True)):
        out = llm.generate(prompts[0], SamplingParams(max_tokens=24, temperature=0, bad_words_token_ids=[ids]))[0]
        assert (out.token_ids == first) is unchanged and out.token_ids[:4] == first[:4]
    assert_pool_free(llm)


def test_speculative_decoding_keeps_the_words_out(tiny_ckpt, baseline):
    """The draft proposes what the target would say; verification rows see their
    proposals, so a banned word's last token is rejected: same output as without."""
    plain, prompts, base, words = baseline
    spec = LLM(tiny_ckpt, speculative_config={"method": "draft_model", "num_speculative_tokens": 4,
                                              "model": tiny_ckpt}, **ENGINE)
    params = SamplingParams(max_tokens=24, temperature=0, bad_words=words)
    want = [o.token_ids for o in plain.generate(prompts, params)]
    assert [o.token_ids for o in spec.generate(prompts, params)] == want and want != base
    assert spec.stats()["spec_decode_num_draft_tokens"] > 0
    assert_pool_free(spec)


def test_refused_requests_name_the_field_and_others_are_served(baseline):
    llm = baseline[0]
    engine = llm.engine
    for params, match in ((SamplingParams(bad_words_token_ids=[[10**6]]), "'bad_words_token_ids' .*: token id"),
                          (SamplingParams(bad_words=[f"word{i} x{i}" for i in range(100)]), "'bad_words'")):
        with pytest.raises(InvalidRequestError, match=match):
            engine.add_request("Hello", params)
    assert llm.generate("Hello", SamplingParams(max_tokens=4, temperature=0))[0].token_ids == baseline[2][2][:4]
    assert_pool_free(llm)
