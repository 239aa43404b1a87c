"""/v1/completions as OpenAI and vLLM shape it, for evaluation harnesses too:

- `prompt` as a string, token ids, or a list of either: one Triton request per prompt,
  run concurrently; choice index = prompt index * n + i; usage summed over the prompts.
- `echo`: each choice's text starts with its prompt (given text, or the token ids
  decoded); with `logprobs`, the prompt tokens' entries come first, the first one null
  (nothing predicts it), from the engine's prompt logprobs. `max_tokens: 0` with echo
  returns the prompt alone (the engine generates one token, dropped, as vLLM does), which
  is what lm-evaluation-harness' loglikelihood requests send.
- `logprobs: k`: `top_logprobs` hold the chosen token and the k most likely (up to k + 1
  entries, as OpenAI and vLLM); k = 0 gives the chosen token's entry.
- `prompt_logprobs` (vLLM's extra): each choice's `prompt_logprobs`, vLLM's list.

Echo with logprobs needs the prompt's token ids (to read the prompt token's entry at each
position) and the first token's text: the frontend tokenizes a text prompt itself with
the checkpoint's tokenizer, as the backend would, and sends the ids.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, replace
from typing import AsyncIterator, Optional, Union

from frontend.openai_api.errors import APIError
from frontend.openai_api.protocol import CompletionRequest
from frontend.openai_api.tokenization import tokenize_or_400
from frontend.openai_api.triton_client import Delta, Generation

FINISH = {"stop": "stop", "length": "length", "abort": "stop"}
Prompt = Union[str, list[int]]


@dataclass
class PromptInfo:
    """One prompt as sent, and what echo needs of it."""
    prompt: Prompt                      # what goes to Triton: text, or token ids
    echo_text: str = ""
    token_ids: Optional[list[int]] = None
    first_token_text: str = ""


def prompts_of(prompt) -> list[Prompt]:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise APIError(400, "invalid 'prompt': it is empty", "prompt")
    if isinstance(prompt[0], int):
        return [list(prompt)]
    return list(prompt)


def _json_logprob(value: Optional[float]) -> Optional[float]:
    """JSON has no -inf: vLLM's OpenAI server sends -9999.0 for a token of probability 0."""
    return None if value is None else max(value, -9999.0)


async def start(state, req: CompletionRequest) -> tuple["BatchGeneration", "Completion", dict]:
    """The Triton requests of a completion, its shape, and the sampling parameters sent."""
    if req.max_tokens == 0 and not req.echo:
        raise APIError(400, "invalid 'max_tokens': 0 needs echo (it returns the prompt alone)", "max_tokens")
    prompts = prompts_of(req.prompt)
    served = await state.llm.model(req.model)
    served.check_n(req.n)
    total, queue = req.n * len(prompts), served.max_queue_size
    if queue is not None and total > queue:
        raise APIError(400, f"invalid 'prompt': {len(prompts)} prompts x n={req.n} is {total} sequences, more than "
                            f"model '{req.model}' can queue (max_queue_size={queue})", "prompt")
    sampling = req.sampling_parameters(1 if req.max_tokens == 0 else req.max_tokens)
    if req.logprobs is not None:
        sampling["logprobs"] = req.logprobs
    prompt_k = req.prompt_logprobs
    if prompt_k is None and req.echo and req.logprobs is not None:
        prompt_k = req.logprobs             # vLLM's rule: echo's prompt entries at logprobs' k
    if prompt_k is not None:
        sampling["prompt_logprobs"] = prompt_k
    infos = [PromptInfo(p) for p in prompts]
    if req.echo:
        need_ids = req.logprobs is not None
        if need_ids or any(not isinstance(p, str) for p in prompts):
            tokenizer = await asyncio.to_thread(state.chat.tokenizer, served.checkpoint, req.model, "echo", "echo")
            infos = await asyncio.to_thread(_echo_infos, tokenizer, prompts, need_ids, served.max_model_len)
        else:
            infos = [PromptInfo(p, echo_text=p) for p in prompts]
    gens = [state.llm.generate(req.model, info.prompt, sampling, req.stream, req.logprobs is not None)
            for info in infos]
    hold = req.stream and req.echo and prompt_k is not None
    return BatchGeneration(gens, req.n, hold), Completion(req, infos), sampling


