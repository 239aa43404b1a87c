"""Runs one scheduled step: packed inputs (one upload), the model over the paged cache
(a captured CUDA graph for decode and verify steps where one fits, else eager), the batched
sampler, and the step's one device-to-host copy: the sampled ids."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch

from backend.attention.metadata import KVCacheLayer
from backend.engine.sampling import logprobs
from backend.engine.sampling import prompt_logprobs
from backend.engine.runner.buffers import GrowingStagedBuffer
from backend.engine.runner.cpu_shards import ShardedForward
from backend.engine.runner.cpu_threads import StepThreads
from backend.engine.runner.cuda_graphs import capture_decode_graphs, sampled_logits
from backend.engine.sampling.logprobs import TokenLogprobs
from backend.engine.outputs import ModelRunnerOutput
from backend.engine.runner.request_state import RequestState, RequestStates
from backend.engine.sampling.sampler import Sampler
from backend.engine.scheduling.sched_output import SchedulerOutput
from backend.engine.spec_decode.draft_tokens import device_fill
from backend.engine.spec_decode.rejection_sampler import RejectionSampler, accepted_path, accepted_tokens, verify_rows
from backend.engine.spec_decode.token_tree import TokenTree
from backend.engine.structured_output.bitmask import apply_bitmask
from backend.engine.runner.tree_kv import TreeKVCompactor
from backend.engine.runner.step_inputs import GraphShape, StepInputBuilder, StepInputs
from backend.models.config import ModelConfig
from backend.models.llama import CausalLM

logger = logging.getLogger(__name__)


def kv_cache_bytes_per_block(cfg: ModelConfig, block_size: int, kv_dtype: torch.dtype) -> int:
    return cfg.kv_bytes_per_token * block_size * torch.tensor([], dtype=kv_dtype).element_size()


def allocate_kv_cache(cfg: ModelConfig, num_blocks: int, block_size: int, kv_dtype: torch.dtype,
                      device: torch.device) -> list[KVCacheLayer]:
    """cfg: this rank's shapes (its KV heads under tensor parallelism)."""
    shape = (num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
    layers = [KVCacheLayer(torch.zeros(shape, dtype=kv_dtype, device=device),
                           torch.zeros(shape, dtype=kv_dtype, device=device))
              for _ in range(cfg.num_layers)]
    if kv_dtype == torch.float8_e4m3fn and cfg.quantization and cfg.quantization.get("kv_cache_scales"):
        # Calibrated by the builder: per layer [k_scale, v_scale].
        for layer, (k_scale, v_scale) in zip(layers, cfg.quantization["kv_cache_scales"]):
            layer.k_scale, layer.v_scale = float(k_scale), float(v_scale)
    return layers


def run_model(model: CausalLM, kv_caches: list[KVCacheLayer], step: StepInputs,
              shards: Optional[ShardedForward] = None) -> Optional[torch.Tensor]:
    """The decoder over a packed step (writing its K/V into the cache); the logits of the
    sampled rows ([R, V]), or None when R is 0 or on a tensor-parallel rank other than 0
    (each rank runs this same function on the same step). `shards`: the CPU forward split
    by sequences over threads (cpu_shards.py)."""
    if shards is not None:
        return shards(model, kv_caches, step)
    hidden = model(step.input_ids, step.positions, kv_caches, step.meta, **step.model_kwargs)
    if step.num_logits == 0:
        return None
    if not step.all_rows_sampled:
        hidden = hidden.index_select(0, step.logits_indices)
    return model.compute_logits(hidden)


class ModelRunner:
    def __init__(self, model: Optional[CausalLM], kv_caches: list[KVCacheLayer], block_size: int,
                 device: torch.device, sampler: Sampler, inputs: StepInputBuilder, vocab_size: int,
                 workers=None, lora=None, shards: Optional[ShardedForward] = None, drafter=None, kv_connector=None,
                 encoder_outputs=None, tree: Optional[TokenTree] = None, threads: Optional[StepThreads] = None) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self.sampler = sampler
        self.inputs = inputs
        self.vocab_size = vocab_size
        # This runner's CUDA graphs (capture_graphs, once its KV cache exists), or None.
        self.graphs = None
        # On CPU: the forward split by sequences over threads (cpu_shards.py).
        self.shards = shards
        # On CPU: one intra-op thread for a small step, more for the rest (cpu_threads.py).
        self.threads = threads
        # Tensor and pipeline parallelism: the other ranks (backend/parallel/workers.py),
        # sent each step's changes to the request states before this rank runs its
        # shard of the same forward.
        self.workers = workers
        # The requests this runner holds (request_state.py), changed by the typed steps
        # and by the tokens it samples; journaled for the other ranks.
        self.states = RequestStates(device, journal=workers is not None)
        self.rejection_sampler = RejectionSampler(device)
        # Multi-LoRA (backend/lora/manager.py): makes each step's adapters resident and
        # tells the wrapped projections which rows run under which.
        self.lora = lora
        self._placeholder_index = GrowingStagedBuffer(torch.int64, device)
        self._proposal_index = GrowingStagedBuffer(torch.int64, device)
        self._prompt_logprobs = prompt_logprobs.PromptLogprobPlanner(device)
        self._host_out: Optional[torch.Tensor] = None
        self._copied: Optional[torch.cuda.Event] = None
        # Speculative decoding with a draft model (spec_decode/draft_model.py): proposes
        # inside the step, once its tokens are back.
        self.drafter = drafter
        # A store of KV blocks beyond the pool (kv_offload/): runs each step's copies.
        self.kv_connector = kv_connector
        # Vision-language models: the vision tower's outputs (mm_step.py).
        self.encoder_outputs = encoder_outputs
        # A tree of proposals (spec_decode/token_tree.py): how verifications are laid out,
        # and the accepted paths' K/V moved into place after each.
        self.tree = tree
        self._tree_kv = TreeKVCompactor(device) if tree is not None else None

    def capture_graphs(self, max_num_seqs: int, max_model_len: int, verify_query_len: int) -> None:
        """Capture this runner's decode (and verify) CUDA graphs, every rank at once under
        tensor parallelism (each keeps them only if all succeeded): after construction,
        since a capture runs the runner's own forward over its KV cache."""
        capture = lambda: capture_decode_graphs(self, max_num_seqs, max_model_len, verify_query_len)  # noqa: E731
        self.graphs = capture() if self.workers is None else self.workers.capture_graphs(
            capture, max_num_seqs, max_model_len, verify_query_len)

    def forward(self, step: StepInputs) -> Optional[torch.Tensor]:
        if self.threads is not None:
            self.threads.apply(step.meta)
        return run_model(self.model, self.kv_caches, step, self.shards)

    def run_forward(self, step: StepInputs, graph: Optional[GraphShape]) -> Optional[torch.Tensor]:
        """The step's forward on this rank: the CUDA graph of `graph`'s shape replayed, or
        eagerly. Rank 0 and the tensor-parallel ranks (backend/parallel/workers.py) run
        this same path. A rank told to replay a graph it has not got (rank 0's graphs are a
        test's stand-in) runs what the graph runs, every padded row's logits, eagerly: the
        same collectives as the others. A decode graph's row i is sequence i's; from a
        verify graph's rows the step's sampled ones are gathered."""
        if graph is None:
            return self.forward(step)
        if self.graphs is not None:
            logits = self.graphs.replay(graph)
        else:
            model = self.model
            logits = model.compute_logits(model(step.input_ids, step.positions, self.kv_caches, step.meta))
        if logits is None:                  # (gathered on rank 0 only)
            return None
        return sampled_logits(logits, graph, step)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, grammar_bitmask=None) -> ModelRunnerOutput:
        """One step in series: launch, sample, collect. Returns, per scheduled request,
        its new tokens: none when the request is mid-prefill (its chunk did not reach the
        last token), one, or with proposals verified, the accepted ones and the target's
        next; and the logprobs of those that asked, by their index in `out.scheduled`.
        `grammar_bitmask`: the scheduler's for the step's sampled rows (structured output)."""
        launched = self.launch(out)
        self.sample(launched, grammar_bitmask)
        return self.collect(launched)

    def update_states(self, out: SchedulerOutput) -> list[RequestState]:
        """The step's changes to the request states (request_state.py); the states of its
        scheduled requests. The engine hands every step here, an empty one too, before
        it collects the step in flight: a request preempted or finished since must not
        be drafted for or moved."""
        return self.states.apply(out)

    @torch.inference_mode()
    def launch(self, out: SchedulerOutput, prev: Optional[LaunchedStep] = None) -> LaunchedStep:
        """Builds the step's inputs and issues its forward. With async scheduling, `prev`
        is the step still in flight: the tokens it samples are this step's placeholders,
        taken from its sampled ids on the device (no host sync)."""
        states = self.update_states(out)
        if self.kv_connector is not None:
            self.kv_connector.start_transfers(out.kv_transfers)
        graph = self.graphs.size_for(out) if self.graphs is not None else None
        if graph is not None and self.encoder_outputs is not None and self.encoder_outputs.needs_eager(out):
            graph = None
        if graph is not None and self.tree is not None and any(s.spec_token_ids for s in out.scheduled):
            graph = None                    # (a graph has no tree masks: a tree's verification runs eagerly)
        step = self.inputs.build(out, states, pad_to=graph)
        if step.placeholders:
            self._fill_placeholders(step, prev)
        if step.proposals:
            device_fill(step.input_ids, step.proposals, self._proposal_index)
        if self.encoder_outputs is not None:
            self.encoder_outputs.prepare(out, states, step)
        lora_names = [state.sampling_params.lora_name for state in states] if self.lora is not None else None
        if self.lora is not None:       # (LoRA engines capture decode graphs only)
            self.lora.prepare(lora_names, [s.num_new_tokens for s in out.scheduled],
                              graph.num_seqs if graph is not None else None)
        if self.workers is not None:        # (they build the same inputs from the same typed steps)
            self.workers.send_step(self.states.take_journal(), self.inputs.digest(), graph,
                                   self.lora.index_of(lora_names) if self.lora is not None else None)
        logits = self.run_forward(step, graph)
        return LaunchedStep(out, states, logits, target_hidden=self._target_hidden(step, graph))

    def _target_hidden(self, step: StepInputs, graph: Optional[GraphShape]) -> Optional[torch.Tensor]:
        """What the forward captured for an EAGLE head (CausalLM.captured_hidden), kept
        with the step: a graph's buffer is copied (on the device), since the next step's
        replay rewrites it before this step's proposals are drafted (async scheduling)."""
        if self.drafter is None or not self.drafter.reads_target_hidden:
            return None
        if graph is not None and self.graphs is not None:
            return self.graphs.hidden[graph][:step.num_tokens].clone()
        return self.model.captured_hidden

    def _fill_placeholders(self, step: StepInputs, prev: Optional[LaunchedStep]) -> None:
        if prev is None or prev.sampled is None:
            raise RuntimeError("a step with placeholder tokens needs the step in flight that samples them")
        n = len(step.placeholders)
        pairs = self._placeholder_index.upload(np.asarray(
            [i for i, _ in step.placeholders] + [prev.row_of[rid] for _, rid in step.placeholders], dtype=np.int64))
        step.input_ids.index_copy_(0, pairs[:n], prev.sampled.index_select(0, pairs[n:]).to(step.input_ids.dtype))

    @torch.inference_mode()
    def sample(self, launched: LaunchedStep, grammar_bitmask=None) -> None:
        """Issues the draw over the launched step's logits, from the request states as
        they are now (with async scheduling: the step before was collected, so penalties,
        min_tokens and bad words include its tokens), and the copy of the ids (and
        logprobs) to the host. `grammar_bitmask`: (bitmask, rows) from the scheduler,
        which applied the step before to its grammars first (Scheduler.grammar_bitmask).
        A request that finished meanwhile is drawn as any other; its token is dropped."""
        out, logits = launched.sched, launched.logits
        sampling = [(s, state) for s, state in zip(out.scheduled, launched.states) if s.completes_prompt]
        plan = self._prompt_logprobs.plan(out.scheduled, launched.states, self.vocab_size)
        if plan is not None:
            # The step's prompt-logprob rows follow its sampled ones (StepInputBuilder.build).
            launched.prompt_plan = plan
            prompt_packed = prompt_logprobs.pack(logits[logits.shape[0] - plan.num_rows:], plan)
            logits = logits[:logits.shape[0] - plan.num_rows]
        if not sampling:
            if plan is not None:
                self._to_host(launched, prompt_packed)
            return
        scheduled = [s for s, _ in sampling]
        speculative = any(s.spec_token_ids for s in scheduled)
        # One sampler row per logits row.
        rows = verify_rows(scheduled, [state for _, state in sampling], self.tree)
        batch = self.sampler.prepare(rows, self.vocab_size)
        if grammar_bitmask is not None:     # guided rows: disallowed tokens to -inf before the draw
            logits = logits.float()
            apply_bitmask(logits, grammar_bitmask, self.vocab_size)
        if speculative:
            verify = self.rejection_sampler.plan(scheduled, self.tree)
            sampled, accepted = self.rejection_sampler.sample(self.sampler, logits, batch, verify)
        else:
            sampled, accepted = self.sampler.sample(logits, batch), None
        # What the next step's placeholders are filled from: the row of each request that
        # verifies nothing (a verifying one sits that step out: Scheduler.may_speculate).
        launched.sampled, row = sampled, 0
        for s in scheduled:
            if not s.spec_token_ids:
                launched.row_of[s.request_id] = row
            row += len(s.spec_token_ids) + 1
        # The step's one device-to-host copy: the ids with the logprobs asked for, the
        # prompt logprobs of its prompt chunks, and each row's proposal (a draft model's
        # reach the host only here) and whether it stands.
        packed = logprobs.pack(logits, sampled, batch.logprobs)
        if plan is not None:
            packed = torch.cat([packed.float(), prompt_packed])
        if accepted is not None:
            packed = torch.cat([packed.float(), verify.proposals.float(), accepted.float()])
        launched.batch, launched.num_rows, launched.speculative = batch, len(rows), speculative
        self._to_host(launched, packed)

    def _to_host(self, launched: LaunchedStep, packed: torch.Tensor) -> None:
        """The launched step's packed result for the host. On CUDA, an asynchronous copy
        into pinned memory and the event `collect` waits on (one buffer and one event:
        a step is collected before the next one is sampled)."""
        if packed.device.type != "cuda":
            launched.packed = packed
            return
        n = packed.shape[0]
        if self._host_out is None or self._host_out.shape[0] < n:
            self._host_out = torch.empty(max(n, 4096), dtype=torch.float32, pin_memory=True)
            self._copied = torch.cuda.Event()
        launched.packed = self._host_out[:n]
        launched.packed.copy_(packed.float(), non_blocking=True)
        self._copied.record()
        launched.copied = self._copied

    def collect(self, launched: LaunchedStep) -> ModelRunnerOutput:
        """The launched step's result (waits for its copy: the step's one host sync), with
        a draft model's proposals for the next step; its new tokens appended to the
        request states (after the draft, which reads the states as the step found them)."""
        paths: dict[int, list[int]] = {}
        result = self._read(launched, paths)
        if paths:
            self._tree_kv.compact(self.kv_caches, *self._tree_kv.slot_moves(
                launched.sched.scheduled, launched.states, paths, self.block_size))
        if self.drafter is not None:
            result.proposals = self.drafter.propose(launched.sched, launched.states, result.sampled_token_ids,
                                                    launched.target_hidden, paths)
        self.states.append(launched.states, result.sampled_token_ids)
        return result

    def _read(self, launched: LaunchedStep, paths: Optional[dict[int, list[int]]] = None) -> ModelRunnerOutput:
        if launched.packed is None:
            return ModelRunnerOutput([[] for _ in launched.sched.scheduled])
        if launched.copied is not None:
            launched.copied.synchronize()
        values = launched.packed.tolist()
        plan = launched.prompt_plan
        prompt = {}
        if plan is not None:        # [sampled part][prompt logprobs][proposals][proposal flags]
            start = logprobs.packed_len(launched.num_rows, launched.batch.logprobs) if launched.batch else 0
            prompt = prompt_logprobs.unpack(values[start:start + plan.packed_len], plan)
        if launched.batch is None:
            return ModelRunnerOutput([[] for _ in launched.sched.scheduled], prompt_logprobs=prompt)
        tokens, by_row = logprobs.unpack(values, launched.num_rows, launched.batch.logprobs)
        n = launched.num_rows
        proposals, flags = (values[-2 * n:-n], values[-n:]) if launched.speculative else ([], [])
        result = tokens_per_request(launched.sched.scheduled, tokens, proposals, flags, by_row, self.tree, paths)
        result.prompt_logprobs = prompt
        return result


