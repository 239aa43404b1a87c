"""Grammar compilation in child processes, so that a slow compile can be stopped.

xgrammar cannot stop a compile once begun, and some tiny specs take minutes (a pattern
such as `(e|f){1,16000}`). Compiled on a thread, a compile given up on kept its core
until xgrammar returned: six such schemas held every core, refused structured output
for about 130 s and slowed plain chat 30x (issue 49). Here each compile thread of the
pool sends its work to a process of its own, and giving up on a compile kills that
process: its core is free at once, and the thread's next compile gets a new process.

The processes are forked from multiprocessing's fork server, which imports this module
(and with it torch and xgrammar) once: a new process costs milliseconds, not the
seconds of a fresh interpreter, and shares those pages. The compiled grammar comes back
serialized (xgrammar's own JSON: 0.6 MB and 5 ms to read for a 150k vocabulary).
"""

from __future__ import annotations

import json
import multiprocessing
import re
import threading
from typing import Any, Optional

from backend.engine.errors import InvalidRequestError

_context_lock = threading.Lock()
_context: Optional[multiprocessing.context.BaseContext] = None


def _mp_context():
    global _context
    with _context_lock:
        if _context is None:
            ctx = multiprocessing.get_context("forkserver")
            ctx.set_forkserver_preload([__name__, "xgrammar"])
            _context = ctx
        return _context


def _start_without_main(proc) -> None:
    """Starts `proc` without its child running the parent's main script again:
    multiprocessing would import it there, and a user's script without an
    `if __name__ == "__main__":` guard (the offline LLM API with a guided request) would
    run anew in every compile process. The child needs nothing from it."""
    from multiprocessing import spawn
    with _context_lock:
        original = spawn.get_preparation_data

        def without_main(name):
            data = original(name)
            data.pop("init_main_from_path", None)
            data.pop("init_main_from_name", None)
            return data

        spawn.get_preparation_data = without_main
        try:
            proc.start()
        finally:
            spawn.get_preparation_data = original


def choice_grammar(choices: list[str]) -> str:
    """EBNF whose only sentences are the choices (string literals, JSON-escaped)."""
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


def compile_spec(compiler, field: str, value: Any):
    """One guided field compiled by an xgrammar GrammarCompiler; InvalidRequestError with
    the compiler's own words when the spec is invalid."""
    try:
        if field == "guided_json":
            return compiler.compile_json_schema(json.dumps(value), any_whitespace=False)
        if field == "guided_json_object":    # any JSON object (as vLLM does it)
            return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
        if field == "guided_regex":
            return compiler.compile_regex(value)
        if field == "guided_choice":
            return compiler.compile_grammar(choice_grammar(value))
        return compiler.compile_grammar(value)
    except Exception as e:  # the compiler's own words: what is wrong and where
        message = re.sub(r"^\[[\d:]+\] \S+: ", "", str(e).strip())
        raise InvalidRequestError(f"invalid {field}: {message}") from None


def _exit_with_parent() -> None:
    """A thread of the child: a compile runs on in C++ (GIL released) after the engine's
    process is gone (SIGKILLed by the supervisor as hung); the child then ends itself."""
    import os
    import time
    parent = os.getppid()
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(0)


def _serve(conn, tokenizer_info_json: str, nice: int = 0) -> None:
    """The child: compiles what the pipe brings until the parent closes it."""
    if nice:
        import os
        os.nice(nice)
    threading.Thread(target=_exit_with_parent, daemon=True).start()
    import xgrammar as xgr
    info = xgr.TokenizerInfo.deserialize_json(tokenizer_info_json)
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)  # the parent caches
    conn.send(("ready", None))          # (about 0.1 s for a 150k vocabulary: not a compile's time)
    while True:
        try:
            field, value = conn.recv()
        except (EOFError, OSError):
            return
        try:
            conn.send(("ok", compile_spec(compiler, field, value).serialize_json()))
        except InvalidRequestError as e:
            conn.send(("invalid", str(e)))
        except Exception as e:  # noqa: BLE001 (anything else: the parent names it)
            conn.send(("error", repr(e)))


# A new process reads the tokenizer and makes its compiler within this (0.1 s for a 150k
# vocabulary; the fork server's first start, about 2 s): past it, it is taken as hung.
READY_TIMEOUT_S = 60.0


class CompileKilled(RuntimeError):
    """The compile's process was killed (the compile was given up on)."""


