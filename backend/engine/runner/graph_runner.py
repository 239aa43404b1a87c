"""Model runners over an exported decoder graph (builder/onnx_export.py; its interface:
backend/engine/runner/graph_contract.py), next to the
torch one: same scheduler, KV cache manager, packed step and sampler; only the forward
pass differs.

- onnxruntime: the export's reference variant on CPU. Slow (the graph returns whole
  updated pools, copied back each step); it exists to prove, request by request, that
  the packed-token contract the TensorRT engine is built on gives the engine's tokens.
- tensorrt: a TensorRT engine (`model.plan`) built from the plugin variant; the
  PagedAttention plugin writes the engine's own KV pools in place. Needs TensorRT and a
  GPU; not run on this project's machines (docs/archive/status-notes.md).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from backend.attention.metadata import KVCacheLayer
from backend.config import ConfigError
from backend.engine.runner.graph_contract import INPUT_NAMES, onnxruntime_session, output_names, pool_names
from backend.engine.runner.model_runner import ModelRunner
from backend.engine.sampling.sampler import Sampler
from backend.engine.runner.step_inputs import StepInputBuilder, StepInputs


def packed_inputs(step: StepInputs, kv_caches: list[KVCacheLayer], k_scales: torch.Tensor,
                  v_scales: torch.Tensor) -> dict[str, torch.Tensor]:
    """The graph's named inputs for one step (scales: [layers] each), in the export's
    dtypes. A step of prefill chunks only asks for row 0, whose logits the caller drops:
    graphs are built for at least one row."""
    meta = step.meta
    inputs = {
        "input_ids": step.input_ids.long(), "positions": step.positions.long(),
        "slot_mapping": meta.slot_mapping.long(), "block_tables": meta.block_tables,
        "seq_lens": meta.seq_lens, "query_start_loc": meta.query_start_loc,
        "logits_indices": step.logits_indices.long(), "k_scales": k_scales, "v_scales": v_scales,
    }
    for i, c in enumerate(kv_caches):
        inputs[f"k_pool_{i}"], inputs[f"v_pool_{i}"] = c.key, c.value
    assert list(inputs) == INPUT_NAMES + pool_names(len(kv_caches))
    return inputs


class GraphModelRunner(ModelRunner):
    def __init__(self, graph: Callable[[dict[str, torch.Tensor]], torch.Tensor], kv_caches: list[KVCacheLayer],
                 block_size: int, device: torch.device, sampler: Sampler, inputs: StepInputBuilder,
                 vocab_size: int) -> None:
        super().__init__(None, kv_caches, block_size, device, sampler, inputs, vocab_size)
        self.graph = graph
        # The cache scales are fixed at load (calibrated by the builder): stacked once.
        scales = torch.stack([c.scale_tensor() for c in kv_caches])
        self.k_scales, self.v_scales = scales[:, 0].contiguous(), scales[:, 1].contiguous()

    def forward(self, step: StepInputs) -> Optional[torch.Tensor]:
        logits = self.graph(packed_inputs(step, self.kv_caches, self.k_scales, self.v_scales))
        return logits if step.num_logits else None


class OnnxRuntimeGraph:
    """The reference export in onnxruntime; copies the updated pools back into the cache."""

    def __init__(self, path: str, num_layers: int, block_size: int) -> None:
        self.session = onnxruntime_session(path)
        self.outputs = output_names(num_layers, "reference")
        if [o.name for o in self.session.get_outputs()] != self.outputs:
            raise ConfigError(f"invalid engine argument 'model_graph': {path} is not a reference export for "
                              f"{num_layers} layers (outputs {[o.name for o in self.session.get_outputs()]})")
        graph_block = next(i.shape[1] for i in self.session.get_inputs() if i.name == "k_pool_0")
        if graph_block != block_size:
            raise ConfigError(f"invalid engine argument 'block_size': {block_size}, but {path} was exported "
                              f"for blocks of {graph_block} tokens")

    def __call__(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        feed = {name: t.numpy() for name, t in inputs.items()}
        logits, *pools = self.session.run(self.outputs, feed)
        for name, new in zip(self.outputs[1:], pools):
            inputs[name[:-len("_out")]].copy_(torch.from_numpy(new))
        return torch.from_numpy(logits)


class TensorRTGraph:
    """A TensorRT engine built from the plugin export: the pools are bound as inputs and
    written in place by the plugin; logits come back in a buffer sized per step."""

    def __init__(self, plan_path: str, device: torch.device) -> None:
        import tensorrt as trt

        import backend.attention.trt_plugin  # noqa: F401  (the plugin's JIT form, if the plan uses it)
        self.trt = trt
        self.logger = trt.Logger(trt.Logger.WARNING)
        with open(plan_path, "rb") as f:
            self.engine = trt.Runtime(self.logger).deserialize_cuda_engine(f.read())
        if self.engine is None:
            raise ValueError(f"TensorRT could not deserialize {plan_path} (built for another TensorRT or GPU?)")
        self.context = self.engine.create_execution_context()
        self.device = device
        self.cuda = torch.cuda          # (a test passes a stand-in)
        self.stream = torch.cuda.Stream(device=device)

    def __call__(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        ctx = self.context
        keep = []
        for name, t in inputs.items():
            t = t.contiguous()
            if t.dtype == torch.float8_e4m3fn:
                t = t.view(torch.uint8)      # the plugin graph's FP8 pools are bytes
            keep.append(t)
            ctx.set_input_shape(name, tuple(t.shape))
            ctx.set_tensor_address(name, t.data_ptr())
        shape = tuple(ctx.get_tensor_shape("logits"))
        logits = torch.empty(shape, dtype=torch.float32, device=self.device)
        ctx.set_tensor_address("logits", logits.data_ptr())
        # The step's inputs were uploaded, and the pools last written, on the engine's
        # stream; TensorRT runs on its own: it waits for an event recorded after them.
        inputs_ready = self.cuda.Event()
        inputs_ready.record(self.cuda.current_stream(self.device))
        self.stream.wait_event(inputs_ready)
        if not ctx.execute_async_v3(self.stream.cuda_stream):
            raise RuntimeError("TensorRT execution failed")
        self.stream.synchronize()
        return logits
