"""The TensorRT PagedAttention plugin's contract, checked without TensorRT: the kernel
launched exactly as the AOT plugin launches it (node inputs, then the int32 scalars the
plugin computes from shapes, then outputs; grid = tokens x KV heads) on contiguous
tensors matches the torch reference, FP8 cache and gpt-oss's attention sinks (the node's
last input) included; the exported graph's standard-ops attention takes the same sinks.
The registration itself needs TensorRT and is skipped without it."""

import pytest
import torch

from backend.attention.aot import NODE_INPUTS, SCALAR_ARGS, plugin_scalar_args
from backend.attention.torch_attention import TorchPagedAttention
from backend.attention.triton_attention import _paged_attention_kernel, attention_constexprs
from tests.helpers.paged_batch import build, rel_err, to

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("fp8,with_sinks", [(False, False), (True, False), (False, True)])
def test_kernel_launched_as_the_aot_plugin_matches_reference(fp8, with_sinks):
    seqs = [(9, 1), (0, 6), (16, 3), (5, 1)]
    kvh, group, d, bs = 2, 4, 64, 8
    q, k, v, cache, meta = build(seqs, bs, kvh, group, d, seed=21, fp8=fp8)
    scale = d ** -0.5
    sinks = torch.randn(kvh * group, generator=torch.Generator().manual_seed(5)) * 2
    ref_args = to("cpu", q, k, v, cache, meta)
    ref = TorchPagedAttention(kvh * group, kvh, d, scale).forward(*ref_args, sinks=sinks if with_sinks else None)

    q2, k2, v2, c2, m2 = to(DEVICE, q, k, v, cache, meta)
    as_bytes = (lambda t: t.view(torch.uint8)) if fp8 else (lambda t: t)
    k_pool, v_pool = as_bytes(c2.key), as_bytes(c2.value)
    dev = q2.device
    node_inputs = (q2.contiguous(), k2.contiguous(), v2.contiguous(), k_pool, v_pool, m2.slot_mapping,
                   m2.block_tables, m2.seq_lens, m2.query_start_loc,
                   torch.tensor(cache.k_scale, dtype=torch.float32, device=dev),   # 0-d, as in the graph
                   torch.tensor(cache.v_scale, dtype=torch.float32, device=dev),
                   # The export's zeros without sinks: never read.
                   sinks.to(dev) if with_sinks else torch.zeros(kvh * group, device=dev))
    assert len(node_inputs) == len(NODE_INPUTS)
    scalars = plugin_scalar_args(kvh * group, kvh, d, m2.seq_lens.shape[0], m2.block_tables.shape[1])
    assert len(scalars) == len(SCALAR_ARGS)
    out = torch.empty_like(q2)
    consts = attention_constexprs(kvh * group, kvh, d, bs, scale, None, fp8, sinks=with_sinks)
    # The kernel's own order: sinks after the outputs (the AOT entry moves it to the inputs),
    # then the key limits and the tree, which a plugin never has (constant Nones in the AOT build).
    _paged_attention_kernel[(q2.shape[0], kvh, 1)](*node_inputs[:-1], *scalars, out, k_pool, v_pool, None, None,
                                                   node_inputs[-1], None, None, **consts)
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


def test_exported_reference_attention_takes_the_sinks():
    """The ONNX "reference" variant's standard-ops attention (what onnxruntime runs) with
    gpt-oss's sinks equals the torch backend's; the plugin node's attributes say has_sinks."""
    from builder.onnx_export import ExportPagedAttention
    kvh, group, d, bs = 2, 4, 32, 8
    q, k, v, cache, meta = build([(9, 1), (0, 6), (16, 3)], bs, kvh, group, d, seed=4)
    sinks = torch.randn(kvh * group, generator=torch.Generator().manual_seed(6)) * 2
    att = ExportPagedAttention(kvh * group, kvh, d, d ** -0.5)
    got = att.forward(*to("cpu", q, k, v, cache, meta), sinks=sinks)
    ref = TorchPagedAttention(kvh * group, kvh, d, d ** -0.5).forward(*to("cpu", q, k, v, cache, meta), sinks=sinks)
    plain = TorchPagedAttention(kvh * group, kvh, d, d ** -0.5).forward(*to("cpu", q, k, v, cache, meta))
    assert rel_err(got, ref) < 1e-5 and rel_err(plain, ref) > 1e-2
    assert att.plugin_attributes(bs, True)["has_sinks"] == 1 and att.plugin_attributes(bs)["has_sinks"] == 0
