"""The TensorRT PagedAttention plugin's contract, checked without TensorRT: the kernel
launched exactly as the AOT plugin launches it (node inputs, then the int32 scalars the
plugin computes from shapes, then outputs; grid = tokens x KV heads) on contiguous
tensors matches the torch reference, FP8 cache included. The registration itself needs
TensorRT and is skipped without it."""

import pytest
import torch

from backend.attention.aot import NODE_INPUTS, SCALAR_ARGS, plugin_scalar_args
from backend.attention.torch_attention import TorchPagedAttention
from backend.attention.triton_attention import _paged_attention_kernel, attention_constexprs
from tests.helpers.paged_batch import build, rel_err, to

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("fp8", [False, True])
def test_kernel_launched_as_the_aot_plugin_matches_reference(fp8):
    seqs = [(9, 1), (0, 6), (16, 3), (5, 1)]
    kvh, group, d, bs = 2, 4, 64, 8
    q, k, v, cache, meta = build(seqs, bs, kvh, group, d, seed=21, fp8=fp8)
    scale = d ** -0.5
    ref_args = to("cpu", q, k, v, cache, meta)
    ref = TorchPagedAttention(kvh * group, kvh, d, scale).forward(*ref_args)

    q2, k2, v2, c2, m2 = to(DEVICE, q, k, v, cache, meta)
    as_bytes = (lambda t: t.view(torch.uint8)) if fp8 else (lambda t: t)
    k_pool, v_pool = as_bytes(c2.key), as_bytes(c2.value)
    dev = q2.device
    node_inputs = (q2.contiguous(), k2.contiguous(), v2.contiguous(), k_pool, v_pool, m2.slot_mapping,
                   m2.block_tables, m2.seq_lens, m2.query_start_loc,
                   torch.tensor(cache.k_scale, dtype=torch.float32, device=dev),   # 0-d, as in the graph
                   torch.tensor(cache.v_scale, dtype=torch.float32, device=dev))
    assert len(node_inputs) == len(NODE_INPUTS)
    scalars = plugin_scalar_args(kvh * group, kvh, d, m2.seq_lens.shape[0], m2.block_tables.shape[1])
    assert len(scalars) == len(SCALAR_ARGS)
    out = torch.empty_like(q2)
    consts = attention_constexprs(kvh * group, kvh, d, bs, scale, None, fp8)
    _paged_attention_kernel[(q2.shape[0], kvh, 1)](*node_inputs, *scalars, out, k_pool, v_pool, None, None, None,
                                                   **consts)
    assert rel_err(out.cpu(), ref) < 1e-5
    assert torch.equal(c2.key.cpu().view(torch.uint8), ref_args[3].key.view(torch.uint8))
    assert torch.equal(c2.value.cpu().view(torch.uint8), ref_args[3].value.view(torch.uint8))


def test_plugin_registers_with_tensorrt():
    pytest.importorskip("tensorrt", reason="TensorRT is not installed (optional extra 'tensorrt')")
    if not torch.cuda.is_available():
        pytest.skip("the TensorRT plugin needs a CUDA GPU")
    import tensorrt as trt

    import backend.attention.trt_plugin  # noqa: F401  (registers the plugin)
    creator = trt.get_plugin_registry().get_creator("PagedAttention", "1", "paged_llm")
    assert creator is not None
