"""`POST /v1/responses` (OpenAI's Responses API) and `GET /v1/responses/{id}`, on the
chat path: the input items become chat messages (responses_protocol.py), the reply is read
by the same reasoning and tool-call parsers (chat_output.py), and comes back as output
items (reasoning, message, function_call), or streamed as the API's typed events.

With `store` (the default), a reply and its conversation are kept, up to the server's
`responses_store_size` entries and `responses_store_bytes` in all (oldest dropped first;
0 keeps none), so that a later request can continue it with `previous_response_id`. An
entry is counted at the memory of its objects (entry_bytes: the response and the whole
conversation through it, though a continued conversation shares its earlier messages with
the entry it continues: an upper bound); one larger than the whole budget is not kept (a
later request naming it gets the usual 404).
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import time
import uuid
from collections import OrderedDict
from typing import AsyncIterator, Optional

from fastapi import FastAPI, Request
from fastapi.responses import Response

from frontend.openai_api.chat_content import checked_images
from frontend.openai_api.chat_output import ChoiceOutput
from frontend.openai_api.closing_stream import ClosingStreamingResponse, first_delta
from frontend.openai_api.embeddings import check_generates
from frontend.openai_api.errors import APIError, error_body
from frontend.openai_api.request_body import read_request
from frontend.openai_api.reasoning import reasoning_sampling
from frontend.openai_api.responses_protocol import ResponsesRequest, for_template, input_messages
from frontend.openai_api.tools.choice import plan
from frontend.openai_api.triton_client import ClientDisconnected, cancelled_on_disconnect

log = logging.getLogger("frontend")


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


DEFAULT_RESPONSES_STORE_BYTES = 64 * 1024 * 1024


def entry_bytes(response: dict, conversation: list[dict]) -> int:
    """A stored entry's memory: every dict, list and value in it at sys.getsizeof (linear
    in it). The length of its JSON, counted before, missed the objects themselves: a
    conversation of many small items took about 7x it. Dict keys are left out: field
    names, shared among the dicts that a request's JSON was decoded into."""
    total, stack = 0, [response, conversation]
    while stack:
        value = stack.pop()
        total += sys.getsizeof(value)
        if isinstance(value, dict):
            stack.extend(value.values())
        elif isinstance(value, (list, tuple)):
            stack.extend(value)
    return total


class ResponseStore:
    """Stored replies by id: (the conversation through the reply, the response object),
    at most `size` of them and `max_bytes` (entry_bytes) in all, oldest dropped first."""

    def __init__(self, size: int, max_bytes: int = DEFAULT_RESPONSES_STORE_BYTES) -> None:
        self.size, self.max_bytes = size, max_bytes
        self.bytes = 0                  # the stored entries' entry_bytes, summed
        self._items: OrderedDict[str, tuple[list[dict], dict, int]] = OrderedDict()

    @property
    def off(self) -> bool:
        return self.size <= 0 or self.max_bytes <= 0

    def put(self, response: dict, conversation: list[dict]) -> None:
        if self.off:
            return
        self._drop(response["id"])
        cost = entry_bytes(response, conversation)
        if cost > self.max_bytes:
            log.info("response %s is not stored: %d bytes is more than responses_store_bytes (%d)",
                     response["id"], cost, self.max_bytes)
            return
        self._items[response["id"]] = (conversation, response, cost)
        self.bytes += cost
        while len(self._items) > self.size or self.bytes > self.max_bytes:
            self._drop(next(iter(self._items)))

    def _drop(self, response_id: str) -> None:
        entry = self._items.pop(response_id, None)
        if entry is not None:
            self.bytes -= entry[2]

    def __len__(self) -> int:
        return len(self._items)

    def get(self, response_id: str, param: str) -> tuple[list[dict], dict]:
        if self.off:
            raise APIError(400, "this server keeps no responses (started with --responses-store-size 0 or "
                                "--responses-store-bytes 0)", param)
        if response_id not in self._items:
            raise APIError(404, f"no stored response with id '{response_id}'", param)
        conversation, response, _ = self._items[response_id]
        return conversation, response


def _message_item() -> dict:
    return {"type": "message", "id": _id("msg"), "role": "assistant", "status": "in_progress",
            "content": [{"type": "output_text", "text": "", "annotations": [], "logprobs": []}]}


