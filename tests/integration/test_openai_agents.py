"""Tool calling, reasoning, the Responses API and the OpenAI Agents SDK, against the
session's real tritonserver and its OpenAI frontend (`server` in conftest.py: started as
`make serve` starts it, with --enable-auto-tool-choice --tool-call-parser hermes
--reasoning-parser qwen3), through the official `openai` client and `openai-agents`.

The default model has random weights: tool_choice `required` and named functions are
forced by the engine's structured output, so their arguments validate whatever it writes;
its reasoning is steered with logit_bias on </think>, found on the offline engine."""

import asyncio
import json
from typing import Literal

import jsonschema
import pytest

from backend import LLM, SamplingParams
from tests.integration.conftest import API_KEY, openai_frontend, wait_blocks_free

openai = pytest.importorskip("openai")

CITY = {"type": "object", "properties": {"city": {"type": "string", "enum": ["paris", "rome"]},
                                         "unit": {"type": "string", "enum": ["c", "f"]}},
        "required": ["city", "unit"], "additionalProperties": False}
TZ = {"type": "object", "properties": {"tz": {"type": "string", "enum": ["utc", "cet"]}}, "required": ["tz"],
      "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather", "parameters": CITY}},
         {"type": "function", "function": {"name": "get_time", "parameters": TZ}}]
SCHEMAS = {"get_weather": CITY, "get_time": TZ}
ASK = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def frontend(server):
    return openai_frontend(server)


@pytest.fixture(scope="module")
def client(frontend):
    return openai.OpenAI(base_url=frontend + "/v1", api_key=API_KEY, max_retries=0)


def streamed_calls(stream) -> tuple[list[tuple[str, str]], str]:
    calls: list[list[str]] = []
    finish = None
    for chunk in stream:
        choice = chunk.choices[0]
        for c in choice.delta.tool_calls or []:
            if c.id:
                assert c.index == len(calls) and c.function.name
                calls.append([c.function.name, ""])
            calls[c.index][1] += c.function.arguments or ""
        finish = choice.finish_reason or finish
    return [tuple(c) for c in calls], finish


@pytest.mark.parametrize("tool_choice,finish", [
    ({"type": "function", "function": {"name": "get_time"}}, "stop"), ("required", "tool_calls")])
def test_forced_tool_calls_validate_and_stream_to_the_same_call(client, server, tool_choice, finish):
    kw = dict(model="llm", messages=ASK, tools=TOOLS, tool_choice=tool_choice, parallel_tool_calls=False,
              temperature=0, max_tokens=80)
    r = client.chat.completions.create(**kw)
    choice = r.choices[0]
    assert choice.finish_reason == finish and choice.message.content is None
    calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
    assert len(calls) == 1 and all(c.id.startswith("call_") for c in choice.message.tool_calls)
    name, arguments = calls[0]
    jsonschema.validate(json.loads(arguments), SCHEMAS[name])
    if isinstance(tool_choice, dict):
        assert name == "get_time"
    assert streamed_calls(client.chat.completions.create(**kw, stream=True)) == (calls, finish)
    wait_blocks_free(server)


def test_auto_tool_choice_history_and_legacy_functions(client, server):
    # auto: the random model writes text, which the hermes parser leaves as content
    r = client.chat.completions.create(model="llm", messages=ASK, tools=TOOLS, temperature=0, max_tokens=8)
    assert r.choices[0].message.content and not r.choices[0].message.tool_calls
    # a tool turn in the history: the call and its result reach the template
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                            "arguments": '{"city": "paris", "unit": "c"}'}}
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [call]},
                     {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    r2 = client.chat.completions.create(model="llm", messages=history, tools=TOOLS, tool_choice="none",
                                        temperature=0, max_tokens=4)
    assert r2.usage.prompt_tokens > r.usage.prompt_tokens + 10
    # the legacy form: functions + function_call, answered as function_call
    legacy = client.chat.completions.create(model="llm", messages=ASK, functions=[t["function"] for t in TOOLS],
                                            function_call={"name": "get_weather"}, temperature=0, max_tokens=80)
    assert legacy.choices[0].finish_reason == "function_call"
    jsonschema.validate(json.loads(legacy.choices[0].message.function_call.arguments), CITY)
    for bad, param in [(dict(tool_choice="required"), "tool_choice"),
                       (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}),
                        "tool_choice"),
                       (dict(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}),
                        "tool_choice")]:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="llm", messages=ASK, max_tokens=4, **bad)
        assert e.value.body["param"] == param
    wait_blocks_free(server)


