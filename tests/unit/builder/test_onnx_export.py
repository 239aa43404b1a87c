"""ONNX export over packed tokens: the plugin variant is a valid graph with exactly one
PagedAttention node per layer; the reference variant, run by onnxruntime on CPU,
reproduces the torch model's logits (and KV writes) for a mixed prefill/decode step;
an FP8 build exports its linears as FP8 Q/DQ and still matches the engine's FP8 model."""

import os

import numpy as np
import onnx
import pytest
import torch

from backend.attention.metadata import AttentionMetadata, KVCacheLayer
from backend.attention.torch_attention import TorchPagedAttention
from backend.models.config import load_model_config
from backend.models.loader import load_model
from builder.onnx_export import (INPUT_NAMES, PLUGIN_NAMESPACE, example_inputs, export, load_for_export,
                                 onnxruntime_session, pool_names)
from tests.helpers.pins import require_pinned

BS = 4   # small blocks: the example step's sequences span several


@pytest.fixture(autouse=True, scope="module")
def _pinned_onnx():
    # Module scope: checked before the module's export fixtures run.
    require_pinned("onnx", "onnxscript", "onnxruntime")


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def ckpt(request, ckpt_dir):
    from tests.helpers.checkpoints import make_checkpoint
    return make_checkpoint(str(ckpt_dir / request.param), request.param)


def attrs_of(node):
    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


def test_plugin_variant_has_one_paged_attention_node_per_layer(ckpt, tmp_path):
    model = onnx.load(export(ckpt, str(tmp_path / "plugin.onnx"), "plugin", block_size=BS))
    onnx.checker.check_model(model)
    L = load_model_config(ckpt).num_layers
    nodes = [n for n in model.graph.node if n.op_type == "PagedAttention"]
    assert len(nodes) == L
    inputs = [i.name for i in model.graph.input]
    assert inputs == INPUT_NAMES + pool_names(L)
    for i, n in enumerate(nodes):
        attrs = attrs_of(n)
        assert n.domain == PLUGIN_NAMESPACE
        assert attrs["plugin_namespace"] == b"paged_llm" and attrs["plugin_version"] == b"1" and attrs["aot"] == 1
        assert {"num_heads", "num_kv_heads", "head_dim", "block_size", "scale", "sliding_window"} <= set(attrs)
        # The last input is the sinks (zeros, unread: has_sinks 0 without gpt-oss's sinks).
        assert len(n.input) == 12 and len(n.output) == 3 and attrs["has_sinks"] == 0
        # Each layer's own pools feed its node directly (no slice in between), so the
        # plugin's aliased outputs are those network inputs, written in place.
        assert n.input[3] == f"k_pool_{i}" and n.input[4] == f"v_pool_{i}"
    # Everything else is standard ONNX; the pool size is dynamic.
    assert {n.domain for n in model.graph.node} <= {"", PLUGIN_NAMESPACE}
    pool = next(i for i in model.graph.input if i.name == "k_pool_0")
    assert pool.type.tensor_type.shape.dim[0].dim_param


def run_torch(ckpt, args):
    (ids, pos, slots, tables, seq_lens, qsl, idx, k_scales, v_scales, *pools) = args
    cfg = load_model_config(ckpt)
    model = load_model(ckpt, cfg, torch.float32, torch.device("cpu"), TorchPagedAttention, cfg.max_position_embeddings)
    caches = [KVCacheLayer(pools[2 * i].clone(), pools[2 * i + 1].clone()) for i in range(cfg.num_layers)]
    qlens = (qsl[1:] - qsl[:-1]).tolist()
    meta = AttentionMetadata(qsl, seq_lens, tables, slots, qlens, seq_lens.tolist(), max(qlens), int(seq_lens.max()))
    with torch.no_grad():
        logits = model.compute_logits(model(ids, pos, caches, meta)[idx])
    return logits.numpy(), [t.numpy() for c in caches for t in (c.key, c.value)]


def run_onnx(path, args, num_layers):
    names = INPUT_NAMES + pool_names(num_layers)
    got = onnxruntime_session(path).run(None, {n: a.numpy() for n, a in zip(names, args)})
    return got[0], got[1:]


def test_reference_variant_matches_torch_model(ckpt, tmp_path):
    path = export(ckpt, str(tmp_path / "ref.onnx"), "reference", block_size=BS)
    args = example_inputs(load_for_export(ckpt), block_size=BS)
    L = load_model_config(ckpt).num_layers
    logits, pools = run_onnx(path, args, L)
    ref_logits, ref_pools = run_torch(ckpt, args)
    assert np.abs(logits - ref_logits).max() / np.abs(ref_logits).max() < 1e-4
    for got, ref in zip(pools, ref_pools):
        assert np.allclose(got, ref, atol=1e-5)


def test_fp8_build_exports_linears_as_fp8_qdq(fp8_build, tmp_path):
    ckpt = os.path.join(fp8_build, "checkpoint")
    cfg = load_model_config(ckpt)
    L = cfg.num_layers
    plugin = onnx.load(export(ckpt, str(tmp_path / "plugin.onnx"), "plugin", block_size=BS))
    onnx.checker.check_model(plugin)
    ops = [n.op_type for n in plugin.graph.node]
    linears = 4 * L   # qkv, o, gate_up, down (fused at load)
    assert ops.count("QuantizeLinear") == linears          # activations
    assert ops.count("DequantizeLinear") == 2 * linears    # activations and weights
    fp8 = onnx.TensorProto.FLOAT8E4M3FN
    assert sum(1 for t in plugin.graph.initializer if t.data_type == fp8 and t.dims) == linears
    for n in plugin.graph.node:
        if n.op_type == "QuantizeLinear":
            zp = next(t for t in plugin.graph.initializer if t.name == n.input[2])
            assert zp.data_type == fp8

    path = export(ckpt, str(tmp_path / "ref.onnx"), "reference", block_size=BS)
    model = load_for_export(ckpt)
    args = example_inputs(model, block_size=BS)
    logits, _ = run_onnx(path, args, L)
    ref_logits, _ = run_torch(ckpt, args)   # the engine's FP8Linear (fake-quantized activations)
    assert np.abs(logits - ref_logits).max() / np.abs(ref_logits).max() < 1e-3
    assert (logits.argmax(-1) == ref_logits.argmax(-1)).all()