@dataclass
class LaunchedStep:
    """A step whose forward has been issued: sampled (`ModelRunner.sample`) once the
    previous step's result is applied, read back (`collect`) after the next step has
    been launched, with async scheduling."""
    sched: SchedulerOutput
    states: list[RequestState]          # the scheduled requests' states, in order
    logits: Optional[torch.Tensor]
    # The sampled ids on the device ([rows]) and each request's row: what the next step's
    # placeholders are filled from.
    sampled: Optional[torch.Tensor] = None
    row_of: dict[str, int] = field(default_factory=dict)
    # The result on the host (on CUDA, being copied until `copied` fires).
    packed: Optional[torch.Tensor] = None
    copied: Optional[torch.cuda.Event] = None
    batch: Optional[object] = None
    num_rows: int = 0
    speculative: bool = False
    prompt_plan: Optional[prompt_logprobs.PromptLogprobPlan] = None
    # The target's hidden states an EAGLE head drafts from (ModelRunner._target_hidden).
    target_hidden: Optional[torch.Tensor] = None


def tokens_per_request(scheduled, tokens: list[int], proposals: list[float], flags: list[float],
                       by_row: dict[int, TokenLogprobs], tree: Optional[TokenTree] = None,
                       paths: Optional[dict[int, list[int]]] = None) -> ModelRunnerOutput:
    """The step's sampled rows, back per scheduled request (in order): a request whose
    prompt is still being prefilled gets none; a verifying one its accepted proposals and
    the token after them (`proposals`, `flags`: each row's proposal and whether it
    stands, as the step's copy brought them); with the logprobs of each request's first
    row. On a tree, `paths` receives each verifying request's accepted nodes, by index."""
    result: list[list[int]] = []
    by_index: dict[int, TokenLogprobs] = {}
    row = 0
    for i, s in enumerate(scheduled):
        if not s.completes_prompt:
            result.append([])
            continue
        k = len(s.spec_token_ids)
        if k and tree is not None:
            new, paths[i] = accepted_path(tree.prefix(k), proposals, tokens, flags, row)
            result.append(new)
        else:
            result.append(accepted_tokens([int(p) for p in proposals[row:row + k]], tokens, flags, row)
                          if k else [tokens[row]])
        if row in by_row:
            by_index[i] = by_row[row]
        row += k + 1
    return ModelRunnerOutput(result, by_index)
