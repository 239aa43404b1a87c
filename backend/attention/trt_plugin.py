"""The `paged_llm::PagedAttention` TensorRT plugin (a quickly deployable plugin): the
project's Triton paged-attention kernel inside a TensorRT engine.

Importing this module registers the plugin; it needs `tensorrt` (an optional extra) and
is imported only by the TensorRT engine build and the TensorRT model runner.

- inputs: the node's, in backend/attention/aot.py's NODE_INPUTS order; the last, `sinks`
  [num_heads], holds gpt-oss's attention-sink logits, read only with has_sinks=1.
- register: outputs are the attention output (like q) and the two pools, declared as
  aliases of the pool inputs: the kernel writes this step's K/V into them in place.
- aot_impl (used when the ONNX node has aot=1, as our export sets): the kernel compiled
  ahead of time to PTX for the build GPU's architecture (backend/attention/aot.py), with
  its grid and int32 scalars as symbolic expressions of the input shapes. The engine then
  runs without Python.
- impl (the JIT fallback): the same kernel launched from Python on torch views of
  TensorRT's buffers.

Not run on this project's machines: TensorRT cannot be installed on them (see
docs/archive/status-notes.md). The argument contract it relies on is checked without TensorRT in
tests/unit/attention/test_trt_plugin.py.
"""

from __future__ import annotations

from typing import Tuple, Union

import tensorrt as trt
import tensorrt.plugin as trtp

from backend.attention.aot import compile_attention, plugin_scalar_args

PLUGIN_ID = "paged_llm::PagedAttention"
_DTYPES = {trt.float32: "fp32", trt.bfloat16: "bf16", trt.float16: "fp16"}


@trtp.register(PLUGIN_ID)
def paged_attention_desc(q: trtp.TensorDesc, k: trtp.TensorDesc, v: trtp.TensorDesc, k_pool: trtp.TensorDesc,
                         v_pool: trtp.TensorDesc, slot_mapping: trtp.TensorDesc, block_tables: trtp.TensorDesc,
                         seq_lens: trtp.TensorDesc, query_start_loc: trtp.TensorDesc, k_scale: trtp.TensorDesc,
                         v_scale: trtp.TensorDesc, sinks: trtp.TensorDesc, num_heads: int, num_kv_heads: int,
                         head_dim: int, block_size: int, scale: float, sliding_window: int, has_sinks: int
                         ) -> Tuple[trtp.TensorDesc, trtp.TensorDesc, trtp.TensorDesc]:
    return q.like(), k_pool.aliased(), v_pool.aliased()


@trtp.aot_impl(PLUGIN_ID)
def paged_attention_aot(q: trtp.TensorDesc, k: trtp.TensorDesc, v: trtp.TensorDesc, k_pool: trtp.TensorDesc,
                        v_pool: trtp.TensorDesc, slot_mapping: trtp.TensorDesc, block_tables: trtp.TensorDesc,
                        seq_lens: trtp.TensorDesc, query_start_loc: trtp.TensorDesc, k_scale: trtp.TensorDesc,
                        v_scale: trtp.TensorDesc, sinks: trtp.TensorDesc, num_heads: int, num_kv_heads: int,
                        head_dim: int, block_size: int, scale: float, sliding_window: int, has_sinks: int,
                        outputs: Tuple[trtp.TensorDesc],
                        tactic: int) -> Tuple[Union[str, bytes], Union[str, bytes], trtp.KernelLaunchParams,
                                              trtp.SymExprs]:
    import torch
    major, minor = torch.cuda.get_device_capability()
    kernel = compile_attention(arch=major * 10 + minor, dtype=_DTYPES[q.dtype], num_heads=num_heads,
                               num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size, scale=scale,
                               sliding_window=sliding_window or None, fp8=k_pool.dtype == trt.uint8,
                               sinks=bool(has_sinks))
    launch = trtp.KernelLaunchParams()
    launch.grid_x = q.shape_expr[0]          # one program per token ...
    launch.grid_y = num_kv_heads             # ... and KV head
    launch.block_x = kernel.num_warps * 32
    launch.shared_mem = kernel.shared
    scalars = plugin_scalar_args(num_heads, num_kv_heads, head_dim, seq_lens.shape_expr[0],
                                 block_tables.shape_expr[1])
    extra = trtp.SymIntExprs.from_tuple([trtp.SymInt32(x) for x in scalars])
    return kernel.name.encode(), kernel.ptx.encode(), launch, extra


@trtp.impl(PLUGIN_ID)
def paged_attention_impl(q: trtp.Tensor, k: trtp.Tensor, v: trtp.Tensor, k_pool: trtp.Tensor, v_pool: trtp.Tensor,
                         slot_mapping: trtp.Tensor, block_tables: trtp.Tensor, seq_lens: trtp.Tensor,
                         query_start_loc: trtp.Tensor, k_scale: trtp.Tensor, v_scale: trtp.Tensor,
                         sinks: trtp.Tensor, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
                         scale: float, sliding_window: int, has_sinks: int, outputs: Tuple[trtp.Tensor],
                         stream: int) -> None:
    import torch

    from backend.attention.triton_attention import launch_paged_attention
    with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
        t = [torch.as_tensor(x, device="cuda") for x in (q, k, v, k_pool, v_pool, slot_mapping, block_tables,
                                                          seq_lens, query_start_loc, k_scale, v_scale)]
        out = torch.as_tensor(outputs[0], device="cuda")
        launch_paged_attention(*t, out, scale, sliding_window or None, num_splits=1,
                               sinks=torch.as_tensor(sinks, device="cuda") if has_sinks else None)
