"""Host overhead of one decode step, the model left out: what a GPU waits for between
steps when the host, not the device, sets the pace.

    python -m benchmarks.bench_host [--num-seqs 256 --prompt-len 500 --steps 50]
    python -m benchmarks.bench_host --num-seqs 256 --prompt-len 1920 --steps 40 --device-ms 10 --mix
    python -m benchmarks.bench_host --parts --num-seqs 256 --context 4096

Runs the real engine (scheduler, KV cache manager, step inputs, sampling-batch preparation,
stop checks, detokenization, outputs) with the forward pass and the draw replaced.

- Plain (neither --device-ms nor --mix): forward and draw replaced by a constant token;
  prints milliseconds per step at full batch.
- --device-ms D: a simulated device behind the real runner interface
  (`SimulatedDeviceRunner`: launch, sample, collect): the runner's host work runs for
  real (step inputs, sampling batch, grammar bitmasks, the verification plan, unpacking
  ids and logprobs), each step occupies the device D ms from its launch (waited for off
  the GIL, as a CUDA event wait), and the "device" returns deterministic tokens. The
  engine runs as a server runs it (EngineLoop: engine thread and output thread), with
  async scheduling as on CUDA (`--no-async-scheduling`: in series).
  Prints `host_ms_per_step` (CPU time of the engine and output threads per step: host
  work, overlapped or not) and `step_period_ms` (wall time per step).
- --mix: every request with repetition_penalty and frequency_penalty and two stop strings
  (never matched: the token stream is alphabetic), logprobs=5 on half of them, n-gram
  speculation on the other half, and one JSON-schema request.
- --parts: `Sampler.prepare` (repetition, frequency, neither) and `StepInputBuilder.build`
  alone over `--num-seqs` decoding requests of `--context` tokens, per decode step.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import threading
import time
from unittest import mock

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# --mix
STOP_STRINGS = ["<|stop|>", "\n\n###"]
JSON_SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "tags": {"type": "array",
               "items": {"type": "string"}}}, "required": ["name", "tags"]}
NUM_SPECULATIVE_TOKENS = 2
# The simulated device accepts at most this many proposals per verification (those that
# match its token stream): a speculating request advances 2 tokens a step, and every
# verification rolls one proposal back.
ACCEPT_MAX = 1
STREAM_PERIOD = 8
# Decode steps before timing: enough for the stream to repeat, so n-gram lookups hit.
WARMUP_STEPS = STREAM_PERIOD + 4


@contextlib.contextmanager
def _small_kv_tensors():
    """The model never runs here: the KV manager gets its full block count, the cache
    tensors one block (gigabytes otherwise at long prompts)."""
    from backend.engine import assembly
    real = assembly.allocate_kv_cache

    def allocate(cfg, num_blocks, block_size, kv_dtype, device):
        return real(cfg, 1, block_size, kv_dtype, device)
    with mock.patch.object(assembly, "allocate_kv_cache", allocate):
        yield


def host_ms_per_step(checkpoint: str, num_seqs: int, prompt_len: int, steps: int, seed: int = 0) -> float:
    """Plain mode: the forward pass and the draw replaced by a constant token."""
    from backend import LLM, SamplingParams
    from backend.engine.outputs import ModelRunnerOutput
    with _small_kv_tensors():
        llm = LLM(checkpoint, device="cpu", num_kv_blocks=num_seqs * (-(-(prompt_len + steps + 2) // 16)) + 16,
                  max_num_seqs=num_seqs, max_num_batched_tokens=num_seqs * prompt_len, async_scheduling=False)
    engine, runner = llm.engine, llm.engine.runner

    def host_only(out, grammar_bitmask=None):
        states = runner.update_states(out)
        runner.inputs.build(out, states)
        sampling = [state for s, state in zip(out.scheduled, states) if s.completes_prompt]
        runner.sampler.prepare(sampling, runner.vocab_size)
        sampled = [[7] if s.completes_prompt else [] for s in out.scheduled]
        runner.states.append(states, sampled)
        return ModelRunnerOutput(sampled)
    runner.execute = host_only
    rng = np.random.default_rng(seed)
    vocab = engine.model_config.vocab_size
    for _ in range(num_seqs):
        engine.add_request(rng.integers(3, vocab, prompt_len).tolist(),
                           SamplingParams(max_tokens=steps + 2, ignore_eos=True, temperature=0.6))
    engine.step()                                    # every prompt in one step
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    ms = (time.perf_counter() - t0) / steps * 1e3
    for rid in list(engine.scheduler.requests):
        engine.abort_request(rid)
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_total_blocks, "KV blocks leaked"
    return ms


# ------------------------------------------------------------ simulated device
def _runner_class():
    from backend.engine.runner.model_runner import LaunchedStep, ModelRunner

    class SimulatedDeviceRunner(ModelRunner):
        """The real runner's host work around a simulated device. `launch` builds the
        step inputs and puts the step on the device: a queue that runs one step at a time,
        each `device_ms` long, starting when both the step is launched and the previous
        one is done. `sample` prepares the sampling batch, the grammar bitmasks and the
        verification plan, as ModelRunner.sample does. `collect` waits off the GIL (a
        sleep, as a CUDA event wait) until the step is done, then unpacks deterministic
        tokens: request r's output token t is stream[(offset(r) + t) % STREAM_PERIOD];
        proposals that match the stream are accepted (at most ACCEPT_MAX); a guided row
        takes its grammar's first allowed token."""

        def __init__(self, runner: ModelRunner, device_ms: float, stream: list[int]) -> None:
            self.__dict__.update(runner.__dict__)
            self.device_s = device_ms / 1e3
            self.stream = stream
            self.offsets: dict[str, int] = {}
            self._device_free = 0.0

        def token(self, request, position: int) -> int:
            off = self.offsets.setdefault(request.request_id, len(self.offsets))
            return self.stream[(off + position) % len(self.stream)]

        def launch(self, out, prev=None):
            states = self.update_states(out)
            self.inputs.build(out, states)
            self._device_free = max(time.perf_counter(), self._device_free) + self.device_s
            launched = LaunchedStep(out, states, None)
            launched.done_at = self._device_free
            return launched

        def sample(self, launched, grammar_bitmask=None) -> None:
            from backend.engine.spec_decode.rejection_sampler import verify_rows
            pairs = [(s, state) for s, state in zip(launched.sched.scheduled, launched.states) if s.completes_prompt]
            sampling = [s for s, _ in pairs]
            if not sampling:
                return
            speculative = any(s.spec_token_ids for s in sampling)
            rows = verify_rows(sampling, [state for _, state in pairs])
            batch = self.sampler.prepare(rows, self.vocab_size)
            mask = grammar_bitmask
            if speculative:
                self.rejection_sampler.plan(sampling)
            # What the device would send back: ids, logprobs, each row's proposal and
            # whether it stands.
            tokens, proposals, flags = [], [], []
            guided = dict.fromkeys(mask[1]) if mask is not None else {}
            for s in sampling:
                r, spec = s.request, s.spec_token_ids
                # (a placeholder of the step in flight counts as output already)
                base = r.num_output_tokens + r.num_output_placeholders - 1
                for j in range(len(spec) + 1):
                    i = len(tokens)
                    t = _first_allowed(mask[0][i]) if i in guided else self.token(r, base + j)
                    tokens.append(t)
                    flags.append(float(j < len(spec) and j < ACCEPT_MAX and spec[j] == t))
                    proposals.append(float(spec[j]) if j < len(spec) else -1.0)
            values = [float(t) for t in tokens]
            if batch.logprobs is not None:
                m = batch.logprobs.max_count
                for row in batch.logprobs.row_ids:
                    values += [-1.0, 1.0] + [-1.0 - k for k in range(m)] + [float(tokens[row] + k) for k in range(m)]
            launched.batch, launched.num_rows, launched.speculative = batch, len(rows), speculative
            launched.values, launched.proposals, launched.flags = values, proposals, flags

        def collect(self, launched):
            from backend.engine.sampling import logprobs
            from backend.engine.runner.model_runner import tokens_per_request
            from backend.engine.outputs import ModelRunnerOutput
            wait = launched.done_at - time.perf_counter()
            if wait > 0:
                time.sleep(wait)                # releases the GIL, as an event wait would
            if not hasattr(launched, "values"):
                return ModelRunnerOutput([[] for _ in launched.sched.scheduled])
            ids, by_row = logprobs.unpack(launched.values, launched.num_rows, launched.batch.logprobs)
            result = tokens_per_request(launched.sched.scheduled, ids, launched.proposals, launched.flags, by_row)
            self.states.append(launched.states, result.sampled_token_ids)
            return result

    return SimulatedDeviceRunner


