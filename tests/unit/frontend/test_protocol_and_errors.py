"""The frontend's request validation and its mapping of the backend's errors to OpenAI
statuses (the messages are the backend's own: backend/triton_server/errors.py)."""

import pytest

from backend.engine.errors import QueueFullError
from frontend.openai_api.errors import from_triton
from frontend.openai_api.protocol import ChatCompletionRequest, CompletionRequest, parse


@pytest.mark.parametrize("message, status, param", [
    (f"UNAVAILABLE: {QueueFullError('waiting queue is full (max_queue_size=4)')}", 503, None),
    ("UNAVAILABLE: the engine failed: EngineDeadError('tensor parallel rank 1 exited')", 503, None),
    ("invalid sampling parameter 'top_p': Input should be less than or equal to 1 (got 2)", 400, "top_p"),
    ("invalid guided_regex: Regex parsing error at position 4: Unclosed '['", 400, None),
    ("sampling parameter 'bad_words' has 130 token sequences, more than 128", 400, "bad_words"),
    ("Request for unknown model: 'x' is not found", 404, "model"),
    ("INTERNAL: RuntimeError('boom')", 500, None),
    # A hung or dead stub, in Triton's words: retryable, never the client's 400.
    ("Failed to process the request(s) for model instance 'llm_0_0', message: Stub process 'llm_0_0' is not "
     "healthy.", 503, None),
    ("Stub process is not healthy.", 503, None),
    ("Failed to process the request(s) for model instance 'llm_0_0', message: ValueError('x')", 400, None),
])
def test_backend_errors_map_to_openai_statuses(message, status, param):
    e = from_triton(message)
    assert (e.status, e.param) == (status, param)
    body = e.response().body
    assert b'"code":%d' % status in body and b'"type"' in body


def test_requests_translate_to_sampling_parameters():
    req = parse(CompletionRequest, {"model": "m", "prompt": ["only one"], "stop": "x", "seed": 3, "top_k": 5,
                                    "logit_bias": {"17": -100}, "user": "ignored", "unknown_field": 1,
                                    "bad_words": ["cat", "big dog"]})
    p = req.sampling_parameters(req.max_tokens)
    assert req.prompt == ["only one"]          # a list of prompts: frontend/openai_api/completions.py
    assert (p["stop"], p["seed"], p["top_k"], p["logit_bias"], p["max_tokens"]) == (["x"], 3, 5, {17: -100}, 16)
    assert p["bad_words"] == ["cat", "big dog"]
    chat = parse(ChatCompletionRequest, {"model": "m", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "hi"}]}], "response_format": {"type": "json_object"}})
    assert chat.messages[0].text() == "hi"
    assert chat.sampling_parameters(None)["guided_json_object"] is True


