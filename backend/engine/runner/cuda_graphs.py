"""CUDA graphs for decode and verify steps (vLLM v1 / nano-vllm's scheme).

A decode step is the same few hundred kernel launches every time; on a GPU the host
cannot issue them as fast as the device runs them at small batch. At load, one graph
per batch size of a ladder (1, 2, 4, 8, then every 16 up to max_num_seqs) is captured
over the step-input buffers (fixed addresses, backend/engine/runner/step_inputs.py); a
decode-only step of n sequences replays the smallest graph of size >= n, its extra
rows padded to write nothing. Mixed prefill/decode steps run eagerly.

With speculative decoding a verify step gives each request up to k + 1 tokens (its
newest token and its proposals), so a second ladder is captured with query length
k + 1 (GraphShape(num_seqs, query_len)): every row has room for k + 1 tokens, a step
whose requests all sample (no prompt chunk) and add at most k + 1 tokens each replays
it, its tokens packed first and the rest padding, and the sampled rows' logits are
gathered from the graph's (num_seqs x query_len rows). The graphs run the one-token
attention kernel (a program per token), which takes any mix of query lengths. Not with
LoRA (its row groups are static per decode row): verify steps run eagerly there.

A draft model (spec_decode/draft_model.py) gets graphs of its own, captured the same way
over its own step buffers: its decode ladder for the one-token forwards that propose,
its verify ladder (k + 1 tokens a row) for the catch-up after a verification.

Before a graph serves anything it is replayed once against the eager forward on the
same inputs; a mismatch, or any capture error, logs why and leaves the engine eager.
The split-KV factor of the attention kernel is fixed per graph (its launch grid is
baked in), chosen for the longest context the engine allows.

Under tensor parallelism every rank captures the same graphs at the same time (their
NCCL collectives are recorded in them), the ranks agree that all of them succeeded or all
run eagerly (backend/parallel/workers.py), and each replays the size rank 0 picked.
"""

from __future__ import annotations

import bisect
import logging
import time
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch

from backend.engine.scheduling.sched_output import SchedulerOutput
from backend.engine.runner.step_inputs import GraphShape, dummy_decode
from backend.models.config import ModelConfig

logger = logging.getLogger(__name__)


def capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, 16, 32, 48, ... up to max_num_seqs, which is always included."""
    ladder = [1, 2, 4, 8] + list(range(16, max_num_seqs, 16))
    return sorted({s for s in ladder if s < max_num_seqs} | {max_num_seqs})


def graph_size_for(num_seqs: int, sizes: list[int]) -> Optional[int]:
    """The smallest captured size that holds num_seqs rows, or None."""
    i = bisect.bisect_left(sizes, num_seqs)
    return sizes[i] if i < len(sizes) else None


def verify_sizes(max_num_seqs: int, query_len: int, max_num_tokens: int) -> list[int]:
    """The verify ladder: the decode ladder's sizes whose rows x query_len tokens fit the
    step buffers (the largest such size included)."""
    fit = max_num_tokens // query_len
    return sorted({s for s in capture_sizes(max_num_seqs) if s <= fit} | ({min(fit, max_num_seqs)} if fit else set()))


def needs_query_len(out: SchedulerOutput) -> Optional[int]:
    """The tokens per row a graph must hold for this step: the most any request adds,
    when every request samples this step (decode or verify); None when a prompt chunk
    runs (eager)."""
    if not out.scheduled or not all(s.completes_prompt for s in out.scheduled):
        return None
    return max(s.num_new_tokens for s in out.scheduled)


def estimate_graph_bytes(cfg: ModelConfig, max_num_seqs: int, dtype_bytes: int, max_splits: int = 16) -> int:
    """Memory one captured graph of `max_num_seqs` token rows needs: the logits and one
    layer's intermediates at its rows (the pool reuses memory across layers), plus the
    split-KV partials. A ladder's shared pool is graph_pool_bytes; it is reserved in the
    memory plan before the KV cache is sized, and the measured figure is logged after
    capture."""
    rows = max_num_seqs
    per_row = (_logits_bytes_per_row(cfg, dtype_bytes)
               + dtype_bytes * (4 * cfg.hidden_size                      # embedding, norms, residuals
                                + (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim * 2
                                + 3 * cfg.intermediate_size)
               + 4 * cfg.num_heads * max_splits * (cfg.head_dim + 2))   # split-KV partials
    return rows * per_row


def _logits_bytes_per_row(cfg: ModelConfig, dtype_bytes: int) -> int:
    return cfg.vocab_size * (dtype_bytes + 4)      # the logits, and their fp32 copy for sampling


def graph_pool_bytes(cfg: ModelConfig, shapes: list[GraphShape], dtype_bytes: int, captured_width: int = 0) -> int:
    """Memory a ladder of graphs keeps in its shared pool: the largest graph's
    intermediates (estimate_graph_bytes), and every graph's logits, which stay allocated
    as its output while the others are captured; with `captured_width`, every graph's
    captured hidden states too (DecodeGraphs.hidden: [rows, width], kept for a drafter)."""
    rows = [shape.num_tokens for shape in shapes]
    return (estimate_graph_bytes(cfg, max(rows), dtype_bytes)
            + _logits_bytes_per_row(cfg, dtype_bytes) * (sum(rows) - max(rows))
            + captured_width * dtype_bytes * sum(rows))


@dataclass
class DecodeGraphs:
    sizes: list[int]
    # Verify steps (speculative decoding): their ladder and tokens per row (k + 1).
    verify_sizes: list[int] = field(default_factory=list)
    verify_query_len: int = 0
    graphs: dict[GraphShape, "torch.cuda.CUDAGraph"] = field(default_factory=dict)
    logits: dict[GraphShape, torch.Tensor] = field(default_factory=dict)
    # What each graph's forward leaves in the model's `captured_hidden` (an EAGLE target's
    # layer inputs, an EAGLE head's output), rewritten by each replay; None without.
    hidden: dict[GraphShape, Optional[torch.Tensor]] = field(default_factory=dict)
    capture_seconds: float = 0.0
    memory_bytes: int = 0

    @property
    def shapes(self) -> list[GraphShape]:
        return ([GraphShape(s) for s in self.sizes]
                + [GraphShape(s, self.verify_query_len) for s in self.verify_sizes])

    def size_for(self, out: SchedulerOutput) -> Optional[GraphShape]:
        """The smallest graph that holds the step, or None (eager)."""
        q = needs_query_len(out)
        return self.shape_for(len(out.scheduled), q) if q is not None else None

    def shape_for(self, num_seqs: int, query_len: int) -> Optional[GraphShape]:
        """The smallest graph that holds num_seqs rows of at most query_len tokens each,
        every row sampled: a decode graph for one token a row, a verify graph up to its
        tokens per row; None (eager) past both ladders."""
        if query_len == 1:
            size = graph_size_for(num_seqs, self.sizes)
            return GraphShape(size) if size is not None else None
        if query_len <= self.verify_query_len:
            size = graph_size_for(num_seqs, self.verify_sizes)
            return GraphShape(size, self.verify_query_len) if size is not None else None
        return None

    def replay(self, shape: GraphShape) -> torch.Tensor:
        """Runs the captured step over what the step-input buffers hold now; returns the
        graph's logits buffer ([shape.num_tokens, V], overwritten by the next replay)."""
        self.graphs[shape].replay()
        return self.logits[shape]


def sampled_logits(logits: torch.Tensor, shape: GraphShape, step) -> torch.Tensor:
    """The rows of a graph's logits (every padded row's) that `step` samples, in order:
    a decode graph's row i is sequence i's when every sequence samples; otherwise they
    are gathered by the step's logits_indices."""
    if shape.query_len == 1 and step.num_logits == step.num_seqs:
        return logits[:step.num_seqs]
    return logits.index_select(0, step.logits_indices[:step.num_logits])


def verify_query_len(args) -> int:
    """Tokens per row of the engine's verify graphs (EngineArgs): k + 1 under speculative
    decoding, 0 (no verify ladder) without it, with LoRA (its row groups are static
    per decode row) or with a tree of proposals (its verifications run eagerly: a graph
    has no tree masks)."""
    spec = args.speculative_config
    return spec.num_speculative_tokens + 1 \
        if spec is not None and not args.enable_lora and spec.token_tree is None else 0


def graph_ladders(max_num_seqs: int, verify_query_len: int, max_num_tokens: int) -> DecodeGraphs:
    """The (not yet captured) graphs an engine wants: the decode ladder, and with
    verify_query_len (k + 1 under speculative decoding, 0 without) the verify ladder."""
    return DecodeGraphs(capture_sizes(max_num_seqs),
                        verify_sizes(max_num_seqs, verify_query_len, max_num_tokens) if verify_query_len > 1 else [],
                        verify_query_len if verify_query_len > 1 else 0)


