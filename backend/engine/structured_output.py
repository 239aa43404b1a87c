"""Structured output: each guided request's grammar, compiled by xgrammar off the step
loop, enforced as a token bitmask in the batched sampler and advanced with every token.

- Compilation runs on COMPILE_THREADS worker threads (compile_pool.py; xgrammar releases
  the GIL while it compiles, and its compiler keeps a cache keyed by the grammar, so a
  repeated schema compiles once): one slow compile does not hold up the grammars behind
  it; the scheduler keeps the request waiting (WAITING_FOR_GRAMMAR:
  structured_output_manager.py) until its grammar is ready, and an invalid grammar fails
  that request alone with the compiler's message.
- A compile running longer than guided_compile_timeout_s fails its request alone, naming
  the limit (small specs can be slow: a JSON-schema pattern such as `(a|b){1,8000}`
  takes seconds to minutes in xgrammar 0.2.8); its thread is given up on and replaced, so
  the grammars queued behind it and every running stream go on. While
  MAX_ABANDONED_COMPILES such compiles still run, new guided requests are refused
  (UNAVAILABLE): each holds a CPU core until xgrammar returns.
- Each step, the rows of guided requests get their allowed-token bitmask (one
  [rows, vocab / 32] int32 buffer, filled on the host, uploaded in one copy) and the
  disallowed logits become -inf before the draw, greedy rows included.
- After the draw the request's matcher accepts the token; when the grammar is complete it
  allows only the stop token (EOS), whose acceptance ends the request.
- Preemption recomputes KV only: the matcher's state (the tokens accepted) stays valid.

xgrammar is imported lazily: the engine needs it only when a request asks for a grammar.
"""

from __future__ import annotations

import json
import os
import queue
import re
from typing import Optional, Sequence

import numpy as np
import torch

from backend.engine.buffers import StagedBuffer
from backend.engine.compile_pool import CompilePool, Job
from backend.engine.deadlines import Deadlines
from backend.engine.errors import InvalidRequestError, QueueFullError
from backend.sampling_params import SamplingParams

