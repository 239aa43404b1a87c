"""Structured output: each guided request's grammar, compiled by xgrammar off the step
loop, enforced as a token bitmask in the batched sampler and advanced with every token.

- Compilation runs on COMPILE_THREADS worker threads (compile_pool.py), each sending its
  work to a child process of its own (grammar_process.py); compiled grammars are kept
  for reuse in a cache bounded in bytes (grammar_cache.py), so a repeated schema
  compiles once. One slow compile does not hold up the grammars behind it: past
  FAST_COMPILE_S it is stopped and started again in a slow lane of its own; the
  scheduler keeps the request waiting (WAITING_FOR_GRAMMAR:
  structured_output_manager.py) until its grammar is ready, and an invalid grammar
  fails that request alone with the compiler's message.
- A compile running longer than guided_compile_timeout_s fails its request alone, naming
  the limit (small specs can be slow: a JSON-schema pattern such as `(a|b){1,8000}`
  takes seconds to minutes in xgrammar 0.2.8), and its process is killed: its core is
  free at once, and the grammars queued behind it and every running stream go on. (On
  threads alone, six such schemas held every core for about 130 s.) Should
  MAX_ABANDONED_COMPILES compiles given up on still run anyway, new guided requests are
  refused (UNAVAILABLE) until one ends.
- Each step, the rows of guided requests get their allowed-token bitmask (one
  [rows, vocab / 32] int32 buffer, filled on the host, uploaded in one copy) and the
  disallowed logits become -inf before the draw, greedy rows included.
- After the draw the request's matcher accepts the token; when the grammar is complete it
  allows only the stop token (EOS), whose acceptance ends the request.
- Preemption recomputes KV only: the matcher's state (the tokens accepted) stays valid.

xgrammar is imported lazily: the engine needs it only when a request asks for a grammar.
"""

from __future__ import annotations

import logging
import os
import queue
import weakref
from typing import Optional, Sequence

import numpy as np
import torch

from backend.engine.runner.buffers import StagedBuffer
from backend.engine.structured_output.compile_pool import CompilePool, Job, current_job, in_slow_lane
from backend.engine.structured_output.grammar_cache import GrammarCache, cache_key
from backend.engine.structured_output.grammar_process import CompileKilled, GrammarProcess, GrammarProcesses, compile_spec
from backend.engine.deadlines import Deadlines
from backend.engine.errors import InvalidRequestError, QueueFullError
from backend.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# Compiles past their time limit (or whose request ended) whose thread still runs: at
# this many, new guided requests are refused until one ends.
MAX_ABANDONED_COMPILES = 4
# Compiles at once in the fast lane (compile_pool.py): more than one; at most half the
# cores (each compile holds one), and 4. A compile still running after FAST_COMPILE_S
# there starts again in the slow lane, on SLOW_COMPILE_THREADS threads of its own: so a
# grammar waits behind others' compiles for about FAST_COMPILE_S at most, however slow
# they are (issue 49 item 9).
COMPILE_THREADS = min(4, max(2, (os.cpu_count() or 2) // 2))
SLOW_COMPILE_THREADS = COMPILE_THREADS      # (slow compiles share cores among themselves as before)
FAST_COMPILE_S = 0.05
SLOW_LANE_NICE = 10
# Compiled grammars kept for reuse (grammar_cache.py), least recently used first out.
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


def _close(pool: CompilePool, processes: GrammarProcesses) -> None:
    pool.shutdown()
    processes.close()


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
        self._info = info
        self._fallback = None
        self._cache = GrammarCache(GRAMMAR_CACHE_BYTES)
        self._processes = GrammarProcesses(info.serialize_json())
        self.pool = CompilePool(COMPILE_THREADS, "grammar", initializer=self._lane_process,
                                fast_s=FAST_COMPILE_S, slow_size=SLOW_COMPILE_THREADS)
        self._finalizer = weakref.finalize(self, _close, self.pool, self._processes)
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
        """On a compile thread: the cached grammar, or one compiled in this thread's
        process, which abandon() kills (current_job().interrupt)."""
        key = cache_key(field, value)
        compiled = self._cache.get(key)
        if compiled is not None:
            return compiled
        proc = self._process()
        if proc is None:                        # no process starts here: this thread compiles
            compiled = compile_spec(self._fallback, field, value)
        else:
            job = current_job()
            if job is not None:
                job.interrupt = proc.kill
                if job.abandoned:               # given up on before it could be interrupted
                    proc.kill()
            try:
                compiled = self.xgr.CompiledGrammar.deserialize_json(proc.compile(field, value), self._info)
            except CompileKilled:
                self._processes.discard(proc)
                raise
        self._cache.put(key, compiled, compiled.memory_size_bytes)
        return compiled

    def _process(self) -> Optional[GrammarProcess]:
        """This thread's compile process; None once processes have failed to start. Then
        compiles run on the threads themselves, where one past its limit cannot be stopped
        (MAX_ABANDONED_COMPILES bounds those)."""
        if self._fallback is None:
            try:
                return self._lane_process()
            except CompileKilled:
                raise                           # shutting down, or a process not ready (killed)
            except Exception as e:
                logger.error("grammar compile processes cannot start (%r); compiling on threads instead", e)
                self._fallback = self.xgr.GrammarCompiler(self._info, max_threads=1, cache_enabled=False)
        return None

    def _lane_process(self) -> GrammarProcess:
        """This thread's process: the slow lane's run at a lower CPU priority, so that the
        compiles moved there (and the engine) yield the cores to the fast lane's."""
        return self._processes.current(SLOW_LANE_NICE if in_slow_lane() else 0)

    def close(self) -> None:
        """Ends the compile threads and processes (also when the object is collected)."""
        self._finalizer()

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    # ------------------------------------------------------------------ steps
    def bitmask(self, num_rows: int, guided: Sequence[tuple[int, object]]) -> tuple[torch.Tensor, list[int]]:
        """(device bitmask [num_rows, vocab / 32], the rows it applies to) for a step's
        sampled rows, filled for the `guided` ones: (row, its request, whose grammar
        applies). Host work: one fill per guided row, one upload."""
        n = num_rows * self._width
        if self._bitmask.np.shape[0] < n:
            self._bitmask = StagedBuffer(n, torch.int32, self._device)
        view = torch.from_numpy(self._bitmask.writable()[:n]).view(num_rows, self._width)
        for i, request in guided:
            request.grammar.fill_next_token_bitmask(view, i)
            if request.sampling_params.guided_json is not None or request.sampling_params.guided_json_object:
                view[i] &= self._json_safe
        return self._bitmask.upload(n).view(num_rows, self._width), [i for i, _ in guided]



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
            # (a compile moved to the slow lane started again: a later limit is queued too)
            if self._awaits(job) and not job.future.done() and now >= job.started + self.compile_timeout_s:
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
            except Exception as e:              # its compile process died (not the request's fault: INTERNAL)
                (field,) = request.sampling_params.guided_fields()
                failed.append((request, RuntimeError(f"sampling parameter '{field}' could not be compiled: {e}")))
                continue
            admitted.append(request)
        return admitted, failed

    def _awaits(self, job: Job) -> bool:
        item = self._items.get(job.tag.request_id)
        return item is not None and item[1] is job