def _echo_infos(tokenizer, prompts: list[Prompt], need_ids: bool,
                max_model_len: Optional[int] = None) -> list[PromptInfo]:
    """A text prompt too long for max_model_len is refused after tokenizing about that
    many tokens of it (prompt_length.py), not all of it: the backend would refuse it too."""
    infos = []
    for p in prompts:
        if isinstance(p, str):
            ids = tokenize_or_400(tokenizer.encode, p, max_model_len, "prompt") if need_ids else None  # as the backend
            text = p
        else:
            ids, text = p, tokenizer.decode(p)
        first = tokenizer.decode(ids[:1]) if ids else ""
        infos.append(PromptInfo(ids if ids is not None else p, text, ids, first))
    return infos


class BatchGeneration:
    """The Triton requests of one completion's prompts as one stream of deltas, each
    indexed by its choice (prompt index * n + sequence index). `hold`: a choice's deltas
    wait for its prompt's logprobs (a stream's echo sends them first; another sequence of
    the prompt computes them)."""

    def __init__(self, gens: list[Generation], n: int, hold: bool) -> None:
        self.gens, self.n, self.hold = gens, n, hold
        self._tasks: list[asyncio.Task] = []

    def cancel(self) -> None:
        """Ends every Triton request; each pump then hands its ClientDisconnected (or end)
        to the iteration, which raises it (cancelling the pumps too would leave the
        iteration waiting on a queue no one fills)."""
        for g in self.gens:
            g.cancel()

    def _close(self) -> None:
        self.cancel()
        for t in self._tasks:
            t.cancel()

    async def __aiter__(self) -> AsyncIterator[Delta]:
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(p: int, gen: Generation) -> None:
            try:
                async for d in gen:
                    await queue.put((p, d, None))
                await queue.put((p, None, None))
            except asyncio.CancelledError:
                raise
            except Exception as e:      # an APIError: the whole completion fails with it
                await queue.put((p, None, e))

        self._tasks = [asyncio.create_task(pump(p, g)) for p, g in enumerate(self.gens)]
        remaining = len(self.gens)
        known = [False] * len(self.gens)
        held: list[list[Delta]] = [[] for _ in self.gens]
        try:
            while remaining:
                p, d, error = await queue.get()
                if error is not None:
                    raise error
                if d is None:
                    remaining -= 1
                    continue
                d = replace(d, index=p * self.n + d.index)
                if self.hold and not known[p]:
                    if d.prompt_logprobs is None:
                        held[p].append(d)
                        continue
                    known[p] = True
                    yield d
                    for waiting in held[p]:
                        yield waiting
                    held[p] = []
                    continue
                yield d
            for rest in held:
                for d in rest:
                    yield d
        finally:
            self._close()


