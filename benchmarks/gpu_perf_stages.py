"""The stages of benchmarks/gpu_perf.py, one process each:

    python -m benchmarks.gpu_perf_stages STAGE RESULT.json WORKDIR

Each writes RESULT.json after every figure it gets (a stage killed at its budget keeps
them). Checkpoints go to WORKDIR, shared by the stages of one call: the 8B's random bf16
weights are made once (a marker file says the save finished). Random weights, real
configurations; the FP8 checkpoint's weights are rounded by the builder's own function
(builder.fp8.quantize_per_channel) and written by its writer, with dynamic per-token
activation scales: random weights make calibration and its quality report meaningless.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import sys
import time
from typing import Callable

import torch

# (input, output, requests): TensorRT-LLM's perf-overview lengths, as many requests as the budget allows.
FP8_WORKLOADS = ((1000, 1000, 512), (128, 128, 2048))
DEVICE = "cuda"


class Figures(dict):
    """A dict written to its file at every assignment."""

    def __init__(self, path: str) -> None:
        super().__init__()
        self.path = path

    def __setitem__(self, key, value) -> None:
        super().__setitem__(key, value)
        with open(self.path + ".tmp", "w") as f:        # a stage killed mid-write leaves the last whole file
            json.dump(self, f, indent=2)
        os.replace(self.path + ".tmp", self.path)


def ensure_checkpoint(name: str, work: str) -> str:
    """benchmarks.gpu_check's random checkpoint `name`, made once per WORKDIR."""
    from benchmarks.gpu_check import make_checkpoint
    path = os.path.join(work, name)
    if not os.path.isfile(os.path.join(path, ".complete")):
        shutil.rmtree(path, ignore_errors=True)          # a save cut short by a stage's budget
        make_checkpoint(name, work)
        open(os.path.join(path, ".complete"), "w").close()
    return path


def fp8_checkpoint(src: str, dst: str, device: str = DEVICE) -> str:
    """`src`'s decoder projections rounded to FP8 E4M3 per output channel on `device` (the
    builder's quantize_per_channel), written by the builder's writer as a paged_llm_fp8
    checkpoint with dynamic per-token activations."""
    from backend.models.fp8 import PROJECTIONS, QUANT_METHOD, quantize_per_channel
    from backend.models.loader import load_weights
    from builder.entry_files import write_fp8_checkpoint
    if os.path.isfile(os.path.join(dst, ".complete")):
        return dst
    state = load_weights(src)
    for name in [k[:-len(".weight")] for k in state if k.endswith(".weight")]:
        if name.split("model.layers.")[-1].split(".", 1)[-1] in PROJECTIONS:
            q, scale = quantize_per_channel(state[f"{name}.weight"].to(device))
            state[f"{name}.weight"], state[f"{name}.weight_scale"] = q.cpu(), scale.cpu()
    qcfg = {"quant_method": QUANT_METHOD, "weights": "fp8_e4m3_per_channel", "activation_scheme": "dynamic",
            "activations": "fp8_e4m3_dynamic_per_token"}
    write_fp8_checkpoint(src, dst, state, qcfg)
    open(os.path.join(dst, ".complete"), "w").close()
    return dst


def throughput(llm, vocab: int, input_len: int, output_len: int, num_requests: int) -> dict:
    """Total output tokens/s of one generate call: synthetic token-id prompts of fixed
    length, fixed output length (ignore_eos), greedy, as TensorRT-LLM's perf overview."""
    from backend import SamplingParams
    rng = random.Random(0)
    top = min(vocab - 1, 30000)
    prompts = [[rng.randint(10, top) for _ in range(input_len)] for _ in range(num_requests)]
    params = SamplingParams(max_tokens=output_len, min_tokens=output_len, temperature=0, ignore_eos=True)
    llm.generate(prompts[:4], SamplingParams(max_tokens=8, temperature=0))          # warm-up
    _sync()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    _sync()
    seconds = time.perf_counter() - t0
    tokens = sum(len(o.token_ids) for o in outs)
    return {"requests": num_requests, "input_len": input_len, "output_len": output_len, "output_tokens": tokens,
            "seconds": seconds, "output_tok_per_s": tokens / seconds}