def _first_allowed(bits) -> int:
    words = bits.numpy().view(np.uint32)
    w = int(np.flatnonzero(words)[0])
    word = int(words[w])
    return 32 * w + (word & -word).bit_length() - 1


def _alphabetic_tokens(tokenizer, n: int) -> list[int]:
    out = []
    for i in range(tokenizer.vocab_size if hasattr(tokenizer, "vocab_size") else 4096):
        text = tokenizer.decode([i])
        if text.strip().isalpha() and len(text.strip()) >= 3:
            out.append(i)
            if len(out) == n:
                break
    return out


def simulated_device_run(checkpoint: str, num_seqs: int, prompt_len: int, steps: int, device_ms: float,
                         mix: bool, seed: int = 0, max_num_batched_tokens: int = 8192,
                         async_scheduling: bool = True) -> dict:
    """Steps at full batch through SimulatedDeviceRunner; returns host_ms_per_step,
    step_period_ms and what the run did (tokens, proposals, finished requests). The step
    token budget of the timed steps is an engine setting, the same whatever the prompt
    length (the step buffers' upload grows with it). The engine is told to schedule
    ahead (as it does on CUDA by default): on the CPU it would run in series unasked."""
    from backend import LLM, SamplingParams
    per_step = 1 + (ACCEPT_MAX if mix else 0)
    max_tokens = per_step * (steps + WARMUP_STEPS + 2) + NUM_SPECULATIVE_TOKENS
    blocks = num_seqs * (-(-(prompt_len + max_tokens + NUM_SPECULATIVE_TOKENS + 2) // 16)) + 16
    kw = {}
    if mix:
        kw["speculative_config"] = {"method": "ngram", "num_speculative_tokens": NUM_SPECULATIVE_TOKENS,
                                    "prompt_lookup_min": 2, "prompt_lookup_max": 3}
    with _small_kv_tensors():
        llm = LLM(checkpoint, device="cpu", num_kv_blocks=blocks, max_num_seqs=num_seqs,
                  max_num_batched_tokens=max_num_batched_tokens, async_scheduling=async_scheduling, **kw)
    engine = llm.engine
    runner = _runner_class()(engine.runner, device_ms, _alphabetic_tokens(engine.tokenizer, STREAM_PERIOD))
    engine.runner = runner
    # As a server runs it: the engine thread steps, the output thread detokenizes.
    from backend.engine.engine_loop import EngineLoop
    loop = EngineLoop(engine)
    finished = [0]

    def on_output(out) -> None:
        finished[0] += out.finished and out.error is None
    rng = np.random.default_rng(seed)
    vocab = engine.model_config.vocab_size
    for i in range(num_seqs):
        params = dict(max_tokens=max_tokens, ignore_eos=True, temperature=0.6)
        if mix:
            params.update(repetition_penalty=1.1, frequency_penalty=0.2, stop=STOP_STRINGS)
            if i == num_seqs - 1:
                params.update(guided_json=JSON_SCHEMA, ignore_eos=False)
            elif i % 2:
                params.update(logprobs=5, speculative_decoding=False)
        loop.add_request(rng.integers(3, vocab, prompt_len).tolist(), SamplingParams(**params), f"b{i}", on_output)
    # Every prompt in one step (grammars compile on the side), through a step budget and
    # step-input buffers that hold them all, so that no request is far ahead of another;
    # the timed steps run with the engine's own.
    from backend.engine.runner.step_inputs import StepInputBuilder
    own = runner.inputs, engine.scheduler.max_num_batched_tokens
    runner.inputs = StepInputBuilder(num_seqs * (prompt_len + 1), num_seqs, own[0].M, own[0].block_size,
                                     own[0].buffer.device.device)
    engine.scheduler.max_num_batched_tokens = num_seqs * prompt_len
    real_step = engine.core_step
    state = {"phase": "fill", "n": 0}
    done = threading.Event()
    deadline = time.monotonic() + 60

    def core_step():
        """The loop's steps, in phases: fill the batch, warm up, time `steps` steps
        (from the first's start until the output thread has delivered the last's outputs)."""
        sched = engine.scheduler
        if state["phase"] == "fill" and sched.structured is not None and sched.structured.num_compiling:
            # Hold the fill step for the guided request's grammar: compiled on the side on a
            # busy machine, it could outlast the other requests, and the batch never fill.
            if time.monotonic() > deadline:
                state["error"] = "the grammar did not compile in 60 s"
                done.set()
            return sched.update_grammars(wait_s=0.05)
        if state["phase"] == "fill":
            if len(sched.running) == num_seqs and all(r.num_output_tokens for r in sched.running):
                runner.inputs, sched.max_num_batched_tokens = own
                state.update(phase="warm", n=0)
            elif time.monotonic() > deadline:
                state["error"] = "the batch did not fill in 60 s"
                done.set()
        if state["phase"] == "warm" and state["n"] == WARMUP_STEPS:
            state.update(phase="timed", n=0, cpu0=_host_cpu_s(), t0=time.perf_counter(),
                         tokens0=engine.num_generation_tokens_total,
                         spec0=engine.speculator.stats()["spec_decode_num_draft_tokens"] if engine.speculator else 0)
        if state["phase"] == "timed" and state["n"] == steps:
            loop.wait_outputs()
            state.update(phase="done", wall=time.perf_counter() - state["t0"], cpu=_host_cpu_s() - state["cpu0"],
                         tokens=engine.num_generation_tokens_total - state["tokens0"],
                         spec=(engine.speculator.stats()["spec_decode_num_draft_tokens"] - state["spec0"]
                               if engine.speculator else 0))
            done.set()
        if state["phase"] == "done":
            time.sleep(0.01)
            return []
        state["n"] += 1
        return real_step()
    engine.core_step = core_step
    loop.start()
    # The fill deadline is checked here too: a loop with nothing left to step calls no core_step.
    while not done.wait(timeout=1.0):
        if state["phase"] == "fill" and time.monotonic() > deadline + 5:
            state.setdefault("error", "the batch did not fill in 60 s (the loop went idle)")
            break
        if time.monotonic() > deadline + 600:
            break
    loop.stop()
    if "wall" not in state:
        raise RuntimeError(state.get("error", "the timed steps did not end"))
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_total_blocks, "KV blocks leaked"
    return {
        "host_ms_per_step": state["cpu"] / steps * 1e3,
        "step_period_ms": state["wall"] / steps * 1e3,
        "tokens_per_step": state["tokens"] / steps,
        "proposed_per_step": state["spec"] / steps,
        "finished": finished[0],
        "async_scheduling": engine.async_scheduling,
    }


def _host_cpu_s() -> float:
    """CPU seconds of the engine thread (the caller) and the output thread so far: the
    host work of the steps, wherever it overlaps the device."""
    outputs = next(t for t in threading.enumerate() if t.name == "engine-outputs")
    return time.thread_time() + time.clock_gettime(time.pthread_getcpuclockid(outputs.ident))


# ------------------------------------------------------------------ parts
def parts_ms(num_seqs: int, context: int, steps: int = 20, vocab: int = 32000, block_size: int = 16,
             seed: int = 0, rows_at_intake: bool = False) -> dict:
    """`Sampler.prepare` and `StepInputBuilder.build` alone, per decode step, over
    num_seqs requests holding `context` tokens (half prompt, half output).
    rows_at_intake: each request's SamplingRow worked out once, as the engine's intake
    does (otherwise prepare works it out every step)."""
    import torch

    from backend.engine.scheduling.kv_cache_manager import KVCacheManager
    from backend.engine.request import Request, RequestStatus
    from backend.engine.runner.request_state import RequestStates
    from backend.engine.sampling.sampler import Sampler
    from backend.engine.sampling.sampling_row import SamplingRow
    from backend.engine.scheduling.sched_output import ScheduledRequest, SchedulerOutput
    from backend.engine.runner.step_inputs import StepInputBuilder
    from backend.sampling_params import SamplingParams
    rng = np.random.default_rng(seed)
    max_blocks = -(-(context + steps + 1) // block_size)
    kinds = {"repetition": dict(repetition_penalty=1.1), "frequency": dict(frequency_penalty=0.2), "none": {}}
    out = {}
    for kind, extra in list(kinds.items()) + [("build", {})]:
        kv = KVCacheManager(num_seqs * max_blocks + 1, block_size, enable_prefix_caching=False)
        requests = []
        for i in range(num_seqs):
            r = Request(f"r{i}", rng.integers(3, vocab, context // 2).tolist(),
                        SamplingParams(temperature=0.7, **extra), 0.0, max_tokens=context + steps)
            r.output_token_ids = rng.integers(3, vocab, context - context // 2 - 1).tolist()
            r.status = RequestStatus.RUNNING
            if rows_at_intake:
                r.sampling_row = SamplingRow.of(r.sampling_params, r.eos_token_ids, vocab)
            assert kv.allocate_slots(r, r.num_tokens)
            r.num_computed_tokens = r.num_tokens
            requests.append(r)
        sampler = Sampler(0, torch.device("cpu"), num_seqs)
        builder = StepInputBuilder(num_seqs, num_seqs, max_blocks, block_size, torch.device("cpu"))
        # The runner's copies of the requests (runner/request_state.py), as it keeps them.
        held = RequestStates(torch.device("cpu"))
        first = SchedulerOutput.first_step([ScheduledRequest(r, 1) for r in requests])
        kv.set_block_diffs(first)
        states = held.apply(first)
        elapsed = 0.0
        for step in range(steps + 1):
            for r, state in zip(requests, states):     # the token the last step sampled
                token = int(rng.integers(3, vocab))
                r.output_token_ids.append(token)
                state.output_token_ids.append(token)
                kv.allocate_slots(r, 1)
            sched = SchedulerOutput([ScheduledRequest(r, 1) for r in requests])
            kv.set_block_diffs(sched)
            t = time.perf_counter()
            if kind == "build":        # (the runner's side: its copies' tables, then the inputs)
                builder.build(sched, held.apply(sched))
            else:
                sampler.prepare(states, vocab)
            if step:                             # the first call of a request may set up state
                elapsed += time.perf_counter() - t
            for r in requests:
                r.num_computed_tokens += 1
        out[f"{'step_inputs_build' if kind == 'build' else 'sampler_prepare_' + kind}_ms"] = elapsed / steps * 1e3
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_host")
    ap.add_argument("--checkpoint", default=os.path.join(ROOT, "model_repository", "llm", "checkpoint"))
    ap.add_argument("--num-seqs", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=500)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--device-ms", type=float, default=None,
                    help="simulated device: each forward takes D ms off the GIL (0: no wait)")
    ap.add_argument("--mix", action="store_true", help="penalties, stop strings, logprobs, n-gram "
                    "speculation on half the requests and one JSON-schema request (implies --device-ms 0)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192,
                    help="--device-ms/--mix: the engine's step token budget in the timed steps")
    ap.add_argument("--no-async-scheduling", action="store_true",
                    help="--device-ms/--mix: the engine's steps in series (async_scheduling=False)")
    ap.add_argument("--parts", action="store_true", help="Sampler.prepare and StepInputBuilder.build alone")
    ap.add_argument("--context", type=int, default=4096, help="--parts: tokens per request")
    ap.add_argument("--rows-at-intake", action="store_true",
                    help="--parts: each request's sampling row worked out once, as the engine's intake does")
    a = ap.parse_args(argv)
    if a.parts:
        for name, ms in parts_ms(a.num_seqs, a.context, rows_at_intake=a.rows_at_intake).items():
            print(f"{name}: {ms:.2f}")
        return 0
    from benchmarks.bench import ensure_checkpoint
    path = ensure_checkpoint(a.checkpoint)
    if a.device_ms is None and not a.mix:
        ms = host_ms_per_step(path, a.num_seqs, a.prompt_len, a.steps)
        print(f"host ms per decode step ({a.num_seqs} sequences, model left out): {ms:.2f}")
        print(f"host_ms_per_step: {ms:.2f}")
        print(f"step_period_ms: {ms:.2f}")
        return 0
    r = simulated_device_run(path, a.num_seqs, a.prompt_len, a.steps, a.device_ms or 0.0, a.mix,
                             max_num_batched_tokens=a.max_num_batched_tokens,
                             async_scheduling=not a.no_async_scheduling)
    print(f"# {a.num_seqs} sequences, {a.prompt_len}-token prompts, {a.steps} steps, simulated device "
          f"{a.device_ms or 0:g} ms{', mix' if a.mix else ''}, async scheduling "
          f"{'on' if r['async_scheduling'] else 'off'}: {r['tokens_per_step']:.1f} tokens and "
          f"{r['proposed_per_step']:.1f} proposals per step, {r['finished']} requests finished")
    print(f"host_ms_per_step: {r['host_ms_per_step']:.2f}")
    print(f"step_period_ms: {r['step_period_ms']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
