"""The chat completion object and its stream's chunks: one choice per sequence, each read
by a ChoiceOutput (chat_output.py: reasoning, tool calls, content)."""

from __future__ import annotations

import time
import uuid
from typing import Callable, Optional

from frontend.openai_api.chat_output import ChoiceOutput
from frontend.openai_api.completions import FINISH, _json_logprob
from frontend.openai_api.tools.choice import ToolPlan
from frontend.openai_api.triton_client import Delta


class Shape:
    """Accumulates one completion's deltas and writes the OpenAI objects."""
    object_name = chunk_name = ""

    def __init__(self, req) -> None:
        self.req = req
        self.id = f"{self.prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.texts = [""] * req.n
        self.token_logprobs: list[list] = [[] for _ in range(req.n)]
        self.finish: list[Optional[str]] = [None] * req.n
        self.prompt_tokens = 0
        self.completion_tokens = [0] * req.n

    def base(self, chunk: bool = True) -> dict:
        return {"id": self.id, "object": self.chunk_name if chunk else self.object_name, "created": self.created,
                "model": self.req.model}

    def add(self, d: Delta) -> None:
        self.texts[d.index] += d.text
        self.token_logprobs[d.index] += list(zip(d.token_ids, d.logprobs))
        if d.finish_reason is not None:
            self.finish[d.index] = FINISH.get(d.finish_reason, d.finish_reason)
        self.prompt_tokens = d.num_input_tokens
        self.completion_tokens[d.index] += len(d.token_ids)     # a stream's responses carry deltas

    def usage(self) -> dict:
        done = sum(self.completion_tokens)
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": done,
                "total_tokens": self.prompt_tokens + done}

    def opening(self) -> list[dict]:
        return []


def _top(entry: dict, k: int) -> list[tuple[str, float]]:
    """The k most likely tokens of one position: (decoded text, logprob), by rank."""
    ranked = sorted(entry.values(), key=lambda lp: lp["rank"])
    return [(lp["decoded_token"] or "", _json_logprob(lp["logprob"])) for lp in ranked[:k]]


class ChatCompletion(Shape):
    prefix, object_name, chunk_name = "chatcmpl", "chat.completion", "chat.completion.chunk"

    def __init__(self, req, output: Callable[[], ChoiceOutput] = ChoiceOutput,
                 tool_plan: Optional[ToolPlan] = None) -> None:
        super().__init__(req)
        self.output = output                    # a fresh reader of one choice's text
        self.outputs = [output() for _ in range(req.n)]
        self.tool_plan = tool_plan

    def _logprobs(self, pairs: list) -> Optional[dict]:
        if not self.req.logprobs:
            return None
        k = self.req.top_logprobs or 0

        def item(text: str, lp: float) -> dict:
            return {"token": text, "logprob": lp, "bytes": list(text.encode())}
        content = []
        for token_id, entry in pairs:
            chosen = entry[str(token_id)]
            content.append({**item(chosen["decoded_token"] or "", _json_logprob(chosen["logprob"])),
                            "top_logprobs": [item(t, lp) for t, lp in _top(entry, k)]})
        return {"content": content}

    def _finish(self, index: int, output: ChoiceOutput) -> Optional[str]:
        finish = self.finish[index]
        if finish == "stop" and output.called and self.tool_plan is not None:
            return self.tool_plan.finish_reason
        return finish

    def _legacy(self, fields: dict) -> dict:
        """`functions` were sent: one call, as `function_call` (OpenAI's legacy shape)."""
        if self.tool_plan is None or not self.tool_plan.legacy or "tool_calls" not in fields:
            return fields
        calls = fields.pop("tool_calls")
        first = [c["function"] for c in calls if c.get("index", 0) == 0 or "index" not in c]
        if first:
            fields["function_call"] = {k: v for f in first for k, v in f.items()}
        return fields

    def opening(self) -> list[dict]:
        return [{**self.base(), "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                             "logprobs": None, "finish_reason": None} for i in range(self.req.n)]}]

    def chunk(self, d: Delta) -> dict:
        output = self.outputs[d.index]
        if output.plain:
            delta = {"content": d.text} if d.text else {}
        else:
            delta = self._legacy(output.delta(self.texts[d.index], self.finish[d.index] is not None))
        return {**self.base(), "choices": [{"index": d.index, "delta": delta,
                                            "logprobs": self._logprobs(list(zip(d.token_ids, d.logprobs))),
                                            "finish_reason": self._finish(d.index, output)}]}

    def whole(self) -> dict:
        choices = []
        for i in range(self.req.n):
            output = self.output()
            message = {"role": "assistant", "content": self.texts[i]} if output.plain else \
                self._legacy(output.message(self.texts[i]))
            choices.append({"index": i, "message": message, "logprobs": self._logprobs(self.token_logprobs[i]),
                            "finish_reason": self._finish(i, output)})
        return {**self.base(chunk=False), "usage": self.usage(), "choices": choices}
