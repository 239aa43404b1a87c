"""Structured output: each guided request's grammar, compiled by xgrammar off the step
loop, enforced as a token bitmask in the batched sampler and advanced with every token.

- Compilation runs on a worker thread (xgrammar's compiler keeps a cache keyed by the
  grammar, so a repeated schema compiles once); the engine holds the request back from
  the scheduler until its grammar is ready, and an invalid grammar fails that request
  alone with the compiler's message.
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
import re
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Optional, Sequence

import numpy as np
import torch

from backend.engine.buffers import StagedBuffer
from backend.engine.errors import InvalidRequestError
from backend.sampling_params import SamplingParams


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
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=True)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar")
        self._width = -(-vocab_size // 32)
        self._json_safe = _json_safe_row(info, vocab_size, self._width)
        self._device = device
        self._bitmask = StagedBuffer(max_num_seqs * self._width, torch.int32, device)

    # ------------------------------------------------------------- compilation
    def compile(self, params: SamplingParams) -> Future:
        """A future of the compiled grammar; its exception is an InvalidRequestError
        naming the field."""
        (field,) = params.guided_fields()
        value = getattr(params, field)
        return self._pool.submit(self._compile, field, value)

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
        rows = [i for i, r in enumerate(requests) if r.grammar is not None]
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
    """Guided requests whose grammar is still compiling, held back from the scheduler."""

    def __init__(self) -> None:
        self._items: dict[str, tuple[object, Future]] = {}

    def add(self, request, future: Future) -> None:
        self._items[request.request_id] = (request, future)

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._items

    def pop(self, request_id: str):
        request, future = self._items.pop(request_id)
        future.cancel()
        return request

    def ready(self, structured: StructuredOutput, wait_s: float = 0.0) -> tuple[list, list]:
        """(requests whose grammar is compiled, their matcher set; (request, error) for
        grammars that failed). Waits up to wait_s for one to finish."""
        if wait_s and self._items:
            wait([f for _, f in self._items.values()], timeout=wait_s, return_when=FIRST_COMPLETED)
        admitted, failed = [], []
        for request_id, (request, future) in list(self._items.items()):
            if not future.done():
                continue
            del self._items[request_id]
            try:
                request.grammar = structured.matcher(future.result())
            except InvalidRequestError as e:
                failed.append((request, e))
                continue
            admitted.append(request)
        return admitted, failed