class ResponseBuilder:
    """One reply's output items, built from the chat deltas of ChoiceOutput, with the
    events that announce them (the same items whether streamed or not)."""

    def __init__(self, req: ResponsesRequest, tool_plan) -> None:
        self.req, self.tool_plan = req, tool_plan
        self.id, self.created = _id("resp"), int(time.time())
        self.items: list[dict] = []
        self.open: Optional[dict] = None            # the item still growing
        self.calls: dict[int, dict] = {}            # tool-call index -> its item
        self.sequence = 0
        self.input_tokens = self.output_tokens = 0
        self.status = "in_progress"                 # completed or incomplete once finished

    def event(self, kind: str, **fields) -> dict:
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return event

    def _close(self) -> list[dict]:
        item, self.open = self.open, None
        if item is None:
            return []
        index = self.items.index(item)
        item["status"] = "completed"
        events = []
        if item["type"] == "message":
            part = item["content"][0]
            events += [self.event("response.output_text.done", item_id=item["id"], output_index=index,
                                   content_index=0, text=part["text"], logprobs=[]),
                       self.event("response.content_part.done", item_id=item["id"], output_index=index,
                                   content_index=0, part=part)]
        elif item["type"] == "reasoning":
            events.append(self.event("response.reasoning_text.done", item_id=item["id"], output_index=index,
                                      content_index=0, text=item["content"][0]["text"]))
        elif item["type"] == "function_call":
            events.append(self.event("response.function_call_arguments.done", item_id=item["id"],
                                      output_index=index, name=item["name"], arguments=item["arguments"]))
        return events + [self.event("response.output_item.done", output_index=index, item=item)]

    def _start(self, item: dict) -> list[dict]:
        events = self._close()
        self.items.append(item)
        self.open = item
        index = len(self.items) - 1
        events.append(self.event("response.output_item.added", output_index=index, item=dict(item)))
        if item["type"] == "message":
            events.append(self.event("response.content_part.added", item_id=item["id"], output_index=index,
                                      content_index=0, part={"type": "output_text", "text": "", "annotations": []}))
        return events

    def feed(self, delta: dict) -> list[dict]:
        """Events for one chat delta (reasoning_content, content, tool_calls pieces)."""
        events: list[dict] = []
        if delta.get("reasoning_content"):
            if self.open is None or self.open["type"] != "reasoning":
                events += self._start({"type": "reasoning", "id": _id("rs"), "summary": [], "status": "in_progress",
                                       "content": [{"type": "reasoning_text", "text": ""}]})
            self.open["content"][0]["text"] += delta["reasoning_content"]
            events.append(self.event("response.reasoning_text.delta", item_id=self.open["id"],
                                      output_index=len(self.items) - 1, content_index=0,
                                      delta=delta["reasoning_content"]))
        if delta.get("content"):
            if self.open is None or self.open["type"] != "message":
                events += self._start(_message_item())
            self.open["content"][0]["text"] += delta["content"]
            events.append(self.event("response.output_text.delta", item_id=self.open["id"],
                                      output_index=len(self.items) - 1, content_index=0, delta=delta["content"],
                                      logprobs=[]))
        for call in delta.get("tool_calls", []):
            if "id" in call:
                events += self._start({"type": "function_call", "id": _id("fc"), "call_id": call["id"],
                                       "name": call["function"]["name"], "arguments": "", "status": "in_progress"})
                self.calls[call["index"]] = self.open
            item = self.calls[call["index"]]
            piece = call["function"].get("arguments", "")
            if piece:
                item["arguments"] += piece
                events.append(self.event("response.function_call_arguments.delta", item_id=item["id"],
                                          output_index=self.items.index(item), delta=piece))
        return events

    def finish(self, finish_reason: Optional[str]) -> list[dict]:
        events = self._close()
        if not self.items:                          # an empty reply is still a message
            events += self._start(_message_item()) + self._close()
        self.status = "incomplete" if finish_reason == "length" else "completed"
        kind = "response.incomplete" if self.status == "incomplete" else "response.completed"
        return events + [self.event(kind, response=self.response())]

    def response(self) -> dict:
        req, status = self.req, self.status
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "model": req.model, "output": self.items if status != "in_progress" else [],
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": req.instructions, "metadata": req.metadata or {},
            "parallel_tool_calls": req.parallel_tool_calls, "temperature": req.temperature, "top_p": req.top_p,
            "tool_choice": self.tool_plan.tool_choice if self.tool_plan.tools else "none",
            "tools": req.tools or [], "max_output_tokens": req.max_output_tokens,
            "previous_response_id": req.previous_response_id, "store": req.store,
            "reasoning": req.reasoning, "text": {"format": {"type": "text"}} if req.text is None
            else req.text.model_dump(by_alias=True, exclude_none=True), "truncation": req.truncation,
            "user": req.user,
            "usage": {"input_tokens": self.input_tokens, "input_tokens_details": {"cached_tokens": 0},
                      "output_tokens": self.output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                      "total_tokens": self.input_tokens + self.output_tokens}}

    def conversation_tail(self) -> list[dict]:
        """The reply as chat messages, for a later previous_response_id."""
        text = "".join(i["content"][0]["text"] for i in self.items if i["type"] == "message")
        calls = [{"id": i["call_id"], "type": "function", "function": {"name": i["name"], "arguments": i["arguments"]}}
                 for i in self.items if i["type"] == "function_call"]
        return [{"role": "assistant", "content": text or None, **({"tool_calls": calls} if calls else {})}]


