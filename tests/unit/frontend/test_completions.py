"""/v1/completions shaping (frontend/openai_api/completions.py) on Triton deltas as the
backend sends them, no server: echo with the prompt's logprobs first (the first null),
top_logprobs with the chosen token (k + 1 entries at most, logprobs 0 included), batch
prompts indexed prompt * n + i with usage summed, max_tokens 0 with echo, and a stream's
deltas held until their prompt's logprobs have arrived. The same through a real server:
tests/integration/test_openai_frontend.py."""

import asyncio

import pytest

from frontend.openai_api.completions import BatchGeneration, Completion, PromptInfo, prompts_of
from frontend.openai_api.errors import APIError
from frontend.openai_api.protocol import CompletionRequest, parse
from frontend.openai_api.triton_client import Delta


def lp(logprob, rank, text):
    return {"logprob": logprob, "rank": rank, "decoded_token": text}


# The prompt "ab c" as ids 1, 2, 3; its logprobs as the backend sends them (prompt token first).
PROMPT_LPS = [None, {"2": lp(-2.0, 3, "b"), "9": lp(-0.5, 1, "x"), "8": lp(-1.0, 2, "y")},
              {"3": lp(-0.25, 1, " c"), "7": lp(-3.0, 2, "z")}]
INFO = PromptInfo([1, 2, 3], echo_text="ab c", token_ids=[1, 2, 3], first_token_text="a")


def delta(index, text, ids, entries, reason=None, prompt=None, num_input=3):
    return Delta(index, text, ids, reason, entries, num_input, prompt)


def request(**kw):
    return parse(CompletionRequest, {"model": "m", "prompt": [1, 2, 3], **kw})


def test_echo_puts_the_prompts_logprobs_first_and_top_logprobs_hold_the_chosen_token():
    shape = Completion(request(echo=True, logprobs=1, max_tokens=1), [INFO])
    shape.add(delta(0, "!", [5], [{"5": lp(-4.0, 7, "!"), "9": lp(-0.1, 1, "x")}], "length", PROMPT_LPS))
    choice = shape.whole()["choices"][0]
    assert choice["text"] == "ab c!"
    got = choice["logprobs"]
    assert got["tokens"] == ["a", "b", " c", "!"]
    assert got["token_logprobs"] == [None, -2.0, -0.25, -4.0]
    # logprobs 1: the chosen token, then the most likely one (k + 1 = 2 entries)
    assert got["top_logprobs"] == [None, {"b": -2.0, "x": -0.5}, {" c": -0.25, "z": -3.0}, {"!": -4.0, "x": -0.1}]
    assert got["text_offset"] == [0, 1, 2, 4]
    assert shape.usage() == {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}


def test_logprobs_zero_gives_the_chosen_tokens_entry_and_minus_inf_is_clamped():
    shape = Completion(request(logprobs=0, max_tokens=2), [INFO])
    shape.add(delta(0, "!", [5], [{"5": lp(float("-inf"), 9, "!"), "9": lp(-0.1, 1, "x")}]))
    shape.add(delta(0, "?", [6], [{"6": lp(-0.2, 1, "?")}], "length"))
    got = shape.whole()["choices"][0]["logprobs"]
    assert got["top_logprobs"] == [{"!": -9999.0}, {"?": -0.2}] and got["token_logprobs"] == [-9999.0, -0.2]


def test_max_tokens_zero_with_echo_returns_the_prompt_alone():
    shape = Completion(request(echo=True, logprobs=0, max_tokens=0), [INFO])
    d = delta(0, "!", [5], [{"5": lp(-4.0, 7, "!")}], "length", PROMPT_LPS)
    shape.add(d)
    chunk = shape.chunk(d)["choices"][0]
    assert chunk["text"] == "ab c" and chunk["logprobs"]["tokens"] == ["a", "b", " c"]
    whole = shape.whole()
    assert whole["choices"][0]["text"] == "ab c" and whole["usage"]["completion_tokens"] == 0
    assert whole["choices"][0]["logprobs"]["top_logprobs"][1] == {"b": -2.0}


def test_batch_prompts_index_choices_by_prompt_and_sum_usage():
    other = PromptInfo("q", echo_text="q")
    shape = Completion(request(prompt=["x", "q"], n=2, prompt_logprobs=0), [INFO, other])
    for i, (text, n_in) in enumerate([("a", 3), ("b", 3), ("c", 1), ("d", 1)]):
        shape.add(delta(i, text, [10 + i], [], "length", PROMPT_LPS if i == 0 else None, num_input=n_in))
    whole = shape.whole()
    assert [c["index"] for c in whole["choices"]] == [0, 1, 2, 3] and [c["text"] for c in whole["choices"]] == list("abcd")
    assert whole["usage"] == {"prompt_tokens": 4, "completion_tokens": 4, "total_tokens": 8}
    # vLLM's prompt_logprobs on each choice of the prompt that has them
    assert whole["choices"][1]["prompt_logprobs"] == PROMPT_LPS and whole["choices"][2]["prompt_logprobs"] is None