class GrammarProcess:
    """One child process and the pipe to it; used by one thread at a time."""

    def __init__(self, tokenizer_info_json: str, nice: int = 0) -> None:
        """nice: added to the child's niceness (a lower CPU priority)."""
        ctx = _mp_context()
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_serve, args=(child, tokenizer_info_json, nice), daemon=True,
                                 name="grammar-compile")
        try:
            _start_without_main(self._proc)
        except BaseException:
            self._conn.close()
            raise
        finally:
            child.close()
        self._killed = False
        self._ready = False
        self._closed = False
        self._close_lock = threading.Lock()
        self.owner = threading.current_thread()     # the one thread that reads its pipe

    @property
    def alive(self) -> bool:
        return not self._killed and self._proc.is_alive()

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> None:
        """Until the child has read the tokenizer and made its compiler (a compile thread
        waits for this before it takes a job: a new process's start is not charged to the
        compile that needs it). A child that dies, says anything else, or is not ready
        within timeout_s is killed: CompileKilled."""
        if self._ready:
            return
        try:
            status = self._conn.recv()[0] if self._conn.poll(timeout_s) else None
        except (EOFError, OSError):
            status = None
        if status != "ready":
            self.kill()
            raise CompileKilled(f"the grammar compile process was not ready ({status or 'no answer'})")
        self._ready = True

    def compile(self, field: str, value: Any) -> str:
        """The serialized compiled grammar. Raises InvalidRequestError, or CompileKilled."""
        self.wait_ready()
        try:
            self._conn.send((field, value))
            status, payload = self._conn.recv()
        except (EOFError, OSError):
            self._killed = True
            raise CompileKilled("the grammar compile was stopped") from None
        if status == "invalid":
            raise InvalidRequestError(payload)
        if status == "error":
            raise RuntimeError(f"grammar compile failed: {payload}")
        return payload

    def kill(self) -> None:
        """Stops a compile in progress at once (from any thread)."""
        self._killed = True
        try:
            self._proc.kill()
        except (OSError, ValueError):
            pass

    def close(self) -> None:
        """Once, whichever thread comes first: a dead process is closed both by its own
        thread (GrammarProcesses.discard) and by another's prune, and a second close of
        the pipe closed whatever file had taken its descriptor number meanwhile (another
        process's pipe: that compile failed as killed)."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        self.kill()
        self._proc.join(timeout=5)
        self._conn.close()


class GrammarProcesses:
    """A process for each compile thread, started when the thread first needs one (or
    after its last one was killed); close() ends them all."""

    def __init__(self, tokenizer_info_json: str) -> None:
        self._info = tokenizer_info_json
        self._local = threading.local()
        self._all: set[GrammarProcess] = set()
        self._lock = threading.Lock()
        self._closed = False

    def current(self, nice: int = 0) -> GrammarProcess:
        """The calling thread's process (started, with `nice`, if it has none alive),
        ready to compile (GrammarProcess.wait_ready)."""
        proc: Optional[GrammarProcess] = getattr(self._local, "proc", None)
        if proc is None or not proc.alive:
            self._prune()                   # killed ones (their threads may have ended)
            proc = GrammarProcess(self._info, nice)
            with self._lock:
                if self._closed:
                    proc.close()
                    raise CompileKilled("structured output is shutting down")
                self._all.add(proc)
            self._local.proc = proc
        proc.wait_ready()
        return proc

    def discard(self, proc: GrammarProcess) -> None:
        """A process that was killed (or died): its pipe and handle go now."""
        with self._lock:
            self._all.discard(proc)
        proc.close()

    def _prune(self) -> None:
        """Closes dead processes that no other thread may still be reading: the caller's own,
        and those whose thread has ended. A killed process's owner may still be in recv();
        closing its pipe under it would free the descriptor number for the next Pipe() (this
        very call's new process), and the owner's read would take that process's messages.
        A live owner closes its own (GrammarProcesses.discard)."""
        me = threading.current_thread()
        with self._lock:
            dead = [p for p in self._all if not p.alive and (p.owner is me or not p.owner.is_alive())]
            self._all.difference_update(dead)
        for proc in dead:
            proc.close()

    def __len__(self) -> int:
        with self._lock:
            return sum(p.alive for p in self._all)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            procs, self._all = list(self._all), set()
        for proc in procs:
            proc.close()
