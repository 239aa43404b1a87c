"""The Responses API's pieces (frontend/openai_api/responses*.py): input items -> chat
messages, and the output items and events a reply is built into."""

import asyncio
import logging

import pytest

from frontend.openai_api.chat_output import ChoiceOutput
from frontend.openai_api.errors import APIError
from frontend.openai_api.reasoning import REASONING_PARSERS
from frontend.openai_api.responses import ResponseBuilder, ResponseStore
from frontend.openai_api.responses_protocol import ResponsesRequest, input_messages
from frontend.openai_api.tools.choice import ToolConfig, plan
from frontend.openai_api.tools.parsers import PARSERS


def test_input_items_become_chat_messages():
    items = [{"role": "user", "content": [{"type": "input_text", "text": "Weather "}, {"type": "input_text",
                                                                                      "text": "in Rome?"}]},
             {"type": "reasoning", "id": "rs_1", "summary": []},
             {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "rome"}'},
             {"type": "function_call", "call_id": "c2", "name": "get_time", "arguments": "{}"},
             {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Sunny."}]}]
    assert input_messages(items) == [
        {"role": "user", "content": "Weather in Rome?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "rome"}'}},
            {"id": "c2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "assistant", "content": "Sunny."}]
    assert input_messages("hi") == [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("items", [
    [{"role": "wizard", "content": "x"}], [{"type": "input_image", "image_url": "x"}],
    [{"role": "assistant", "content": [{"type": "input_image", "image_url": "x"}]}],
    [{"role": "user", "content": [{"type": "input_image", "image_url": 5}]}],
    [{"type": "function_call", "name": "f"}], [{"type": "function_call_output", "output": "x"}], ["text"]])
def test_bad_items_are_400s_naming_the_item(items):
    with pytest.raises(APIError) as e:
        input_messages(items)
    assert e.value.status == 400 and e.value.param == "input.0"


def build(text: str, finish: str, stream_cuts: list[int]):
    req = ResponsesRequest(model="llm", input="x", tools=[{"type": "function", "name": "f"}])
    tool_plan = plan(*req.chat_tools(), True, ToolConfig(True, "hermes"), guided=False)
    make = lambda: ChoiceOutput(REASONING_PARSERS["qwen3"]("assistant:"), tool_plan.parser(ToolConfig(True, "hermes")))  # noqa: E731
    streamed, output, events = ResponseBuilder(req, tool_plan), make(), []
    for end in stream_cuts + [len(text)]:
        events += streamed.feed(output.delta(text[:end], final=end == len(text)))
    events += streamed.finish(finish)
    whole = ResponseBuilder(req, tool_plan)
    whole.feed(make().delta(text, final=True))
    whole.finish(finish)
    return streamed, whole, events


def test_a_reply_becomes_reasoning_message_and_call_items_streamed_or_not():
    text = '<think>hm</think>Checking.<tool_call>{"name": "f", "arguments": {"a": "b"}}</tool_call>'
    streamed, whole, events = build(text, "stop", [3, 12, 20, 40, 60])
    strip = lambda items: [{k: v for k, v in i.items() if k not in ("id", "call_id")} for i in items]  # noqa: E731
    assert strip(streamed.items) == strip(whole.items)
    assert [i["type"] for i in whole.items] == ["reasoning", "message", "function_call"]
    assert whole.items[2]["arguments"] == '{"a": "b"}' and whole.response()["status"] == "completed"
    kinds = [e["type"] for e in events]
    assert kinds[0] == "response.output_item.added" and kinds[-1] == "response.completed"
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert "".join(e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta") == '{"a": "b"}'
    assert kinds.count("response.output_item.added") == kinds.count("response.output_item.done") == 3


def test_max_output_tokens_is_incomplete():
    _, whole, events = build("a long reply", "length", [])
    assert whole.response()["status"] == "incomplete" and events[-1]["type"] == "response.incomplete"
    assert whole.response()["incomplete_details"] == {"reason": "max_output_tokens"}


def got(store: ResponseStore, response_id: str, param: str):
    return asyncio.run(store.get(response_id, param))


def test_the_store_is_bounded_and_can_be_off():
    store = ResponseStore(2)
    for i in range(3):
        store.put({"id": f"r{i}"}, [])
    with pytest.raises(APIError) as e:
        got(store, "r0", "previous_response_id")
    assert e.value.status == 404
    assert got(store, "r2", "previous_response_id")[1] == {"id": "r2"}
    with pytest.raises(APIError) as e:
        got(ResponseStore(0), "r2", "previous_response_id")
    assert e.value.status == 400


def test_the_store_is_bounded_in_bytes_oldest_first():
    """40 replies with 10 MB of reasoning each grew the frontend by 442 MB, never freed:
    the store had a count bound only."""
    from frontend.openai_api.responses import DEFAULT_RESPONSES_STORE_BYTES, entry_bytes

    def reply(i: int, size: int) -> tuple[dict, list[dict]]:
        return ({"id": f"r{i:02d}", "reasoning": {"effort": "x" * size}},
                [{"role": "user", "content": "é" * size}, {"role": "assistant", "content": "ok"}])

    assert ResponseStore(1024).max_bytes == DEFAULT_RESPONSES_STORE_BYTES == 64 * 1024 * 1024
    store = ResponseStore(1000, max_bytes=10_000)
    one = entry_bytes(*reply(0, 1000))
    assert 3000 < one < 3200                           # its UTF-8 JSON's length (an "é" is 2 bytes)
    for i in range(40):
        store.put(*reply(i, 1000))
        assert store.bytes <= 10_000
    kept = 10_000 // one
    assert len(store) == kept and store.bytes == kept * one
    assert got(store, "r39", "previous_response_id")[1]["id"] == "r39"
    with pytest.raises(APIError) as e:                 # the oldest went first
        got(store, f"r{39 - kept:02d}", "previous_response_id")
    assert e.value.status == 404
    store.put(*reply(39, 1000))                        # the same id again: counted once
    assert len(store) == kept and store.bytes == kept * one
    store.put(*reply(99, 20_000))                      # larger than the whole budget: not kept ...
    with pytest.raises(APIError) as e:
        got(store, "r99", "previous_response_id")
    assert e.value.status == 404
    assert len(store) == kept and got(store, "r39", "previous_response_id")    # ... and nothing dropped for it
    with pytest.raises(APIError) as e:
        got(ResponseStore(10, max_bytes=0), "r0", "previous_response_id")
    assert e.value.status == 400

def test_what_the_store_holds_is_what_it_counts():
    """Kept as Python objects, a conversation of many small items took about 7x the length
    of its JSON, which is what the byte bound counted; kept as that JSON, the memory the
    store holds is what it counts. A reader gets the same objects back."""
    import gc
    import tracemalloc

    def conversation() -> list[dict]:
        return [{"role": "user", "content": [{"type": "input_text", "text": f"{i}"}]} for i in range(20_000)]
    store = ResponseStore(10, max_bytes=64 << 20)
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        store.put({"id": "r0", "output": []}, conversation())
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert store.bytes > 1_000_000 and held < 1.1 * store.bytes, (held, store.bytes)
    assert got(store, "r0", "previous_response_id") == (conversation(), {"id": "r0", "output": []})


def test_the_store_bound_is_a_setting(monkeypatch):
    import uvicorn

    from frontend.openai_api.__main__ import main
    from frontend.openai_api.app import create_app
    from frontend.openai_api.responses import DEFAULT_RESPONSES_STORE_BYTES
    assert create_app("127.0.0.1:1", responses_store_bytes=5000).state.responses_store.max_bytes == 5000
    assert create_app("127.0.0.1:1").state.responses_store.max_bytes == DEFAULT_RESPONSES_STORE_BYTES
    served, policies = [], []
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: served.append(app))
    # (the frontend's malloc policy: test_host_malloc.py; not applied to the test's process)
    monkeypatch.setattr("backend.engine.host_malloc.map_large_blocks", lambda: policies.append(1) or True)
    for name in ("TRITON_ADMIN_KEY", "TRITON_ADMIN_KEY_FILE", "API_KEY", "API_KEY_FILE"):
        monkeypatch.delenv(name, raising=False)
    for name in ("frontend", "frontend.requests"):     # main() sets up the frontend's logging
        logger = logging.getLogger(name)
        for attr in ("handlers", "level", "propagate"):
            monkeypatch.setattr(logger, attr, list(logger.handlers) if attr == "handlers" else getattr(logger, attr))
    main(["--responses-store-bytes", "1234", "--responses-store-size", "7"])
    main([])
    assert (served[0].state.responses_store.max_bytes, served[0].state.responses_store.size) == (1234, 7)
    assert policies == [1, 1]
    assert served[1].state.responses_store.max_bytes == DEFAULT_RESPONSES_STORE_BYTES
