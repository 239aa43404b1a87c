"""The OpenAI-compatible frontend (`python -m frontend.openai_api`, started beside the
session's real tritonserver as `make serve` starts it), driven by the official `openai` client:
completions and chat, streamed and not, n > 1, stop strings, seeds, exact usage,
logprobs against the offline engine, echo with the prompt's logprobs and batch prompts
(what lm-evaluation-harness sends), structured output, OpenAI-style errors, and a
client that leaves mid-stream freeing its KV blocks."""

import json
import re
import urllib.request

import http.client
import urllib.error

import jsonschema
import pytest

from backend import LLM, SamplingParams
from tests.integration.conftest import API_KEY, auth, openai_frontend, wait_blocks_free

openai = pytest.importorskip("openai")
PROMPT = "The pass statement"
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is a generator?"}]


@pytest.fixture(scope="module")
def frontend(server):
    """The frontend `make serve` starts beside tritonserver (clients.tritonserver serve
    --openai-port), in its own process."""
    return openai_frontend(server)


@pytest.fixture(scope="module")
def client(frontend):
    return openai.OpenAI(base_url=frontend + "/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="module")
def offline(tiny_ckpt):
    return LLM(tiny_ckpt, block_size=16, num_kv_blocks=256)


def chat_ids(llm):
    text = llm.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    return llm.tokenizer(text, add_special_tokens=False)["input_ids"]


def test_models_lists_the_served_model(client):
    """`llm`, and its LoRA adapters as models of their own (tests/integration/test_lora_serving.py)."""
    assert [m.id for m in client.models.list().data] == ["llm", "sql", "chat"]


def test_completion_streamed_and_not_equals_offline_with_exact_usage(client, offline, server):
    ref = offline.generate(PROMPT, SamplingParams(max_tokens=12, temperature=0))[0]
    r = client.completions.create(model="llm", prompt=PROMPT, max_tokens=12, temperature=0)
    assert r.choices[0].text == ref.text and r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ref.prompt_token_ids), len(ref.token_ids))
    chunks = list(client.completions.create(model="llm", prompt=PROMPT, max_tokens=12, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == ref.text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert chunks[-2].choices[0].finish_reason == "length"
    wait_blocks_free(server)


def test_chat_uses_the_checkpoints_template(client, offline, server):
    ref = offline.generate(chat_ids(offline), SamplingParams(max_tokens=10, temperature=0))[0]
    r = client.chat.completions.create(model="llm", messages=MESSAGES, max_completion_tokens=10, temperature=0)
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == ref.text
    assert r.usage.prompt_tokens == len(ref.prompt_token_ids) and r.usage.completion_tokens == 10
    stream = client.chat.completions.create(model="llm", messages=MESSAGES, max_tokens=10, temperature=0, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ref.text
    wait_blocks_free(server)


def test_n_seeds_and_stop_strings(client, offline, server):
    kw = dict(model="llm", prompt=PROMPT, max_tokens=16, temperature=1.0, n=3, seed=7)
    a, b = client.completions.create(**kw), client.completions.create(**kw)
    texts = [c.text for c in sorted(a.choices, key=lambda c: c.index)]
    assert texts == [c.text for c in sorted(b.choices, key=lambda c: c.index)] and len(set(texts)) > 1
    # Sequence i is seeded seed + i (vLLM's rule): the offline engine gives the same.
    refs = [offline.generate(PROMPT, SamplingParams(max_tokens=16, temperature=1.0, seed=7 + i))[0] for i in range(3)]
    assert texts == [r.text for r in refs]
    assert a.usage.completion_tokens == sum(len(r.token_ids) for r in refs)
    streamed = ["", "", ""]
    for chunk in client.completions.create(**kw, stream=True):
        streamed[chunk.choices[0].index] += chunk.choices[0].text
    assert streamed == texts
    ref = offline.generate(PROMPT, SamplingParams(max_tokens=30, temperature=0))[0].text
    stop = ref[len(ref) // 2:len(ref) // 2 + 2]
    r = client.completions.create(model="llm", prompt=PROMPT, max_tokens=30, temperature=0, stop=[stop])
    assert r.choices[0].text == ref[:ref.index(stop)] and r.choices[0].finish_reason == "stop"
    wait_blocks_free(server)


def test_logprobs_equal_the_offline_engines(client, offline):
    ref = offline.generate(PROMPT, SamplingParams(max_tokens=6, temperature=0, logprobs=3))[0]
    r = client.completions.create(model="llm", prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    for i, (token_id, entry) in enumerate(zip(ref.token_ids, ref.logprobs)):
        assert lp.token_logprobs[i] == pytest.approx(entry[token_id].logprob, abs=1e-4)
        top = sorted(entry.values(), key=lambda x: x.rank)[:3]
        assert list(lp.top_logprobs[i].values()) == pytest.approx([x.logprob for x in top], abs=1e-4)
    chat_ref = offline.generate(chat_ids(offline), SamplingParams(max_tokens=4, temperature=0, logprobs=2))[0]
    r = client.chat.completions.create(model="llm", messages=MESSAGES, max_tokens=4, temperature=0, logprobs=True,
                                       top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert [c.logprob for c in content] == pytest.approx(
        [e[t].logprob for t, e in zip(chat_ref.token_ids, chat_ref.logprobs)], abs=1e-4)
    assert all(len(c.top_logprobs) == 2 for c in content)


def test_echo_prompt_logprobs_and_batch_prompts(client, offline, server):
    """Echo with logprobs: the prompt tokens' entries first (the first null), equal to the
    offline engine's prompt logprobs; top_logprobs hold the chosen token (k + 1 at most);
    logprobs 0; batch prompts (strings or token ids) with choice index prompt * n + i and
    usage summed; max_tokens 0 (the prompt alone); streamed echo; vLLM's prompt_logprobs."""
    text = "The pass statement does nothing: it holds the place where a statement is required."
    ref = offline.generate(text, SamplingParams(max_tokens=3, temperature=0, logprobs=2, prompt_logprobs=2))[0]
    ids, n_prompt = ref.prompt_token_ids, len(ref.prompt_token_ids)
    r = client.completions.create(model="llm", prompt=text, max_tokens=3, temperature=0, logprobs=2, echo=True)
    c = r.choices[0]
    assert c.text == text + ref.text and (r.usage.prompt_tokens, r.usage.completion_tokens) == (n_prompt, 3)
    lp = c.logprobs
    assert len(lp.tokens) == n_prompt + 3 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.tokens[0] == offline.tokenizer.decode(ids[:1]) and "".join(lp.tokens) == c.text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    want = [e[t].logprob for e, t in zip(ref.prompt_logprobs[1:] + ref.logprobs, ids[1:] + ref.token_ids)]
    assert lp.token_logprobs[1:] == pytest.approx(want, abs=1e-4)
    for i, (entry, token) in enumerate(zip(ref.prompt_logprobs[1:] + ref.logprobs, ids[1:] + ref.token_ids), 1):
        top = lp.top_logprobs[i]
        assert lp.tokens[i] in top and 1 <= len(top) <= 3       # the chosen token and the 2 most likely
        assert sorted(top.values()) == pytest.approx(sorted({e.decoded_token: e.logprob
                                                             for e in entry.values()}.values()), abs=1e-4)
    # lm-evaluation-harness' loglikelihood request: token-id prompts, echo, logprobs, max_tokens 0 or 1.
    short = ids[:4]
    r = client.completions.create(model="llm", prompt=[ids, short], max_tokens=0, echo=True, logprobs=0,
                                  temperature=0)
    a, b = sorted(r.choices, key=lambda x: x.index)
    assert (a.index, b.index) == (0, 1) and a.text == offline.tokenizer.decode(ids)
    assert a.logprobs.token_logprobs[1:] == pytest.approx([e[t].logprob for e, t in zip(ref.prompt_logprobs[1:],
                                                                                         ids[1:])], abs=1e-4)
    assert all(len(top) == 1 for top in a.logprobs.top_logprobs[1:])       # logprobs 0: the chosen token's
    assert b.logprobs.token_logprobs == pytest.approx(a.logprobs.token_logprobs[:4], abs=1e-4)
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (n_prompt + 4, 0)
    # Batch prompts with n: one choice set per prompt; vLLM's prompt_logprobs on request.
    r = client.completions.create(model="llm", prompt=[text, "A second prompt"], n=2, max_tokens=2,
                                  temperature=0, extra_body={"prompt_logprobs": 1})
    choices = sorted(r.choices, key=lambda x: x.index)
    assert [x.index for x in choices] == [0, 1, 2, 3]
    assert choices[0].text == choices[1].text and ref.text.startswith(choices[0].text)
    second = len(offline.tokenizer.encode("A second prompt"))
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (n_prompt + second, 8)
    plp = choices[1].to_dict()["prompt_logprobs"]
    assert plp[0] is None and len(plp) == n_prompt
    assert plp[1][str(ids[1])]["logprob"] == pytest.approx(ref.prompt_logprobs[1][ids[1]].logprob, abs=1e-4)
    # Streamed echo: each choice's first chunk carries its prompt and the prompt's entries.
    texts, firsts = ["", "", "", ""], [None] * 4
    for chunk in client.completions.create(model="llm", prompt=[text, "A second prompt"], n=2, max_tokens=3,
                                           temperature=0, echo=True, logprobs=1, stream=True):
        for x in chunk.choices:
            texts[x.index] += x.text
            firsts[x.index] = firsts[x.index] or x.logprobs
    assert texts[0] == texts[1] == text + ref.text and texts[2].startswith("A second prompt")
    assert all(f.token_logprobs[0] is None and len(f.tokens) >= 2 for f in firsts)
    assert firsts[0].token_logprobs[1:n_prompt] == pytest.approx(want[:n_prompt - 1], abs=1e-4)
    wait_blocks_free(server)


def test_typical_p_through_extra_body(client, server):
    """A logits processor's parameter (typical_p) arrives from the openai client's
    extra_body through Triton to the sampler: a tiny one (below any kept token's
    probability) keeps one token a step, so two
    unseeded requests give the same text (sampling from the whole distribution would
    not: the default model's are broad); out of range is a 400 naming it. (Which token
    a tiny typical_p keeps is the one nearest the entropy: a near tie can go either way
    between engines of other settings, so the text is not compared with the offline
    engine's; tests/unit/engine/sampling/logits_processors/test_typical_p.py compares
    it with transformers' on one engine.)"""
    texts = {client.completions.create(model="llm", prompt=PROMPT, max_tokens=12,
                                       extra_body={"typical_p": 1e-6}).choices[0].text for _ in range(2)}
    assert len(texts) == 1
    plain = {client.completions.create(model="llm", prompt=PROMPT, max_tokens=12).choices[0].text for _ in range(2)}
    assert len(plain) == 2, "unseeded sampling repeated itself: the check above says nothing"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="llm", prompt=PROMPT, max_tokens=8, extra_body={"typical_p": 2})
    assert "typical_p" in str(e.value)
    wait_blocks_free(server)


def test_priority_needs_a_priority_engine(client, server):
    """vLLM's `priority` reaches the engine, which (scheduling first come, first served)
    refuses a nonzero one naming the engine argument that would take it; 0 is served."""
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="llm", prompt=PROMPT, max_tokens=2, extra_body={"priority": 1})
    assert "scheduling_policy 'priority'" in str(e.value)
    assert client.completions.create(model="llm", prompt=PROMPT, max_tokens=2,
                                     extra_body={"priority": 0}).choices[0].finish_reason == "length"
    wait_blocks_free(server)


def test_structured_output(client, server):
    schema = {"type": "object", "properties": {
        "title": {"type": "string", "maxLength": 12}, "year": {"type": "integer", "minimum": 1900, "maximum": 2100},
        "genres": {"type": "array", "items": {"enum": ["drama", "comedy", "horror"]}, "maxItems": 3},
        "rating": {"type": "object", "properties": {"stars": {"type": "integer", "minimum": 1, "maximum": 5}},
                   "required": ["stars"]}},
        "required": ["title", "year", "genres", "rating"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "movie", "schema": schema}}
    for seed in range(20):
        r = client.chat.completions.create(model="llm", messages=MESSAGES, max_tokens=200, seed=seed,
                                           response_format=fmt)
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    r = client.completions.create(model="llm", prompt=PROMPT, max_tokens=20, seed=1,
                                  extra_body={"guided_regex": r"[a-z]{3}-\d{2}"})
    assert re.fullmatch(r"[a-z]{3}-\d{2}", r.choices[0].text)
    r = client.completions.create(model="llm", prompt=PROMPT, max_tokens=20, n=4, seed=2,
                                  extra_body={"guided_choice": ["red", "green", "blue"]})
    assert {c.text for c in r.choices} <= {"red", "green", "blue"}
    r = client.chat.completions.create(model="llm", messages=MESSAGES, max_tokens=100, seed=3,
                                       response_format={"type": "json_object"})
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    wait_blocks_free(server)


@pytest.mark.parametrize("body, status, param", [
    ({"model": "nope", "prompt": "x"}, 404, "model"),
    ({"model": "llm", "prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
    ({"model": "llm", "prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ({"model": "llm", "prompt": 5}, 400, "prompt"),
    ({"model": "llm", "prompt": "x", "guided_json": {"type": "objectx"}}, 400, None),
    ({"model": "llm", "prompt": "x", "response_format": {"type": "json_schema", "json_schema": {"name": "n"}}},
     400, "response_format"),
    ({"model": "llm", "prompt": "word " * 2000}, 400, None),
    ("{not json", 400, None),
    ({"model": "llm", "prompt": "x", "suffix": "y"}, 400, "suffix"),
    ({"model": "llm", "prompt": "x", "best_of": 2}, 400, "best_of"),
    ({"model": "llm", "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
], ids=["unknown-model", "negative-max-tokens", "wrong-type", "prompt-type", "invalid-schema", "schema-missing",
        "oversize-prompt", "bad-json-body", "suffix", "best-of", "max-tokens-0-without-echo"])
def test_bad_requests_get_openai_errors_and_the_next_is_served(frontend, client, server, body, status, param):
    data = (body if isinstance(body, str) else json.dumps(body)).encode()
    request = urllib.request.Request(frontend + "/v1/completions", data=data,
                                     headers=auth({"content-type": "application/json"}))
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(request, timeout=60)
    assert e.value.code == status
    error = json.loads(e.value.read())["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status and error["message"]
    if param:
        assert error["param"] == param
    assert client.completions.create(model="llm", prompt=PROMPT, max_tokens=3).usage.completion_tokens == 3
    wait_blocks_free(server)


def test_client_leaving_mid_stream_frees_the_kv_blocks(frontend, server):
    body = {"model": "llm", "prompt": PROMPT, "max_tokens": 1000, "min_tokens": 1000, "ignore_eos": True,
            "stream": True}
    conn = http.client.HTTPConnection(frontend.removeprefix("http://"), timeout=60)
    conn.request("POST", "/v1/completions", json.dumps(body), auth({"content-type": "application/json"}))
    response = conn.getresponse()
    assert response.status == 200
    got = [response.readline() for _ in range(6)]
    assert any(line.startswith(b"data: {") for line in got)
    conn.close()                                        # gone, 1000 tokens short
    wait_blocks_free(server, timeout_s=10)


def test_streams_closed_together_are_all_cancelled(frontend, server):
    """Issue 49: 8 streams closed at once left one running its full length (KV blocks
    climbing) in 3 of 17 trials. 20 rounds of 8; each round must end with the pool free."""
    body = json.dumps({"model": "llm", "prompt": PROMPT, "max_tokens": 1000, "min_tokens": 1000,
                       "ignore_eos": True, "stream": True})
    host = frontend.removeprefix("http://")
    for round_ in range(20):
        conns = [http.client.HTTPConnection(host, timeout=60) for _ in range(8)]
        for conn in conns:
            conn.request("POST", "/v1/completions", body, auth({"content-type": "application/json"}))
        # Every other round half of them leave before the first token (before the 200).
        for conn in conns[4 * (round_ % 2):]:
            response = conn.getresponse()
            assert response.status == 200
            assert response.readline().startswith(b"data: {")
        for conn in conns:
            conn.close()                                # all gone, far short of 1000 tokens
        wait_blocks_free(server, timeout_s=10)