def test_streamed_echo_chunks_offset_after_the_prompt():
    shape = Completion(request(echo=True, logprobs=0, max_tokens=2, stream=True), [INFO])
    first = delta(0, "!", [5], [{"5": lp(-4.0, 7, "!")}], None, PROMPT_LPS)
    shape.add(first)
    c1 = shape.chunk(first)["choices"][0]
    second = delta(0, "?", [6], [{"6": lp(-0.2, 1, "?")}], "length")
    shape.add(second)
    c2 = shape.chunk(second)["choices"][0]
    assert (c1["text"], c2["text"]) == ("ab c!", "?")
    assert c1["logprobs"]["text_offset"] == [0, 1, 2, 4] and c2["logprobs"]["text_offset"] == [5]


class FakeGeneration:
    def __init__(self, deltas, error=None):
        self.deltas, self.error, self.cancelled = deltas, error, False

    def cancel(self):
        self.cancelled = True

    async def __aiter__(self):
        for d in self.deltas:
            await asyncio.sleep(0)
            yield d
        if self.error:
            raise self.error


def collect(batch):
    async def run():
        return [d async for d in batch]
    return asyncio.run(run())


def test_batch_generation_indexes_and_holds_deltas_for_their_prompts_logprobs():
    # Prompt 0's sequence 1 answers before sequence 0, which brings the prompt's logprobs.
    gens = [FakeGeneration([delta(1, "b", [1], []), delta(0, "a", [2], [], prompt=PROMPT_LPS)]),
            FakeGeneration([delta(0, "c", [3], [], prompt=PROMPT_LPS), delta(1, "d", [4], [])])]
    out = collect(BatchGeneration(gens, n=2, hold=True))
    order = [d.index for d in out]
    assert sorted(order) == [0, 1, 2, 3]
    assert order.index(0) < order.index(1) and order.index(2) < order.index(3)
    assert all(g.cancelled for g in gens)
    out = collect(BatchGeneration([FakeGeneration([delta(1, "b", [1], []), delta(0, "a", [2], [])])], 2, False))
    assert [d.index for d in out] == [1, 0]


def test_one_failed_prompt_fails_the_completion():
    gens = [FakeGeneration([delta(0, "a", [1], [])]), FakeGeneration([], APIError(400, "bad", "prompt"))]
    with pytest.raises(APIError, match="bad"):
        collect(BatchGeneration(gens, n=1, hold=False))
    assert prompts_of("x") == ["x"] and prompts_of([1, 2]) == [[1, 2]] and prompts_of([[1], [2]]) == [[1], [2]]


def test_echo_with_logprobs_refuses_a_prompt_past_max_model_len_without_tokenizing_it_whole():
    """echo with logprobs tokenized a 16 MB prompt whole in the frontend (22 s)."""
    import pytest

    from frontend.openai_api.completions import _echo_infos
    from frontend.openai_api.errors import APIError

    class Tokenizer:
        seen = 0

        def encode(self, text):
            Tokenizer.seen += len(text)
            return [5] * len(text.split())

        def decode(self, ids):
            return "w"

    with pytest.raises(APIError) as e:
        _echo_infos(Tokenizer(), ["word " * 2_000_000], need_ids=True, max_model_len=1024)
    assert e.value.param == "prompt" and "max_model_len" in str(e.value)
    assert Tokenizer.seen <= 4 * 16384
    assert _echo_infos(Tokenizer(), ["a b"], need_ids=True, max_model_len=1024)[0].token_ids == [5, 5]


def test_echo_with_logprobs_refuses_a_16_mb_prompt_in_a_fraction_of_a_second(tiny_ckpt):
    """The same with the model's own tokenizer (timing proxy, wide margin: it was 22 s)."""
    import time

    import pytest
    from transformers import AutoTokenizer

    from frontend.openai_api.completions import _echo_infos
    from frontend.openai_api.errors import APIError
    tok = AutoTokenizer.from_pretrained(tiny_ckpt)
    t0 = time.perf_counter()
    with pytest.raises(APIError):
        _echo_infos(tok, ["word " * (3 << 20)], need_ids=True, max_model_len=1024)
    assert time.perf_counter() - t0 < 1.0
