"""The exported decoder graph's interface, shared by the exporter (builder/onnx_export.py)
and the runners that execute it (backend/engine/runner/graph_runner.py): input and output names,
and the onnxruntime session the reference export runs in. Runtime code reads it from
here, so serving never imports builder/."""

from __future__ import annotations

INPUT_NAMES = ["input_ids", "positions", "slot_mapping", "block_tables", "seq_lens", "query_start_loc",
               "logits_indices", "k_scales", "v_scales"]


def pool_names(num_layers: int) -> list[str]:
    return [f"{kv}_pool_{i}" for i in range(num_layers) for kv in ("k", "v")]


def output_names(num_layers: int, variant: str) -> list[str]:
    """"logits", then (reference variant) each updated pool; the plugin variant writes the
    pools in place."""
    return ["logits"] + ([] if variant == "plugin" else [f"{n}_out" for n in pool_names(num_layers)])


def onnxruntime_session(path: str):
    """An onnxruntime CPU session for a reference export. Basic graph optimizations only:
    the extended level fuses DequantizeLinear+MatMul into an integer kernel that has no
    FP8 variant."""
    import onnxruntime as ort
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    return ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