class Completion:
    """Accumulates the deltas of a completion's choices and writes the OpenAI objects
    (the interface app.py's _respond and _events use)."""
    object_name = chunk_name = "text_completion"

    def __init__(self, req: CompletionRequest, prompts: list[PromptInfo]) -> None:
        self.req, self.prompts = req, prompts
        self.id = f"cmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())
        count = len(prompts) * req.n
        self.texts = [""] * count
        self.pairs: list[list] = [[] for _ in range(count)]      # (token id, entry) per generated token
        self.finish: list[Optional[str]] = [None] * count
        self.completion_tokens = [0] * count
        self.prompt_tokens = [0] * len(prompts)
        self.prompt_logprobs: list[Optional[list]] = [None] * len(prompts)
        self._echoed = [False] * count
        # max_tokens 0: the engine's one token is not part of the answer.
        self._drop_generated = req.echo and req.max_tokens == 0

    def base(self, chunk: bool = True) -> dict:
        return {"id": self.id, "object": self.object_name, "created": self.created, "model": self.req.model}

    def add(self, d: Delta) -> None:
        p = d.index // self.req.n
        if d.prompt_logprobs is not None:
            self.prompt_logprobs[p] = d.prompt_logprobs
        self.prompt_tokens[p] = d.num_input_tokens
        if d.finish_reason is not None:
            self.finish[d.index] = FINISH.get(d.finish_reason, d.finish_reason)
        if self._drop_generated:
            return
        self.texts[d.index] += d.text
        self.pairs[d.index] += list(zip(d.token_ids, d.logprobs))
        self.completion_tokens[d.index] += len(d.token_ids)     # a stream's responses carry deltas

    def usage(self) -> dict:
        prompt, done = sum(self.prompt_tokens), sum(self.completion_tokens)
        return {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done}

    def opening(self) -> list[dict]:
        return []

    # ----------------------------------------------------------------- logprobs
    def _top(self, entry: dict, chosen: str) -> dict[str, float]:
        """The chosen token and the k most likely: up to k + 1 entries, chosen first."""
        ranked = sorted(entry.items(), key=lambda item: (item[0] != chosen, item[1]["rank"]))
        top: dict[str, float] = {}
        for _, lp in ranked[:self.req.logprobs + 1]:
            top.setdefault(lp["decoded_token"] or "", _json_logprob(lp["logprob"]))
        return top

    def _prompt_positions(self, p: int) -> list[tuple[str, Optional[float], Optional[dict]]]:
        info, entries = self.prompts[p], self.prompt_logprobs[p] or []
        out: list[tuple[str, Optional[float], Optional[dict]]] = [(info.first_token_text, None, None)]
        for token_id, entry in zip((info.token_ids or [])[1:], entries[1:]):
            chosen = entry[str(token_id)]
            out.append((chosen["decoded_token"] or "", _json_logprob(chosen["logprob"]), self._top(entry, str(token_id))))
        return out

    def _logprobs(self, i: int, pairs: list, offset: int, echo: bool) -> Optional[dict]:
        if self.req.logprobs is None:
            return None
        positions = self._prompt_positions(i // self.req.n) if echo else []
        for token_id, entry in pairs:
            chosen = entry[str(token_id)]
            positions.append((chosen["decoded_token"] or "", _json_logprob(chosen["logprob"]),
                              self._top(entry, str(token_id))))
        out: dict = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for text, lp, top in positions:
            out["tokens"].append(text)
            out["token_logprobs"].append(lp)
            out["top_logprobs"].append(top)
            out["text_offset"].append(offset)
            offset += len(text)
        return out

    def _echo_text(self, i: int) -> str:
        return self.prompts[i // self.req.n].echo_text

    # ----------------------------------------------------------------- objects
    def chunk(self, d: Delta) -> dict:
        i = d.index
        echo = self.req.echo and not self._echoed[i]
        self._echoed[i] = self._echoed[i] or self.req.echo
        text, pairs = ("", []) if self._drop_generated else (d.text, list(zip(d.token_ids, d.logprobs)))
        offset = len(self.texts[i]) - len(text)
        if self.req.echo:
            offset += len(self._echo_text(i))
        if echo:
            text, offset = self._echo_text(i) + text, 0
        return {**self.base(), "choices": [{"index": i, "text": text, "finish_reason": self.finish[i],
                                            "logprobs": self._logprobs(i, pairs, offset, echo)}]}

    def whole(self) -> dict:
        choices = []
        for i in range(len(self.texts)):
            choice = {"index": i, "text": (self._echo_text(i) if self.req.echo else "") + self.texts[i],
                      "finish_reason": self.finish[i], "logprobs": self._logprobs(i, self.pairs[i], 0, self.req.echo)}
            if self.req.prompt_logprobs is not None:
                choice["prompt_logprobs"] = _clamped(self.prompt_logprobs[i // self.req.n])
            choices.append(choice)
        return {**self.base(chunk=False), "usage": self.usage(), "choices": choices}


def _clamped(entries: Optional[list]) -> Optional[list]:
    """vLLM's prompt_logprobs in JSON: -inf as -9999.0."""
    if entries is None:
        return None
    return [None if e is None else {t: {**lp, "logprob": _json_logprob(lp["logprob"])} for t, lp in e.items()}
            for e in entries]