# Compiles past their time limit (or whose request ended) whose thread still runs: at
# this many, new guided requests are refused until one ends.
MAX_ABANDONED_COMPILES = 4
# Compiles at once: more than one, so a fast grammar never queues behind a slow one; at
# most half the cores (each compile holds one), and 4.
COMPILE_THREADS = min(4, max(2, (os.cpu_count() or 2) // 2))
# xgrammar's compiled-grammar cache, bounded (its default, -1, is unbounded: every distinct
# schema a client sends would stay in memory); least recently used first out.
GRAMMAR_CACHE_BYTES = 256 << 20


def _json_safe_row(info, vocab_size: int, width: int) -> torch.Tensor:
    """A bitmask row allowing every token except those holding a raw control character
    (U+0000-U+001F). xgrammar's JSON grammars let those into strings, where JSON forbids
    them (strict parsers such as Python's json reject the text); our JSON grammars have
    no free whitespace, so nothing valid needs them."""
    bits = np.ones(width * 32, dtype=np.uint32)
    for token_id, text in enumerate(info.decoded_vocab[:vocab_size]):
        if any(b < 0x20 for b in text):
            bits[token_id] = 0
    packed = (bits.reshape(width, 32) << np.arange(32, dtype=np.uint32)).sum(axis=1, dtype=np.uint32)
    return torch.from_numpy(packed.view(np.int32).copy())


def _choice_grammar(choices: list[str]) -> str:
    """EBNF whose only sentences are the choices (string literals, JSON-escaped)."""
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


class StructuredOutput:
    def __init__(self, tokenizer, vocab_size: int, device: torch.device, max_num_seqs: int) -> None:
        if tokenizer is None:
            raise InvalidRequestError("structured output needs the checkpoint's tokenizer, and this one has none")
        try:
            import xgrammar as xgr
        except ImportError:
            raise InvalidRequestError("structured output needs the xgrammar package (pip install xgrammar)") from None
        self.xgr = xgr
        self.vocab_size = vocab_size
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=True,
                                              cache_limit_bytes=GRAMMAR_CACHE_BYTES)
        self.pool = CompilePool(COMPILE_THREADS, "grammar")
        self._width = -(-vocab_size // 32)
        self._json_safe = _json_safe_row(info, vocab_size, self._width)
        self._device = device
        self._bitmask = StagedBuffer(max_num_seqs * self._width, torch.int32, device)

    # ------------------------------------------------------------- compilation
    def compile(self, params: SamplingParams, tag=None) -> Job:
        """A job whose future gives the compiled grammar; its exception is an
        InvalidRequestError naming the field. Raises QueueFullError while too many
        compiles given up on still run."""
        if self.pool.num_abandoned >= MAX_ABANDONED_COMPILES:
            raise QueueFullError(f"structured output is busy: {self.pool.num_abandoned} grammar compilations that "
                                 "ran past guided_compile_timeout_s (or whose request ended) are still running; "
                                 "retry later")
        (field,) = params.guided_fields()
        value = getattr(params, field)
        return self.pool.submit(self._compile, field, value, tag=tag)

    def _compile(self, field: str, value):
        c = self._compiler
        try:
            if field == "guided_json":
                return c.compile_json_schema(json.dumps(value), any_whitespace=False)
            if field == "guided_json_object":    # any JSON object (as vLLM does it)
                return c.compile_json_schema('{"type": "object"}', any_whitespace=False)
            if field == "guided_regex":
                return c.compile_regex(value)
            if field == "guided_choice":
                return c.compile_grammar(_choice_grammar(value))
            return c.compile_grammar(value)
        except Exception as e:  # the compiler's own words: what is wrong and where
            message = re.sub(r"^\[[\d:]+\] \S+: ", "", str(e).strip())
            raise InvalidRequestError(f"invalid {field}: {message}") from None

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    # ------------------------------------------------------------------ steps
    def bitmask(self, requests: Sequence) -> Optional[tuple[torch.Tensor, list[int]]]:
        """(device bitmask [R, vocab / 32], the rows it applies to) for this step's
        sampled requests, or None when none is guided. Host work: one fill per guided
        row, one upload."""
        rows = [i for i, r in enumerate(requests) if r.grammar is not None and r.reasoning_ended]
        if not rows:
            return None
        n = len(requests) * self._width
        if self._bitmask.np.shape[0] < n:
            self._bitmask = StagedBuffer(n, torch.int32, self._device)
        view = torch.from_numpy(self._bitmask.writable()[:n]).view(len(requests), self._width)
        for i in rows:
            requests[i].grammar.fill_next_token_bitmask(view, i)
            if requests[i].sampling_params.guided_json is not None or requests[i].sampling_params.guided_json_object:
                view[i] &= self._json_safe
        return self._bitmask.upload(n).view(len(requests), self._width), rows

    def apply(self, logits: torch.Tensor, mask: tuple[torch.Tensor, list[int]]) -> None:
        """Disallowed tokens of the guided rows to -inf, in place."""
        bitmask, rows = mask
        self.xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=self.vocab_size, indices=rows)


class AwaitingGrammar:
    """The compiles of guided requests that wait as WAITING_FOR_GRAMMAR (in the
    scheduler's waiting queue), for the StructuredOutputManager. Host work per step grows
    with the compiles that finished or came due, not with the number waiting: finished
    ones arrive on a queue, time limits sit in a heap."""

    def __init__(self, compile_timeout_s: float) -> None:
        self._items: dict[str, tuple[object, Job]] = {}
        self._done: "queue.SimpleQueue[Job]" = queue.SimpleQueue()
        self._timeouts: Deadlines[Job] = Deadlines()
        self.compile_timeout_s = compile_timeout_s

    def add(self, request, job: Job) -> None:
        self._items[request.request_id] = (request, job)
        job.future.add_done_callback(lambda _, j=job: self._done.put(j))

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._items

    def pop(self, structured: StructuredOutput, request_id: str):
        """The request, no longer awaited; its compile is cancelled or given up on."""
        request, job = self._items.pop(request_id)
        structured.pool.abandon(job)
        return request

    def ready(self, structured: StructuredOutput, now: float, wait_s: float = 0.0) -> tuple[list, list]:
        """(requests whose grammar is compiled, their matcher set; (request, error) for
        grammars that failed or ran past compile_timeout_s). Waits up to wait_s for a
        compile to finish when none has."""
        pool = structured.pool
        while True:                             # each started compile gets its time limit
            try:
                job = pool.started.get_nowait()
            except queue.Empty:
                break
            self._timeouts.push(job.started + self.compile_timeout_s, job)
        if len(self._timeouts) > 2 * len(self._items) + 64:
            self._timeouts.compact(self._awaits)
        admitted, failed = [], []
        for job in self._timeouts.pop_due(now):
            if self._awaits(job) and not job.future.done():
                request = self.pop(structured, job.tag.request_id)
                (field,) = request.sampling_params.guided_fields()
                failed.append((request, InvalidRequestError(
                    f"sampling parameter '{field}' did not compile within guided_compile_timeout_s="
                    f"{self.compile_timeout_s:g} s (an engine argument); simplify it: large counted repetitions "
                    "such as {1,5000} compile slowly")))
        finished = []
        try:
            finished.append(self._done.get(timeout=wait_s) if wait_s and self._items else self._done.get_nowait())
            while True:
                finished.append(self._done.get_nowait())
        except queue.Empty:
            pass
        for job in finished:
            if not self._awaits(job):           # aborted, or already failed on time
                continue
            request, _ = self._items.pop(job.tag.request_id)
            try:
                request.grammar = structured.matcher(job.future.result())
            except InvalidRequestError as e:
                failed.append((request, e))
                continue
            admitted.append(request)
        return admitted, failed

    def _awaits(self, job: Job) -> bool:
        item = self._items.get(job.tag.request_id)
        return item is not None and item[1] is job