@pytest.mark.parametrize("body, param", [
    ({"model": "m", "prompt": "a", "suffix": "b"}, "suffix"),
    ({"model": "m", "prompt": "a", "best_of": 2}, "best_of"),              # was param null
    ({"model": "m", "prompt": "a", "n": 2, "best_of": 3}, "best_of"),
    ({"model": "m", "prompt": "a", "max_tokens": 2**31}, "max_tokens"),     # a count travels as INT32
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 2**31},
     "max_completion_tokens"),
    ({"model": "m", "prompt": ""}, "prompt"),              # was the engine's words
    ({"model": "m", "prompt": ["a", ""]}, "prompt"),
    ({"model": "m", "prompt": [[]]}, "prompt"),
    ({"model": None, "prompt": "a"}, "model"),             # null: "not given", and these are required
    ({"model": "m", "prompt": None}, "prompt"),
    ({"model": "m", "messages": None}, "messages"),
    ({"model": "m", "prompt": "a", "prompt_logprobs": -1}, "prompt_logprobs"),
    ({"model": "m", "prompt": "a", "n": 0}, "n"),
    ({"model": "m", "messages": []}, "messages"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
    ({"prompt": "a"}, "model"),
    ({"model": "m", "prompt": "a", "bad_words": "cat"}, "bad_words"),      # a list, as vLLM's
    # found by tests/integration/test_api_fuzz.py and by hand beside it (each was a 500)
    ({"model": "m", "prompt": [5, 2**40]}, "prompt"),                      # token ids travel as INT32
    ({"model": "m", "prompt": "a", "seed": 2**64}, "seed"),                # the engine's seeds are int64
    ({"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}, "messages.0.content"),
    # strict input (issue 31): no coercion, known roles, content where needed, stream_options with stream
    ({"model": "m", "prompt": "a", "max_tokens": "10"}, "max_tokens"),
    ({"model": "m", "prompt": "a", "stream": "yes"}, "stream"),
    ({"model": "m", "prompt": "a", "temperature": "0.5"}, "temperature"),
    ({"model": "m", "prompt": "a", "logprobs": True}, "logprobs"),
    ({"model": "m", "prompt": "a", "max_tokens": 10.5}, "max_tokens"),
    ({"model": "m", "messages": [{"role": "user", "content": [{"type": {}}]}]}, "messages.0.content"),  # was a 500
    ({"model": "m", "prompt": "a", "stream": True, "stream_options": {"include_usage": "true"}},
     "stream_options.include_usage"),
    ({"model": "m", "prompt": "a", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": False,
      "stream_options": {"include_usage": True}}, "stream_options"),
    ({"model": "m", "messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
    ({"model": "m", "messages": [{"role": "user", "content": None}]}, "messages.0"),
    ({"model": "m", "messages": [{"role": "system"}]}, "messages.0"),
    ({"model": "m", "messages": [{"role": "user", "content": "x"}], "seed": 2**70}, "seed"),
])
def test_bad_bodies_name_the_field(body, param):
    from frontend.openai_api.errors import APIError
    cls = ChatCompletionRequest if "messages" in body else CompletionRequest
    with pytest.raises(APIError) as e:
        parse(cls, body)
    assert e.value.status == 400 and e.value.param == param


@pytest.mark.parametrize("part, what", [
    ({"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}, "audio"),
    ({"type": "file", "file": {"file_id": "f"}}, "files"),
    ({"type": "hologram"}, None),
])
def test_non_text_content_parts_are_refused_not_dropped(part, what):
    """An image part was dropped in silence: the model answered about a conversation
    without it (issue 31)."""
    from frontend.openai_api.errors import APIError
    body = {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "what is this?"}, part]}]}
    with pytest.raises(APIError) as e:
        parse(ChatCompletionRequest, body)
    assert e.value.status == 400 and e.value.param == "messages.0.content"
    assert (f"this model does not accept {what}" if what else "unsupported content part") in e.value.message


def test_image_parts_are_checked_against_the_model_that_serves_them():
    """An image part passes the protocol; routed to a text model it is a 400 (issue 31:
    never dropped in silence), and a URL other than inline data is a 400 anywhere."""
    from frontend.openai_api.chat_content import checked_images
    from frontend.openai_api.errors import APIError
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    req = parse(ChatCompletionRequest, {"model": "m", "messages": [
        {"role": "user", "content": [{"type": "text", "text": "what is "}, image, {"type": "text", "text": "?"}]}]})
    message = req.messages[0]
    assert message.image_urls() == ["data:image/png;base64,AAAA"] and message.text() == "what is ?"
    assert message.for_template()["content"] == [{"type": "text", "text": "what is "}, {"type": "image"},
                                                 {"type": "text", "text": "?"}]
    assert checked_images(message.image_urls(), True, "m") == message.image_urls()
    with pytest.raises(APIError, match="does not accept images"):
        checked_images(message.image_urls(), False, "m")
    with pytest.raises(APIError, match="scheme 'https'"):
        checked_images(["https://example.com/cat.png"], True, "m")


def test_what_strict_input_still_accepts():
    """An int where a float goes and an integral float where an int goes (JSON has one
    number type); every OpenAI role; an assistant turn without content (tool calls
    alone); stream_options with stream."""
    req = parse(CompletionRequest, {"model": "m", "prompt": [5.0, 6], "temperature": 1, "top_p": 1, "stream": True,
                                    "stream_options": {"include_usage": True}, "logit_bias": {"5": 2}, "n": 2.0,
                                    "max_tokens": 10.0})
    assert req.temperature == 1.0 and req.sampling_parameters(None)["logit_bias"] == {5: 2.0}
    assert (req.n, req.max_tokens, req.prompt) == (2, 10, [5, 6]) and type(req.n) is int
    messages = [{"role": r, "content": "x"} for r in ("system", "developer", "user", "tool")]
    chat = parse(ChatCompletionRequest, {"model": "m", "messages": messages + [{"role": "assistant", "content": None}]})
    assert [m.role for m in chat.messages][-1] == "assistant" and chat.messages[-1].text() == ""


def test_n_past_the_models_queue_is_a_400_naming_it():
    """The engine queues each of n sequences: past max_queue_size it answered a retryable
    503 for a request that can never succeed (found by tests/integration/test_api_fuzz.py)."""
    from frontend.openai_api.errors import APIError
    from frontend.openai_api.triton_client import ServedModel
    served = ServedModel("llm", None, 0, "llm", max_queue_size=48)
    served.check_n(48)
    with pytest.raises(APIError) as e:
        served.check_n(49)
    assert (e.value.status, e.value.param) == (400, "n")
    ServedModel("llm", None, 0, "llm").check_n(1000)      # no bound configured
