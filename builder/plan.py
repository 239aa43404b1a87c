"""Capacity and cost planner: `python -m builder plan`.

For a checkpoint (or a named public config) and a GPU: weight bytes per dtype, KV bytes
per token, how many sequences fit at given context lengths for each tensor-parallel
size, and for a workload the replicas, monthly cost, cost per million tokens and the
volume at which self-hosting breaks even with an API price.

The memory rows follow the engine's own rules, so that they agree with what it
allocates (tests/unit/builder/test_plan.py checks them against a loaded engine):
weights are the parameters the engine loads (fused projections have the same counts);
KV is 2 x layers x kv_heads x head_dim x element size per token, allocated in blocks of
`block_size` tokens; on a GPU the budget is the device's total memory x
`gpu_memory_utilization` (as in vLLM, and as the engine reads it) minus the weights and the
decode CUDA graphs' pool. That is an upper bound: the engine also takes off what it finds
at load (backend/engine/sizing.py) and a plan cannot know, the CUDA context and anything
else on the device, the peak activation memory of its profile run (a prefill of
max_num_batched_tokens tokens, the sampler at max_num_seqs rows) and the sampler's
penalty tables. With tensor parallelism each rank holds what
backend/parallel/sharding.py gives it: 1/tp of the heads, MLP channels and (padded)
vocabulary, whole norms, and a whole KV head (its projections too) when there are fewer
KV heads than ranks. With pipeline parallelism (--pp) each stage holds its layers
(backend/parallel/pipeline.py's split), stage 0 the embedding, the last stage the final
norm and the LM head (its own copy of a tied embedding); the rows give the fullest stage's
GPU, and the pipeline bubble: with M micro-batches in flight over P stages each GPU idles
1 - min(M, P) / P of a decode step's time (the engine's default M = P:
max_concurrent_batches, backend/engine/scheduling/batch_queue.py).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Optional

from backend.engine.runner.cuda_graphs import estimate_graph_bytes
from backend.models.config import ModelConfig
from backend.parallel.pipeline import PipelineStage, stage_kv_config
from backend.parallel.sharding import local_config, local_vocab_size
from builder.plan_draft import NONE as NO_DRAFTER
from builder.plan_draft import Drafter, drafter

if TYPE_CHECKING:
    from builder.build import BuildOptions

HOURS_PER_MONTH = 720  # 30 days: the usual cloud pricing month

# name: (memory GiB, on-demand $/h); override with --gpu-memory-gb / --gpu-price-per-hour.
GPUS = {"H100-80GB": (80, 4.50), "H200-141GB": (141, 5.50), "A100-80GB": (80, 3.50),
        "A100-40GB": (40, 2.50), "L40S-48GB": (48, 1.80), "L4-24GB": (24, 0.80)}
# Bytes per weight of the linear layers; embeddings, lm_head and norms stay 16-bit.
# Scales: FP8 and INT8 one fp32 per output channel, INT4 one bf16 per group of 128.
WEIGHT_DTYPES = {"float32": 4.0, "bf16": 2.0, "fp8": 1.0, "int8": 1.0, "w8a8": 1.0, "int4": 0.5, "mxfp4": 2.0}
# gpt-oss's MXFP4 experts as published, kept packed on the GPU (the Triton fused MoE
# decodes them): 4 bits a weight plus one E8M0 byte per 32; the other weights stay bf16.
MXFP4_BYTES = 17 / 32
KV_DTYPES = {"float32": 4, "bf16": 2, "fp8": 1, "int8": 1}


@dataclass
class ParamCounts:
    linear: int           # q/k/v/o and gate/up/down weights (what quantization shrinks)
    linear_rows: int      # their output channels (one scale each for fp8/int8)
    other: int            # embedding, lm_head, norms, biases, MoE routers (kept 16-bit)
    # Mixture of experts: the expert weights a token does not use (E - top_k experts per
    # sparse layer); 0 for dense models.
    inactive: int = 0

    @property
    def total(self) -> int:
        return self.linear + self.other

    @property
    def active(self) -> int:
        """Parameters one token runs through (what a decode step's compute scales with)."""
        return self.total - self.inactive


def stages(cfg: ModelConfig, tp: int, pp: int) -> list[Optional[PipelineStage]]:
    """Each pipeline stage (as its first rank sees it); [None] without pipeline parallelism."""
    if pp == 1:
        return [None]
    return [PipelineStage.of(s * tp, tp, pp, cfg.num_layers) for s in range(pp)]


def count_params(cfg: ModelConfig, tp: int = 1, stage: Optional[PipelineStage] = None) -> ParamCounts:
    """Parameters one rank of tp holds (of its pipeline stage's layers, with one)."""
    h, hd = cfg.hidden_size, cfg.head_dim
    first, last = (0, cfg.num_layers) if stage is None else (stage.start_layer, stage.end_layer)
    layers = last - first
    local = local_config(cfg, tp)
    q, kv, inter = local.num_heads * hd, local.num_kv_heads * hd, local.intermediate_size
    linear_per_layer = h * (q + 2 * kv) + q * h + 3 * h * inter
    # Output channels (one scale each): o_proj's and down_proj's are whole on every rank.
    rows_per_layer = (q + 2 * kv) + h + 2 * inter + h
    other_per_layer = (2 * h + (q + 2 * kv if cfg.qkv_bias else 0) + (h if cfg.o_bias else 0)
                       + (2 * hd if cfg.qk_norm else 0) + (local.num_heads if cfg.attention_sinks else 0))
    embed = local_vocab_size(cfg, tp) * h
    if stage is None:
        other = embed * (1 if cfg.tie_word_embeddings else 2) + layers * other_per_layer + h
    else:       # embedding on stage 0; final norm and head (a tied one copied) on the last
        other = embed * (stage.is_first + stage.is_last) + layers * other_per_layer + h * stage.is_last
    counts = ParamCounts(linear=layers * linear_per_layer, linear_rows=layers * rows_per_layer, other=other)
    return _with_experts(counts, local, first, last) if local.moe is not None else counts


def _with_experts(p: ParamCounts, local: ModelConfig, first: int, last: int) -> ParamCounts:
    """Sparse layers hold E experts of [2I, H] + [H, I], a router [E, H] and Qwen2-MoE's
    shared expert and its [1, H] gate instead of the dense MLP (one rank's share: its
    experts' channels, or with expert parallelism its whole experts); gpt-oss adds a
    router bias [E] and expert biases [E, 2I] + [E, H]."""
    moe, h = local.moe, local.hidden_size
    sparse = sum(moe.sparse_layers[first:last])
    E, i, s = moe.num_local_experts, moe.intermediate_size, moe.shared_expert_intermediate_size
    dense_linear, dense_rows = 3 * h * local.intermediate_size, 2 * local.intermediate_size + h
    linear = E * 3 * h * i + 3 * h * s
    rows = E * (2 * i + h) + (2 * s + h if s else 0)
    router = moe.num_experts * h + (h if s else 0) + (moe.num_experts if moe.router_bias else 0)
    biases = E * (2 * i + h) if moe.expert_bias else 0
    # Expected per rank: the top_k of all num_experts are spread over the ranks' experts.
    unused = E - moe.top_k * E / moe.num_experts
    return ParamCounts(linear=p.linear + sparse * (linear - dense_linear),
                       linear_rows=p.linear_rows + sparse * (rows - dense_rows),
                       other=p.other + sparse * (router + biases),
                       inactive=int(sparse * unused * (3 * h * i + (2 * i + h if moe.expert_bias else 0))))


def weight_bytes(cfg: ModelConfig, dtype: str, tp: int = 1, stage: Optional[PipelineStage] = None) -> int:
    """Bytes of weights on one rank (of a pipeline stage)."""
    p = count_params(cfg, tp, stage)
    if dtype == "float32":
        return p.total * 4
    linear = p.linear * WEIGHT_DTYPES[dtype]
    if dtype == "mxfp4":
        if not cfg.mxfp4_experts:
            raise ValueError(f"weights 'mxfp4' are gpt-oss's published experts; {cfg.architecture} has none")
        moe = local_config(cfg, tp).moe
        experts = sum(moe.sparse_layers) * moe.num_local_experts * 3 * cfg.hidden_size * moe.intermediate_size
        linear -= experts * (WEIGHT_DTYPES["bf16"] - MXFP4_BYTES)
    if dtype in ("fp8", "int8", "w8a8"):
        linear += p.linear_rows * 4
    if dtype == "fp8" and cfg.moe is not None and cfg.moe.shared_expert_intermediate_size:
        # FP8 builds keep Qwen2-MoE's shared expert in the source dtype (backend/models/moe_fp8.py).
        first, last = (0, cfg.num_layers) if stage is None else (stage.start_layer, stage.end_layer)
        s, h = local_config(cfg, tp).moe.shared_expert_intermediate_size, cfg.hidden_size
        linear += sum(cfg.moe.sparse_layers[first:last]) * (3 * h * s * (WEIGHT_DTYPES["bf16"] - 1) - (2 * s + h) * 4)
    elif dtype == "int4":
        linear += p.linear / 128 * 2
    return int(linear + p.other * 2)


def kv_bytes_per_token(cfg: ModelConfig, kv_dtype: str, tp: int = 1, stage: Optional[PipelineStage] = None) -> int:
    return stage_kv_config(local_config(cfg, tp), stage).kv_bytes_per_token * KV_DTYPES[kv_dtype]


def kv_blocks(budget_bytes: int, cfg: ModelConfig, kv_dtype: str, block_size: int, tp: int = 1,
              stage: Optional[PipelineStage] = None) -> int:
    """Blocks the engine allocates from a KV budget (backend/engine/sizing.py)."""
    return max(budget_bytes // (kv_bytes_per_token(cfg, kv_dtype, tp, stage) * block_size), 0)


def pipeline_bubble(pp: int, micro_batches: int) -> float:
    """The share of a decode step each GPU idles with `micro_batches` batches in flight
    over `pp` stages: a batch occupies one stage at a time, so min(M, P) of P are busy."""
    return 1.0 - min(micro_batches, pp) / pp


def max_sequences(blocks: int, context_len: int, block_size: int) -> int:
    """Sequences of `context_len` tokens that fit in `blocks` at once (no prefix sharing)."""
    return blocks // math.ceil(context_len / block_size)


@dataclass
class StageRow:
    layers: tuple[int, int]         # [start, end)
    weight_bytes_per_rank: int
    kv_bytes_per_token_per_rank: int


@dataclass
class MemoryRow:
    tp: int
    weights: str
    weight_bytes_per_rank: int
    cuda_graph_bytes: int
    kv_budget_bytes_per_rank: int
    kv_bytes_per_token_per_rank: int
    kv_blocks: int
    max_sequences: dict[int, int]  # context length -> sequences
    fits: bool
    # Pipeline parallelism: the figures above are the fullest stage's (the KV blocks the
    # tightest stage's: every stage holds the same block ids).
    pp: int = 1
    pipeline_bubble: float = 0.0
    micro_batches: int = 1
    stages: list[StageRow] = field(default_factory=list)
    # kv_offloading_size: tokens of KV the host tier holds beside the device's (0: none).
    host_kv_tokens: int = 0

    @property
    def gpus(self) -> int:
        return self.tp * self.pp


def memory_rows(cfg: ModelConfig, gpu_memory_gb: float, gpu_memory_utilization: float, weights: list[str],
                kv_dtype: str, tps: list[int], context_lens: list[int], block_size: int,
                max_num_seqs: int, pps: tuple[int, ...] = (1,), micro_batches: Optional[int] = None,
                kv_offloading_gb: Optional[float] = None, drafter: Drafter = NO_DRAFTER) -> list[MemoryRow]:
    """kv_offloading_gb: the engine's kv_offloading_size, the host tier per replica (one
    rank: the engine refuses it with more): each row says how many tokens it holds.
    drafter: a speculative drafter's weights and K/V (plan_draft.py), on every rank."""
    rows = []
    act_bytes = 4 if kv_dtype == "float32" else 2
    for pp in pps:
        for tp in tps:
            for w in weights:
                rows.append(_memory_row(cfg, gpu_memory_gb * 2**30 * gpu_memory_utilization, w, kv_dtype, tp, pp,
                                        context_lens, block_size, max_num_seqs, act_bytes, micro_batches or pp,
                                        drafter))
                if kv_offloading_gb:
                    row = rows[-1]
                    row.host_kv_tokens = int(kv_offloading_gb * 2**30) // (row.kv_bytes_per_token_per_rank * tp)
    return rows


def _memory_row(cfg: ModelConfig, usable: float, w: str, kv_dtype: str, tp: int, pp: int, context_lens: list[int],
                block_size: int, max_num_seqs: int, act_bytes: int, micro_batches: int,
                drafter: Drafter = NO_DRAFTER) -> MemoryRow:
    # The engine captures no decode CUDA graphs under pipeline parallelism.
    graphs = estimate_graph_bytes(cfg, max_num_seqs, act_bytes) if pp == 1 else 0
    per_stage = [StageRow((s.start_layer, s.end_layer) if s else (0, cfg.num_layers),
                          weight_bytes(cfg, w, tp, s) + drafter.weight_bytes(act_bytes),
                          kv_bytes_per_token(cfg, kv_dtype, tp, s) + drafter.kv_elems_per_token * KV_DTYPES[kv_dtype])
                 for s in stages(cfg, tp, pp)]
    budgets = [max(int(usable) - s.weight_bytes_per_rank - graphs, 0) for s in per_stage]
    blocks = min(b // (s.kv_bytes_per_token_per_rank * block_size) for b, s in zip(budgets, per_stage))
    return MemoryRow(tp, w, max(s.weight_bytes_per_rank for s in per_stage), graphs, min(budgets),
                     max(s.kv_bytes_per_token_per_rank for s in per_stage), blocks,
                     {n: max_sequences(blocks, n, block_size) for n in context_lens}, blocks > 0, pp,
                     pipeline_bubble(pp, micro_batches), micro_batches, per_stage if pp > 1 else [])


@dataclass
class CostPlan:
    gpus_per_replica: int
    replicas: int
    gpu_price_per_hour: float
    monthly_cost: float
    monthly_tokens: float
    cost_per_million_tokens: Optional[float]
    api_price_per_million: Optional[float]
    break_even_tokens_per_month: Optional[float]


def cost_plan(gpu_price_per_hour: float, gpus: int = 1, requests_per_day: float = 0.0, input_tokens: int = 0,
              output_tokens: int = 0, output_tokens_per_s: Optional[float] = None,
              api_price_per_million: Optional[float] = None) -> CostPlan:
    """Replicas from the output-token rate the workload needs and what one replica
    sustains (measured with `benchmarks.bench`, or entered); at least one."""
    need = requests_per_day * output_tokens / 86400
    replicas = max(1, math.ceil(need / output_tokens_per_s)) if output_tokens_per_s else 1
    monthly = replicas * gpus * gpu_price_per_hour * HOURS_PER_MONTH
    tokens = requests_per_day * 30 * (input_tokens + output_tokens)
    per_million = monthly / (tokens / 1e6) if tokens else None
    break_even = monthly / api_price_per_million * 1e6 if api_price_per_million else None
    return CostPlan(gpus, replicas, gpu_price_per_hour, monthly, tokens, per_million, api_price_per_million,
                    break_even)


def format_report(name: str, gpu: str, rows: list[MemoryRow], cost: Optional[CostPlan],
                  params: Optional[ParamCounts] = None) -> str:
    gib = 2**30
    ctx = sorted(rows[0].max_sequences) if rows else []
    out = [f"{name} on {gpu}"]
    if params is not None:
        out.append(f"parameters: {params.total:,} total, {params.active:,} active per token")
    pipeline = any(r.pp > 1 for r in rows)
    par = f"{'tp':>3} {'pp':>3} {'bubble':>7}" if pipeline else f"{'tp':>3}"
    host = any(r.host_kv_tokens for r in rows)
    out.append(f"{par} {'weights':>8} {'GiB/GPU':>9} {'KV KiB/token':>13} {'KV GiB/GPU':>12} "
               + " ".join(f"{'seqs@' + str(n):>11}" for n in ctx) + (f" {'host KV tokens':>15}" if host else ""))
    for r in rows:
        seqs = " ".join(f"{r.max_sequences[n]:>11,}" for n in ctx) if r.fits else "does not fit".rjust(11)
        par = f"{r.tp:>3} {r.pp:>3} {r.pipeline_bubble:>7.0%}" if pipeline else f"{r.tp:>3}"
        out.append(f"{par} {r.weights:>8} {r.weight_bytes_per_rank / gib:>9.2f} "
                   f"{r.kv_bytes_per_token_per_rank / 1024:>13.1f} {r.kv_budget_bytes_per_rank / gib:>12.2f} {seqs}"
                   + (f" {r.host_kv_tokens:>15,}" if host else ""))
    if host:
        out.append("host KV tokens: what kv_offloading_size holds in host memory beside the device's KV (every "
                   "computed full block is kept there; a prefix past the device's hits is copied back)")
    if pipeline:
        ms = sorted({r.micro_batches for r in rows if r.pp > 1}) or [1]
        m = str(ms[0]) if len(ms) == 1 else "P"
        out.append(f"GiB/GPU and KV: the fullest pipeline stage's GPU; bubble: the share of a decode step each GPU "
                   f"idles with {m} micro-batch{'' if m == '1' else 'es'} in flight")
    if cost:
        out.append(f"workload: {cost.replicas} replica(s) x {cost.gpus_per_replica} GPU(s) at "
                   f"${cost.gpu_price_per_hour:.2f}/h = ${cost.monthly_cost:,.0f}/month")
        if cost.cost_per_million_tokens is not None:
            out.append(f"  {cost.monthly_tokens / 1e6:,.1f}M tokens/month: ${cost.cost_per_million_tokens:,.2f} "
                       "per million tokens")
        if cost.break_even_tokens_per_month is not None:
            out.append(f"  break-even with an API at ${cost.api_price_per_million:g}/M tokens: "
                       f"{cost.break_even_tokens_per_month / 1e6:,.1f}M tokens/month")
    return "\n".join(out)


def as_json(name: str, gpu: str, rows: list[MemoryRow], cost: Optional[CostPlan],
            params: Optional[ParamCounts] = None) -> dict:
    out = {"model": name, "gpu": gpu, "memory": [asdict(r) for r in rows], "cost": asdict(cost) if cost else None}
    if params is not None:
        out["parameters"] = {"total": params.total, "active": params.active}
    return out


def _llama(vocab, hidden, inter, layers, heads, kv, arch="LlamaForCausalLM", **extra) -> dict:
    return {"architectures": [arch], "vocab_size": vocab, "hidden_size": hidden, "intermediate_size": inter,
            "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv,
            "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "torch_dtype": "bfloat16", **extra}


# Dimensions of public configs, for planning without the checkpoint at hand.
NAMED_CONFIGS = {
    "llama-3.1-8b": _llama(128256, 4096, 14336, 32, 32, 8, rope_theta=500000.0),
    "llama-3.1-70b": _llama(128256, 8192, 28672, 80, 64, 8, rope_theta=500000.0),
    "llama-3.1-405b": _llama(128256, 16384, 53248, 126, 128, 8, rope_theta=500000.0),
    "mistral-7b-v0.3": _llama(32768, 4096, 14336, 32, 32, 8, arch="MistralForCausalLM"),
    "qwen2.5-7b": _llama(152064, 3584, 18944, 28, 28, 4, arch="Qwen2ForCausalLM"),
    "mixtral-8x7b": _llama(32000, 4096, 14336, 32, 32, 8, arch="MixtralForCausalLM", num_local_experts=8,
                           num_experts_per_tok=2, rope_theta=1e6),
    "gpt-oss-20b": _llama(201088, 2880, 2880, 24, 64, 8, arch="GptOssForCausalLM", head_dim=64,
                          num_local_experts=32, num_experts_per_tok=4, sliding_window=128, rope_theta=150000.0,
                          quantization_config={"quant_method": "mxfp4"}),
    "gpt-oss-120b": _llama(201088, 2880, 2880, 36, 64, 8, arch="GptOssForCausalLM", head_dim=64,
                           num_local_experts=128, num_experts_per_tok=4, sliding_window=128, rope_theta=150000.0,
                           quantization_config={"quant_method": "mxfp4"}),
    "qwen3-30b-a3b": _llama(151936, 2048, 6144, 48, 32, 4, arch="Qwen3MoeForCausalLM", head_dim=128, num_experts=128,
                            num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True),
}


def memory_plan(cfg, weight_bytes: int, kv_bytes_per_elem: int, opts: "BuildOptions",
                vision: Optional[dict] = None) -> dict:
    """The build's memory plan, per device. KV bytes per token = 2 x layers x kv_heads x
    head_dim x bytes (K and V), with each rank's KV heads under tensor parallelism and its
    stage's layers under pipeline parallelism (the fullest stage's GPU). The budget is
    total memory x gpu_memory_utilization less weights and CUDA graphs: the engine's KV
    cache is smaller by what its profile run finds at load (module docstring). vision
    (plan_vision.py): a vision-language model's tower (inside the weights' bytes) and
    encoder cache (taken from the KV cache's budget)."""
    tp, pp = opts.tensor_parallel_size, opts.pipeline_parallel_size
    kv_per_token = max(stage_kv_config(local_config(cfg, tp), s).kv_bytes_per_token for s in stages(cfg, tp, pp))
    draft = drafter(opts.speculative)       # (its K/V in the same blocks, its weights beside the target's)
    kv_per_token = (kv_per_token + draft.kv_elems_per_token) * kv_bytes_per_elem
    # The files' bytes, shared as the parameters are (norms replicated: a few KiB more in truth).
    total = count_params(cfg).total
    share = max(count_params(cfg, 1, s).total for s in stages(cfg, 1, pp)) / total
    weight_bytes = -(-int(weight_bytes * share) // tp) + draft.weight_bytes()
    budget = opts.gpu_memory_gb * 2**30 * opts.gpu_memory_utilization
    # The torch engine on a GPU captures decode CUDA graphs (every rank; none under
    # pipeline parallelism); the engine reserves their pool before sizing the KV cache,
    # and so does the plan (bf16 activations).
    graph_bytes = estimate_graph_bytes(cfg, opts.max_num_seqs, 2) if opts.engine == "torch" and pp == 1 else 0
    encoder_cache = vision["encoder_cache_bytes"] if vision else 0
    kv_budget = max(budget - weight_bytes - graph_bytes - encoder_cache, 0)
    tokens = int(kv_budget // kv_per_token)
    params = count_params(cfg)
    return {"weight_bytes": weight_bytes, "cuda_graph_bytes": graph_bytes, "kv_bytes_per_token": kv_per_token,
            "gpu_memory_gb": opts.gpu_memory_gb, "gpu_memory_utilization": opts.gpu_memory_utilization,
            "kv_cache_bytes": int(kv_budget), "kv_tokens": tokens, "plan_seq_len": opts.plan_seq_len,
            "concurrent_seqs_at_plan_len": tokens // opts.plan_seq_len, "tensor_parallel_size": tp,
            "pipeline_parallel_size": pp, "parameters": {"total": params.total, "active": params.active},
            **({"vision": vision} if vision else {})}


def format_plan(p: dict) -> str:
    """The memory plan as the build prints it."""
    gib = 2**30
    gpus = p.get("tensor_parallel_size", 1) * p.get("pipeline_parallel_size", 1)
    per = f", per GPU of {gpus}" if gpus > 1 else ""
    params = p.get("parameters")
    moe = f"; parameters {params['total']:,} total, {params['active']:,} active" if (
        params and params["active"] != params["total"]) else ""
    return (f"memory plan ({p['gpu_memory_gb']:g} GiB x {p['gpu_memory_utilization']:g}{per}{moe}): weights "
            f"{p['weight_bytes'] / gib:.3f} GiB{_vision_text(p.get('vision'))}; CUDA graphs {p['cuda_graph_bytes'] / gib:.3f} GiB; "
            f"KV {p['kv_bytes_per_token'] / 1024:.1f} KiB/token; KV cache "
            f"{p['kv_cache_bytes'] / gib:.2f} GiB = {p['kv_tokens']:,} tokens = "
            f"{p['concurrent_seqs_at_plan_len']:,} concurrent sequences of {p['plan_seq_len']} tokens "
            "(at most: the engine also takes off the CUDA context and the activation peak its profile "
            "run measures at load)")


def _vision_text(vision: Optional[dict]) -> str:
    if not vision:
        return ""
    mib = 2**20
    return (f" (vision tower {vision['vision_tower_bytes'] / mib:.1f} MiB of them); encoder cache "
            f"{vision['encoder_cache_rows']:,} rows = {vision['encoder_cache_bytes'] / mib:.1f} MiB")
