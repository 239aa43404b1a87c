"""Build a strongly typed TensorRT engine (`model.plan`) from the plugin export.

    python -m builder.tensorrt_engine --onnx model.onnx --plan 1/model.plan \\
        --max-num-batched-tokens 512 --max-num-seqs 64 --max-model-len 4096 --block-size 16 \\
        --num-kv-blocks 20000

The ONNX parser maps each `PagedAttention` node (plugin_namespace paged_llm, aot=1) to
the quickly deployable plugin registered by backend/attention/trt_plugin.py, whose AOT
form puts the Triton kernel's PTX in the engine. Linears exported as FP8 Q/DQ become FP8
GEMMs; a strongly typed network keeps every other type as exported. One optimization
profile covers the engine's step shapes: tokens up to max_num_batched_tokens, sequences
and logits rows up to max_num_seqs, block-table width up to max_model_len / block_size,
pools of exactly num_kv_blocks blocks.

Needs `tensorrt` (optional extra) and a GPU; neither exists on this project's machines,
so this module has not been run (docs/archive/status-notes.md).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class ProfileLimits:
    max_num_batched_tokens: int
    max_num_seqs: int
    max_model_len: int
    block_size: int
    num_kv_blocks: int

    def shapes(self, input_name: str, pool_shape: tuple[int, ...]) -> tuple[tuple, tuple, tuple]:
        """(min, opt, max) for one graph input."""
        T, B = self.max_num_batched_tokens, self.max_num_seqs
        M = -(-self.max_model_len // self.block_size)
        opt_t, opt_b = max(1, T // 2), max(1, B // 2)
        if input_name in ("input_ids", "positions", "slot_mapping"):
            return (1,), (opt_t,), (T,)
        if input_name == "block_tables":
            return (1, 1), (opt_b, max(1, M // 2)), (B, M)
        if input_name in ("seq_lens", "logits_indices"):
            return (1,), (opt_b,), (B,)
        if input_name == "query_start_loc":
            return (2,), (opt_b + 1,), (B + 1,)
        if "_pool_" in input_name:
            shape = (self.num_kv_blocks,) + tuple(pool_shape[1:])
            return shape, shape, shape
        raise KeyError(input_name)


def build_engine(onnx_path: str, plan_path: str, limits: ProfileLimits, log=print) -> str:
    try:
        import tensorrt as trt
    except ImportError as e:
        raise RuntimeError(f"TensorRT is not installed ({e}); install the 'tensorrt' extra on a GPU machine") from None
    import backend.attention.trt_plugin  # noqa: F401  (registers paged_llm::PagedAttention)

    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(onnx_path):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise RuntimeError(f"TensorRT's ONNX parser rejected {onnx_path}: {errors}")
    config = builder.create_builder_config()
    profile = builder.create_optimization_profile()
    for i in range(network.num_inputs):
        t = network.get_input(i)
        if t.name in ("k_scales", "v_scales"):
            continue
        lo, opt, hi = limits.shapes(t.name, tuple(t.shape))
        profile.set_shape(t.name, lo, opt, hi)
    config.add_optimization_profile(profile)
    log(f"building {plan_path} from {onnx_path} (this takes minutes)")
    plan = builder.build_serialized_network(network, config)
    if plan is None:
        raise RuntimeError("TensorRT failed to build the engine (see its log above)")
    with open(plan_path, "wb") as f:
        f.write(plan)
    return plan_path


def command(onnx_path: str, plan_path: str, limits: ProfileLimits) -> str:
    return (f"python -m builder.tensorrt_engine --onnx {onnx_path} --plan {plan_path} "
            f"--max-num-batched-tokens {limits.max_num_batched_tokens} --max-num-seqs {limits.max_num_seqs} "
            f"--max-model-len {limits.max_model_len} --block-size {limits.block_size} "
            f"--num-kv-blocks {limits.num_kv_blocks}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m builder.tensorrt_engine")
    ap.add_argument("--onnx", required=True)
    ap.add_argument("--plan", required=True)
    for name in ("max-num-batched-tokens", "max-num-seqs", "max-model-len", "block-size", "num-kv-blocks"):
        ap.add_argument(f"--{name}", type=int, required=True)
    a = ap.parse_args(argv)
    limits = ProfileLimits(a.max_num_batched_tokens, a.max_num_seqs, a.max_model_len, a.block_size, a.num_kv_blocks)
    try:
        build_engine(a.onnx, a.plan, limits)
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
