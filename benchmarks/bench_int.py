"""INT4 / INT8 weight-only decode vs the same model in bf16, side by side in one run.

    python -m benchmarks.bench_int --checkpoint /ckpt/bf16-model [--bits 4 --group-size 128] [--batch 1 64]

The quantized copy is written here in the GPTQ layout (round-to-nearest, symmetric,
groups of `group_size` input channels), which the engine reads as any GPTQ checkpoint.
A decode step's time is (time for `tokens` tokens - time for 1 token) / (tokens - 1), the
median of `repeats` alternating runs, at each `--batch` (that many requests at once).
Issue 50's targets on a GPU: INT4 at batch 1 >= 2.5x faster than bf16, at batch 64 no
slower. `--quantize-on cuda` rounds the weights on the GPU (an 8B model in seconds).

On CPU the engine's INT path dequantizes the weights once and runs dense GEMMs (the
reference path), so a CPU run checks the plumbing, not the speed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile

import torch
from safetensors.torch import load_file, save_file

from backend.models.int_formats import pack_along_k
from benchmarks.bench_steps import decode_step_ms, report

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_gptq_rtn(src: str, dst: str, bits: int, group_size: int, device: str = "cpu") -> str:
    """A GPTQ-format (v1, no act order) copy of `src`: qweight packed along the input
    dimension, qzeros (zero - 1) packed along the output dimension, fp16 scales; the
    rounding done on `device`."""
    if os.path.isfile(os.path.join(dst, "config.json")):
        return dst
    os.makedirs(dst, exist_ok=True)
    state = {}
    for f in sorted(os.listdir(src)):
        if f.endswith(".safetensors"):
            state.update(load_file(os.path.join(src, f)))
        elif os.path.isfile(os.path.join(src, f)):
            shutil.copy2(os.path.join(src, f), os.path.join(dst, f))
    half, top = 1 << (bits - 1), (1 << bits) - 1
    for name in [k[:-7] for k in state if k.endswith(".weight") and k.split(".")[-2] in PROJECTIONS]:
        w = state.pop(f"{name}.weight").to(device).float().t()              # [K, N]
        K, N = w.shape
        groups = w.reshape(K // group_size, group_size, N)
        scales = (groups.abs().amax(1) / (half - 1)).clamp(min=1e-8).half()     # [G, N]: +-(half - 1) steps
        q = (torch.round(groups / scales.float()[:, None]) + half).clamp(0, top).reshape(K, N).to(torch.int32)
        state[f"{name}.qweight"] = pack_along_k(q, bits).cpu()
        zeros = torch.full((K // group_size, N), half - 1, dtype=torch.int32)   # v1 stores zero - 1
        state[f"{name}.qzeros"] = pack_along_k(zeros.t().contiguous(), bits).t().contiguous()
        state[f"{name}.scales"] = scales.cpu()
        state[f"{name}.g_idx"] = (torch.arange(K) // group_size).to(torch.int32)
    save_file(state, os.path.join(dst, "model.safetensors"))
    with open(os.path.join(dst, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": bits, "group_size": group_size, "desc_act": False,
                                  "sym": True, "checkpoint_format": "gptq"}
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    return dst


def step_ms(llm, prompts: list[list[int]], tokens: int) -> float:
    from backend import SamplingParams
    return decode_step_ms(llm, prompts, lambda n: SamplingParams(max_tokens=n, temperature=0, ignore_eos=True),
                          tokens)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", required=True, help="a bf16 (or fp32) checkpoint folder")
    ap.add_argument("--bits", type=int, default=4, choices=[4, 8])
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batch", type=int, nargs="+", default=[1])
    ap.add_argument("--quantize-on", default="cpu", help="the device that rounds the weights")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args(argv)
    from backend import LLM
    dst = os.path.join(tempfile.gettempdir(), f"paged_llm_bench_int{args.bits}_g{args.group_size}_"
                       f"{os.path.basename(os.path.normpath(args.checkpoint))}")
    write_gptq_rtn(args.checkpoint, dst, args.bits, args.group_size, args.quantize_on)
    most = max(args.batch)
    blocks = most * (-(-(32 + args.tokens) // 16) + 1)
    engine = dict(dtype=args.dtype, max_num_seqs=max(4, most), num_kv_blocks=max(64, blocks), block_size=16)
    llms = {args.dtype: LLM(args.checkpoint, **engine), f"int{args.bits} g{args.group_size}": LLM(dst, **engine)}
    results = []
    for batch in args.batch:
        prompts = [[3 + (i + j) % 1000 for j in range(32)] for i in range(batch)]
        for llm in llms.values():
            step_ms(llm, prompts, 4)
        times: dict[str, list[float]] = {name: [] for name in llms}
        for _ in range(args.repeats):
            for name, llm in llms.items():
                times[name].append(step_ms(llm, prompts, args.tokens))
        device = next(iter(llms.values())).engine.device
        print(f"{args.checkpoint} on {device}, batch {batch}, {args.tokens} tokens, median of {args.repeats}")
        results += report(times, args.dtype, {"device": str(device), "batch": batch})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return {"results": results}


if __name__ == "__main__":
    main()