@torch.inference_mode()
def capture_decode_graphs(runner, max_num_seqs: int, max_model_len: int,
                          verify_query_len: int = 0, of: str = "the model") -> Optional[DecodeGraphs]:
    """Capture, check against eager, and return the graphs; None (engine stays eager)
    on any failure, with the reason logged. `runner`: what runs the forward (its model,
    kv_caches, step inputs, device, block_size and lora), the ModelRunner or a draft
    model's proposer; `of` names it in the log."""
    from backend.attention.triton_attention import choose_num_splits
    model, caches = runner.model, runner.kv_caches
    cfg = model.config
    graphs = graph_ladders(max_num_seqs, verify_query_len, runner.inputs.T)
    rng = np.random.default_rng(0)
    pool = None
    splits = {shape: choose_num_splits(shape.num_tokens, cfg.num_kv_heads, max_model_len, runner.block_size)
              for shape in graphs.shapes}
    try:
        free_before = torch.cuda.mem_get_info(runner.device)[0]
        t0 = time.perf_counter()
        # Largest first: the rest reuse its pool.
        for shape in sorted(graphs.shapes, key=lambda s: s.num_tokens, reverse=True):
            step = dummy_decode(runner.inputs, shape, rng.integers(0, cfg.vocab_size, shape.num_tokens),
                                splits[shape])
            if runner.lora is not None:     # the LoRA kernels read their row groups from fixed views too
                runner.lora.use_static(shape.num_seqs)

            def run_step() -> torch.Tensor:
                return model.compute_logits(model(step.input_ids, step.positions, caches, step.meta))
            # Warm-up outside the graph: compiles the Triton kernels, makes lazily built
            # device tensors (KV scales, FP8 dequantized weights) before capture.
            stream = torch.cuda.Stream(runner.device)
            stream.wait_stream(torch.cuda.current_stream(runner.device))
            with torch.cuda.stream(stream):
                run_step()
            torch.cuda.current_stream(runner.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                graphs.logits[shape] = run_step()
            graphs.hidden[shape] = getattr(model, "captured_hidden", None)
            pool = graph.pool()
            graphs.graphs[shape] = graph
        torch.cuda.synchronize(runner.device)
        graphs.capture_seconds = time.perf_counter() - t0
        graphs.memory_bytes = free_before - torch.cuda.mem_get_info(runner.device)[0]
        mismatch = _check_against_eager(graphs, runner, rng, splits)
    except Exception as e:  # noqa: BLE001 - any capture failure means: serve eagerly
        logger.warning("CUDA graph capture of %s failed, running eagerly: %s: %s", of, type(e).__name__, e)
        return None
    if mismatch:
        logger.warning("CUDA graphs of %s disagree with the eager step (%s); running eagerly", of, mismatch)
        return None
    logger.info("captured %d decode CUDA graphs of %s (batch sizes %s) and %d verify graphs (%d tokens per row, "
                "batch sizes %s) in %.1f s using %.1f MiB", len(graphs.sizes), of, graphs.sizes,
                len(graphs.verify_sizes), graphs.verify_query_len, graphs.verify_sizes,
                graphs.capture_seconds, graphs.memory_bytes / 2**20)
    return graphs


def _check_against_eager(graphs: DecodeGraphs, runner, rng, splits: dict[GraphShape, int]) -> Optional[str]:
    """Replay each graph on fresh inputs and compare with the eager forward pass on the
    same inputs and the same split-KV factor (so both run the same kernels)."""
    model, cfg = runner.model, runner.model.config
    for shape in graphs.shapes:
        step = dummy_decode(runner.inputs, shape, rng.integers(0, cfg.vocab_size, shape.num_tokens), splits[shape])
        if runner.lora is not None:
            runner.lora.use_static(shape.num_seqs)
        eager = model.compute_logits(model(step.input_ids, step.positions, runner.kv_caches, step.meta))
        replayed = graphs.replay(shape)
        if eager is None:   # a tensor-parallel rank other than 0: it ran the same collectives, rank 0 judges
            continue
        eager, replayed = eager.float(), replayed.float()
        err = ((eager - replayed).norm() / eager.norm().clamp(min=1e-12)).item()
        if not err <= 1e-3:
            kind = "batch size" if shape.query_len == 1 else f"verify ({shape.query_len} tokens per row), batch size"
            return f"{kind} {shape.num_seqs}: relative logit error {err:.3g}"
    return None
