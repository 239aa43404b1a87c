"""The Responses API's pieces (frontend/openai_api/responses*.py): input items -> chat
messages, and the output items and events a reply is built into."""

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
    [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}],
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
