"""CUDA graphs for decode-only steps (vLLM v1 / nano-vllm's scheme).

A decode step is the same few hundred kernel launches every time; on a GPU the host
cannot issue them as fast as the device runs them at small batch. At load, one graph
per batch size of a ladder (1, 2, 4, 8, then every 16 up to max_num_seqs) is captured
over the step-input buffers (fixed addresses, backend/engine/step_inputs.py); a
decode-only step of n sequences replays the smallest graph of size >= n, its extra
rows padded to write nothing. Mixed prefill/decode steps run eagerly.

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

from backend.engine.scheduler import SchedulerOutput
from backend.engine.step_inputs import dummy_decode
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


def is_decode_only(out: SchedulerOutput) -> bool:
    """Every request adds one token and samples from it (a 1-token prompt counts)."""
    return bool(out.scheduled) and all(s.num_new_tokens == 1 and s.completes_prompt for s in out.scheduled)


def estimate_graph_bytes(cfg: ModelConfig, max_num_seqs: int, dtype_bytes: int, max_splits: int = 16) -> int:
    """Memory the captured graphs keep (one shared pool, sized by the largest batch):
    the logits and one layer's intermediates at max_num_seqs rows (the pool reuses
    memory across layers), plus the split-KV partials. Reserved in the memory plan
    before the KV cache is sized; the measured figure is logged after capture."""
    rows = max_num_seqs
    per_row = (cfg.vocab_size * (dtype_bytes + 4)                        # logits, fp32 copy for sampling
               + dtype_bytes * (4 * cfg.hidden_size                      # embedding, norms, residuals
                                + (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim * 2
                                + 3 * cfg.intermediate_size)
               + 4 * cfg.num_heads * max_splits * (cfg.head_dim + 2))   # split-KV partials
    return rows * per_row


@dataclass
class DecodeGraphs:
    sizes: list[int]
    graphs: dict[int, "torch.cuda.CUDAGraph"] = field(default_factory=dict)
    logits: dict[int, torch.Tensor] = field(default_factory=dict)
    capture_seconds: float = 0.0
    memory_bytes: int = 0

    def size_for(self, out: SchedulerOutput) -> Optional[int]:
        return graph_size_for(len(out.scheduled), self.sizes) if is_decode_only(out) else None

    def replay(self, size: int) -> torch.Tensor:
        """Runs the captured step over what the step-input buffers hold now; returns the
        graph's logits buffer ([size, V], overwritten by the next replay)."""
        self.graphs[size].replay()
        return self.logits[size]


@torch.inference_mode()
def capture_decode_graphs(runner, max_num_seqs: int, max_model_len: int) -> Optional[DecodeGraphs]:
    """Capture, check against eager, and return the graphs; None (engine stays eager)
    on any failure, with the reason logged."""
    from backend.attention.triton_attention import choose_num_splits
    model, caches = runner.model, runner.kv_caches
    cfg = model.config
    graphs = DecodeGraphs(capture_sizes(max_num_seqs))
    rng = np.random.default_rng(0)
    pool = None
    splits = {size: choose_num_splits(size, cfg.num_kv_heads, max_model_len, runner.block_size)
              for size in graphs.sizes}
    try:
        free_before = torch.cuda.mem_get_info(runner.device)[0]
        t0 = time.perf_counter()
        for size in reversed(graphs.sizes):            # largest first: the rest reuse its pool
            step = dummy_decode(runner.inputs, size, rng.integers(0, cfg.vocab_size, size), splits[size])
            if runner.lora is not None:     # the LoRA kernels read their row groups from fixed views too
                runner.lora.use_static(size)

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
                graphs.logits[size] = run_step()
            pool = graph.pool()
            graphs.graphs[size] = graph
        torch.cuda.synchronize(runner.device)
        graphs.capture_seconds = time.perf_counter() - t0
        graphs.memory_bytes = free_before - torch.cuda.mem_get_info(runner.device)[0]
        mismatch = _check_against_eager(graphs, runner, rng, splits)
    except Exception as e:  # noqa: BLE001 - any capture failure means: serve eagerly
        logger.warning("CUDA graph capture failed, running eagerly: %s: %s", type(e).__name__, e)
        return None
    if mismatch:
        logger.warning("CUDA graphs disagree with the eager step (%s); running eagerly", mismatch)
        return None
    logger.info("captured %d decode CUDA graphs (batch sizes %s) in %.1f s using %.1f MiB",
                len(graphs.sizes), graphs.sizes, graphs.capture_seconds, graphs.memory_bytes / 2**20)
    return graphs


def _check_against_eager(graphs: DecodeGraphs, runner, rng, splits: dict[int, int]) -> Optional[str]:
    """Replay each graph on fresh inputs and compare with the eager forward pass on the
    same inputs and the same split-KV factor (so both run the same kernels)."""
    model, cfg = runner.model, runner.model.config
    for size in graphs.sizes:
        step = dummy_decode(runner.inputs, size, rng.integers(0, cfg.vocab_size, size), splits[size])
        if runner.lora is not None:
            runner.lora.use_static(size)
        eager = model.compute_logits(model(step.input_ids, step.positions, runner.kv_caches, step.meta))
        replayed = graphs.replay(size)
        if eager is None:   # a tensor-parallel rank other than 0: it ran the same collectives, rank 0 judges
            continue
        eager, replayed = eager.float(), replayed.float()
        err = ((eager - replayed).norm() / eager.norm().clamp(min=1e-12)).item()
        if not err <= 1e-3:
            return f"batch size {size}: relative logit error {err:.3g}"
    return None
