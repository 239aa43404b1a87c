"""When prefill/decode disaggregation pays: a roofline estimate for `builder plan
--disaggregation` (docs/dynamo.md, "When it pays").

For a workload (prompt and output lengths, requests per second per replica) on a GPU:
- a prompt's prefill time: 2 x active parameters x prompt tokens, at `mfu` of the GPU's
  dense bf16 peak (compute-bound);
- a decode step's floor: the weights read once from memory (memory-bound);
- the prefill share: how much of an aggregated replica's time prefills take (requests
  per second x prefill time). Every decode stream waits while they run: with a step
  budget of `max_num_batched_tokens`, a step that carries a prompt chunk stalls the
  streams by that chunk's compute;
- the copy: the prompt's KV bytes over the link between the two workers (NVLink,
  InfiniBand: `--kv-link-gb-s`).

Disaggregation pays when prefills take a real share of a replica's time (they stall
decoding often) and the copy costs far less than the prefill it moves. The rule's
thresholds (a share of at least 20%, a copy under 20% of the prefill) are a guideline,
not a measurement: measure with `benchmarks.bench_disagg` on the deployment's own GPUs.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from backend.models.config import ModelConfig

# name: (dense bf16 peak FLOP/s, memory bandwidth B/s), from the vendors' data sheets.
GPU_SPECS = {"H100-80GB": (989e12, 3.35e12), "H200-141GB": (989e12, 4.8e12), "A100-80GB": (312e12, 2.04e12),
             "A100-40GB": (312e12, 1.56e12), "L40S-48GB": (362e12, 0.864e12), "L4-24GB": (121e12, 0.3e12)}
MIN_PREFILL_SHARE = 0.2
MAX_COPY_SHARE = 0.2


@dataclass
class DisaggEstimate:
    prefill_s: float            # one prompt's prefill on one GPU
    decode_step_floor_s: float  # one decode step, the weights read once
    chunk_stall_s: float        # what one step's prompt chunk adds to every stream's token
    prefill_share: float        # of an aggregated replica's time
    kv_bytes: int               # one prompt's KV
    copy_s: float               # that KV over the link
    pays: bool
    why: str

    def as_dict(self) -> dict:
        return asdict(self)


def estimate(active_params: int, weight_bytes: int, kv_bytes_per_token: int, gpu: str, input_tokens: int,
             requests_per_s: float, link_gb_s: float, max_num_batched_tokens: int = 2048,
             mfu: float = 0.5) -> DisaggEstimate:
    flops, bandwidth = GPU_SPECS[gpu]
    prefill_s = 2 * active_params * input_tokens / (flops * mfu)
    chunk_stall_s = 2 * active_params * min(input_tokens, max_num_batched_tokens) / (flops * mfu)
    share = requests_per_s * prefill_s
    kv_bytes = kv_bytes_per_token * input_tokens
    copy_s = kv_bytes / (link_gb_s * 1e9)
    if share >= 1:
        pays, why = True, (f"prefills alone need {share:.1f} replicas' time: give them prefill workers of their "
                           f"own (at least {math.ceil(share)}); moving one costs {copy_s * 1e3:.1f} ms of link time")
    elif share < MIN_PREFILL_SHARE:
        pays, why = False, (f"prefills take {share:.0%} of an aggregated replica's time (under "
                            f"{MIN_PREFILL_SHARE:.0%}): chunked prefill bounds their stalls more cheaply")
    elif copy_s > MAX_COPY_SHARE * prefill_s:
        pays, why = False, (f"the copy ({copy_s * 1e3:.1f} ms) costs over {MAX_COPY_SHARE:.0%} of the prefill it "
                            f"moves ({prefill_s * 1e3:.1f} ms): a faster link first")
    else:
        pays, why = True, (f"prefills take {share:.0%} of an aggregated replica's time and each stalls decoding "
                           f"by up to {chunk_stall_s * 1e3:.1f} ms a step; moving one costs "
                           f"{copy_s * 1e3:.1f} ms of link time")
    return DisaggEstimate(prefill_s, weight_bytes / bandwidth, chunk_stall_s, share, kv_bytes, copy_s, pays, why)


def format_estimate(e: DisaggEstimate, input_tokens: int, requests_per_s: float) -> str:
    return "\n".join([
        f"disaggregation, {input_tokens:,}-token prompts at {requests_per_s:.2f} requests/s per replica:",
        f"  prefill {e.prefill_s * 1e3:,.1f} ms each ({e.prefill_share:.0%} of a replica's time); decode step floor "
        f"{e.decode_step_floor_s * 1e3:.2f} ms; a prompt chunk stalls a step by {e.chunk_stall_s * 1e3:.1f} ms",
        f"  KV to move {e.kv_bytes / 2**20:,.1f} MiB a prompt: {e.copy_s * 1e3:.2f} ms over the link",
        f"  {'pays' if e.pays else 'does not pay'}: {e.why}",
    ])


def estimate_for(cfg: ModelConfig, weights: str, kv_dtype: str, gpu: str, input_tokens: int,
                 requests_per_s: float, link_gb_s: float, max_num_batched_tokens: int = 2048) -> DisaggEstimate:
    """The estimate for a model config on one GPU (tp 1), weights and KV as the plan's rows."""
    from builder import plan
    return estimate(plan.count_params(cfg).active, plan.weight_bytes(cfg, weights),
                    plan.kv_bytes_per_token(cfg, kv_dtype), gpu, input_tokens, requests_per_s, link_gb_s,
                    max_num_batched_tokens)