def test_reasoning_split_streamed_and_not(client, server, tiny_ckpt):
    """enable_thinking opens <think> in the prompt; a logit_bias on </think> (the smallest
    that closes the block mid-reply on the offline engine) steers the random model."""
    offline = LLM(tiny_ckpt, block_size=16, num_kv_blocks=64)
    tok = offline.tokenizer
    end = tok.convert_tokens_to_ids("</think>")
    text = tok.apply_chat_template(ASK, add_generation_prompt=True, tokenize=False, enable_thinking=True)
    assert text.endswith("<think>")
    ids = tok(text, add_special_tokens=False)["input_ids"]
    for bias in range(1, 40):
        ref = offline.generate(ids, SamplingParams(max_tokens=16, temperature=0, logit_bias={end: bias}))[0]
        if end in ref.token_ids[2:-2]:
            break
    else:
        pytest.fail("no logit_bias closes the reasoning mid-reply")
    reasoning, _, content = ref.text.partition("</think>")
    kw = dict(model="llm", messages=ASK, temperature=0, max_tokens=16, logit_bias={str(end): bias},
              extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    message = client.chat.completions.create(**kw).choices[0].message
    assert (message.reasoning_content, message.reasoning, message.content) == (reasoning, reasoning, content)
    got = {"reasoning_content": "", "content": ""}
    for chunk in client.chat.completions.create(**kw, stream=True):
        for key in got:
            got[key] += getattr(chunk.choices[0].delta, key, None) or ""
    assert got == {"reasoning_content": reasoning, "content": content}
    # Structured output shapes the answer after the reasoning, not the reasoning
    shaped = client.chat.completions.create(**{**kw, "max_tokens": 60}, response_format={
        "type": "json_schema", "json_schema": {"name": "tz", "schema": TZ}}).choices[0].message
    assert shaped.reasoning_content == reasoning
    jsonschema.validate(json.loads(shaped.content), TZ)
    # Without thinking, the same model's reply is all content
    plain = client.chat.completions.create(model="llm", messages=ASK, temperature=0, max_tokens=4).choices[0].message
    assert plain.content and getattr(plain, "reasoning_content", None) is None
    wait_blocks_free(server)


def test_responses_api_streamed_and_not_with_tools_and_stored_state(client, server):
    chat = client.chat.completions.create(model="llm", messages=[{"role": "system", "content": "Be terse."}] + ASK,
                                          temperature=0, max_tokens=10)
    r = client.responses.create(model="llm", instructions="Be terse.", input=ASK[0]["content"], temperature=0,
                                max_output_tokens=10)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output_text == chat.choices[0].message.content
    assert (r.usage.input_tokens, r.usage.output_tokens) == (chat.usage.prompt_tokens, 10)
    events = list(client.responses.create(model="llm", instructions="Be terse.", input=ASK[0]["content"],
                                          temperature=0, max_output_tokens=10, stream=True))
    assert events[0].type == "response.created" and events[-1].type == "response.incomplete"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == r.output_text
    assert events[-1].response.output_text == r.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))

    tools = [{"type": "function", "name": t["function"]["name"], "parameters": t["function"]["parameters"],
              "strict": True} for t in TOOLS]
    called = client.responses.create(model="llm", input="Weather?", tools=tools, tool_choice="required",
                                     parallel_tool_calls=False, temperature=0, max_output_tokens=80)
    assert called.status == "completed" and [o.type for o in called.output] == ["function_call"]
    fc = called.output[0]
    jsonschema.validate(json.loads(fc.arguments), SCHEMAS[fc.name])
    stream = list(client.responses.create(model="llm", input="Weather?", tools=tools, tool_choice="required",
                                          parallel_tool_calls=False, temperature=0, max_output_tokens=80,
                                          stream=True))
    assert "".join(e.delta for e in stream if e.type == "response.function_call_arguments.delta") == fc.arguments
    # previous_response_id: the stored conversation continues with the tool's result
    follow = client.responses.create(model="llm", previous_response_id=called.id, tools=tools, tool_choice="none",
                                     input=[{"type": "function_call_output", "call_id": fc.call_id,
                                             "output": "sunny"}], temperature=0, max_output_tokens=4)
    assert follow.previous_response_id == called.id and follow.usage.input_tokens > called.usage.input_tokens
    assert client.responses.retrieve(follow.id).output_text == follow.output_text
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="llm", previous_response_id="resp_unknown", input="x", max_output_tokens=2)
    wait_blocks_free(server)


@pytest.mark.parametrize("api", ["responses", "chat_completions"])
def test_agents_sdk_runs_a_function_tool_turn(frontend, server, api):
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)           # no network here: nothing to export traces to
    calls = []

    @agents.function_tool
    def get_weather(city: Literal["paris", "rome"]) -> str:
        """The weather in a city."""
        calls.append(city)
        return f"sunny in {city}"

    model_class = agents.OpenAIResponsesModel if api == "responses" else agents.OpenAIChatCompletionsModel
    model = model_class(model="llm", openai_client=openai.AsyncOpenAI(base_url=frontend + "/v1", api_key=API_KEY,
                                                                      max_retries=0))
    agent = agents.Agent(name="weather", instructions="Answer with the tool.", tools=[get_weather], model=model,
                         model_settings=agents.ModelSettings(tool_choice="required", parallel_tool_calls=False,
                                                             temperature=0, max_tokens=64),
                         tool_use_behavior="stop_on_first_tool")
    result = asyncio.run(agents.Runner.run(agent, "What is the weather in Paris?", max_turns=2))
    assert len(calls) == 1 and result.final_output == f"sunny in {calls[0]}"
    wait_blocks_free(server)