def register_responses(app: FastAPI) -> None:
    store = ResponseStore(app.state.responses_store_size, app.state.responses_store_bytes)
    app.state.responses_store = store

    @app.post("/v1/responses")
    async def create_response(request: Request):
        req = await read_request(request, ResponsesRequest, app.state.max_request_body_bytes)
        served = await app.state.llm.model(req.model)
        check_generates(served)
        conversation: list[dict] = []
        if req.previous_response_id is not None:
            conversation = list(store.get(req.previous_response_id, "previous_response_id")[0])
        conversation += input_messages(req.input)
        system = [{"role": "system", "content": req.instructions}] if req.instructions else []
        sampling = req.sampling_parameters()
        tools, tool_choice = req.chat_tools()
        tool_plan = plan(tools, tool_choice, req.parallel_tool_calls, app.state.tool_config,
                         guided=any(k.startswith("guided_") for k in sampling))
        if tool_plan.guided_json is not None:
            sampling["guided_json"] = tool_plan.guided_json
        messages, images = for_template(system + conversation)
        images = await app.state.media.inline(checked_images(images, served.accepts_images, req.model,
                                                              app.state.media.allowed_domains))
        text, ids = await asyncio.to_thread(lambda: app.state.chat.render(   # a thread: long inputs take seconds
            served.checkpoint, req.model, messages, tool_plan.tools, req.chat_template_kwargs, served.max_model_len))
        reasoning = app.state.reasoning_parser
        if reasoning is not None:
            reasoning_sampling(reasoning(text), sampling, app.state.chat.tokenizer(served.checkpoint, req.model))
        output = ChoiceOutput(reasoning(text) if reasoning else None, tool_plan.parser(app.state.tool_config))
        builder = ResponseBuilder(req, tool_plan)
        gen = app.state.llm.generate(req.model, ids, sampling, req.stream, False, images)
        deltas = gen.__aiter__()

        def stored() -> None:
            if req.store:
                store.put(builder.response(), conversation + builder.conversation_tail())

        if not req.stream:
            return await _whole(request, gen, deltas, output, builder, stored)
        try:
            first = await first_delta(request, gen, deltas)
        except ClientDisconnected:
            log.info("client disconnected before the first token of %s; its request was cancelled", builder.id)
            return Response(status_code=499)
        return ClosingStreamingResponse(_events(gen, deltas, first, output, builder, stored),
                                        media_type="text/event-stream")

    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(response_id: str) -> dict:
        return store.get(response_id, "response_id")[1]


async def _whole(request: Request, gen, deltas, output: ChoiceOutput, builder: ResponseBuilder, stored):
    text, finish = "", None
    try:
        async with cancelled_on_disconnect(request, gen):
            async for d in deltas:
                text += d.text
                builder.input_tokens = d.num_input_tokens
                builder.output_tokens += len(d.token_ids)
                finish = d.finish_reason or finish
    except ClientDisconnected:          # one line, as the chat API logs it
        log.info("client disconnected before the answer to %s; its request was cancelled", builder.id)
        return Response(status_code=499)
    builder.feed(output.delta(text, final=True))
    builder.finish(finish)
    stored()
    return builder.response()


async def _events(gen, deltas, first, output: ChoiceOutput, builder: ResponseBuilder,
                  stored) -> AsyncIterator[str]:
    def sse(events: list[dict]) -> str:
        return "".join(f"event: {e['type']}\ndata: {json.dumps(e)}\n\n" for e in events)

    text = ""
    try:
        yield sse([builder.event("response.created", response=builder.response()),
                   builder.event("response.in_progress", response=builder.response())])

        async def all_deltas():
            if first is not None:
                yield first
            async for d in deltas:
                yield d
        async for d in all_deltas():
            text += d.text
            builder.input_tokens = d.num_input_tokens
            builder.output_tokens += len(d.token_ids)
            events = builder.feed(output.delta(text, final=d.finish_reason is not None))
            if d.finish_reason is not None:
                events += builder.finish(d.finish_reason)
                stored()
            if events:
                yield sse(events)
    except ClientDisconnected:  # cancelled as the first token came: nobody is reading
        return
    except APIError as e:                           # after the 200: an error event, as OpenAI does
        body = error_body(e.status, e.message, e.param)["error"]
        yield sse([builder.event("error", code=str(body["code"]), message=body["message"], param=body["param"])])
    finally:
        gen.cancel()