def decode_vs_floor(llm, bandwidth_gbs: float, tokens: int = 64) -> dict:
    from backend import SamplingParams
    from benchmarks.bench_steps import decode_step_ms
    from benchmarks.gpu_check import weight_bytes
    ms = decode_step_ms(llm, [list(range(10, 42))],
                        lambda n: SamplingParams(max_tokens=n, min_tokens=n, temperature=0, ignore_eos=True), tokens)
    floor = weight_bytes(llm.engine.model) / (bandwidth_gbs * 1e9) * 1e3
    return {"ms_per_step": ms, "weight_read_floor_ms": floor, "x_floor": ms / floor}


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _bandwidth(fig: Figures) -> float:
    from benchmarks.device_bandwidth import copy_bandwidth_gbs
    fig["copy_bandwidth_gbs"] = bw = copy_bandwidth_gbs()
    return bw


def _close(llm) -> None:
    from benchmarks.gpu_check import _free, _release
    _free(llm)
    _release()


def kernels(fig: Figures, work: str) -> None:
    from benchmarks import quant_kernel_bench as q
    bw, dev = _bandwidth(fig), torch.device(DEVICE)
    fig["fp8"] = q.fp8_rows(bw, dev)
    fig["w8a8"] = q.w8a8_rows(bw, dev)
    fig["int4"] = []
    for shape in q.INT4_SHAPES:                         # kept row by row: the stage's budget may end it
        fig["int4"] = fig["int4"] + q.int4_rows(bw, dev, [shape])
    fig["int8_kv"] = q.int8_kv_rows(bw, dev)


def fp8_8b(fig: Figures, work: str, workloads=FP8_WORKLOADS, name: str = "llama-3.1-8b", **engine) -> None:
    from benchmarks.gpu_check import _llm, _vocab
    bw = _bandwidth(fig)
    bf16 = ensure_checkpoint(name, work)
    fp8 = fp8_checkpoint(bf16, os.path.join(work, f"{name}-fp8"))
    args = dict(max_num_seqs=512, max_num_batched_tokens=8192, max_model_len=2048, **engine)
    for label, path, kv in (("fp8", fp8, "fp8"), ("bf16", bf16, "auto")):
        llm = _llm(path, kv_cache_dtype=kv, **args)
        fig[f"{label}_decode_batch1"] = decode_vs_floor(llm, bw)
        for input_len, output_len, n in workloads:
            fig[f"{label}_{input_len}_{output_len}"] = throughput(llm, _vocab(path), input_len, output_len, n)
        _close(llm)
        del llm


def nano_1b(fig: Figures, work: str) -> None:
    from benchmarks.gpu_check import decode_profile, nano_vllm_workload
    path = ensure_checkpoint("llama-3.2-1b", work)
    fig["nano_vllm_workload"] = nano_vllm_workload(path)
    prof = decode_profile(path)
    prof["device_busy"] = prof["device_ms_per_step"] / prof["wall_ms_per_step"]
    fig["decode_profile"] = prof


def int4_8b(fig: Figures, work: str) -> None:
    from benchmarks import bench_int
    path = ensure_checkpoint("llama-3.1-8b", work)
    fig["int4"] = bench_int.main(["--checkpoint", path, "--tokens", "64", "--repeats", "2", "--batch", "1", "64",
                                  "--quantize-on", DEVICE])["results"]


def moe_mxfp4(fig: Figures, work: str) -> None:
    from benchmarks import moe_kernel_bench
    bw = _bandwidth(fig)
    shapes = [s for s in moe_kernel_bench.SHAPES if s[0].startswith("gpt-oss")]
    fig["moe"] = moe_kernel_bench.run(bw, torch.device(DEVICE), shapes=shapes, batches=[1, 16, 64])


def lora(fig: Figures, work: str) -> None:
    from benchmarks import bench_lora
    from benchmarks.gpu_check import LORA_BENCH
    out = bench_lora.main(LORA_BENCH + ["--profile"])
    fig["lora"], fig["lora_profile"] = out["results"], out["profile"]


STAGES: dict[str, Callable[[Figures, str], None]] = {
    "kernels": kernels, "fp8_8b": fp8_8b, "nano_1b": nano_1b, "int4_8b": int4_8b, "moe_mxfp4": moe_mxfp4,
    "lora": lora}


def main(argv=None) -> int:
    name, result, work = argv if argv is not None else sys.argv[1:]
    os.makedirs(work, exist_ok=True)
    STAGES[name](Figures(result), work)
    return 0


if __name__ == "__main__":
    sys.exit(main())
