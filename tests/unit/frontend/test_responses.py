"""The Responses API's pieces (frontend/openai_api/responses*.py): input items -> chat
messages, and the output items and events a reply is built into."""

import logging

import pytest

from frontend.openai_api.chat_output import ChoiceOutput
from frontend.openai_api.errors import APIError
from frontend.openai_api.reasoning import REASONING_PARSERS
from frontend.openai_api.responses import ResponseBuilder, ResponseStore
from frontend.openai_api.responses_protocol import ResponsesRequest, input_messages
from frontend.openai_api.tools.choice import ToolConfig, plan


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


def test_the_store_is_bounded_and_can_be_off():
    store = ResponseStore(2)
    for i in range(3):
        store.put({"id": f"r{i}"}, [])
    with pytest.raises(APIError) as e:
        store.get("r0", "previous_response_id")
    assert e.value.status == 404
    assert store.get("r2", "previous_response_id")[1] == {"id": "r2"}
    with pytest.raises(APIError) as e:
        ResponseStore(0).get("r2", "previous_response_id")
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
    assert 3000 < one < 3300                           # its objects: 2,000 characters, 8 dicts, lists and str
    for i in range(40):
        store.put(*reply(i, 1000))
        assert store.bytes <= 10_000
    kept = 10_000 // one
    assert len(store) == kept and store.bytes == kept * one
    assert store.get("r39", "previous_response_id")[1]["id"] == "r39"
    with pytest.raises(APIError) as e:                 # the oldest went first
        store.get(f"r{39 - kept:02d}", "previous_response_id")
    assert e.value.status == 404
    store.put(*reply(39, 1000))                        # the same id again: counted once
    assert len(store) == kept and store.bytes == kept * one
    store.put(*reply(99, 20_000))                      # larger than the whole budget: not kept ...
    with pytest.raises(APIError) as e:
        store.get("r99", "previous_response_id")
    assert e.value.status == 404
    assert len(store) == kept and store.get("r39", "previous_response_id")    # ... and nothing dropped for it
    with pytest.raises(APIError) as e:
        ResponseStore(10, max_bytes=0).get("r0", "previous_response_id")
    assert e.value.status == 400


def test_the_store_counts_the_memory_its_entries_hold():
    """Counted at the length of its JSON, a conversation of many small items held about 7x
    its count (review of 2026-11-30). What an entry holds is at most what it counts, and
    not far below it."""
    import gc
    import tracemalloc

    from frontend.openai_api.responses import entry_bytes

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
    assert held <= store.bytes < 1.5 * held, (held, store.bytes)
    assert store.bytes == entry_bytes({"id": "r0", "output": []}, conversation()) > 5_000_000


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
