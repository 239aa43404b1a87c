"""ONNX export over packed tokens: the plugin variant is a valid graph with exactly one
PagedAttention node per layer; the reference variant, run by onnxruntime on CPU,
reproduces the torch model's logits (and KV writes) for a mixed prefill/decode step."""

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from backend.attention.metadata import AttentionMetadata, KVCacheLayer
from backend.attention.torch_attention import TorchPagedAttention
from backend.models.config import load_model_config
from backend.models.loader import load_model
from builder.onnx_export import INPUT_NAMES, PLUGIN_NAMESPACE, example_inputs, export, load_for_export


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def ckpt(request, ckpt_dir):
    from tests.helpers.checkpoints import make_checkpoint
    return make_checkpoint(str(ckpt_dir / request.param), request.param)


def test_plugin_variant_has_one_paged_attention_node_per_layer(ckpt, tmp_path):
    model = onnx.load(export(ckpt, str(tmp_path / "plugin.onnx"), "plugin"))
    onnx.checker.check_model(model)
    nodes = [n for n in model.graph.node if n.op_type == "PagedAttention"]
    assert len(nodes) == load_model_config(ckpt).num_layers
    for n in nodes:
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in n.attribute}
        assert n.domain == PLUGIN_NAMESPACE
        assert attrs["plugin_namespace"] == b"paged_llm" and attrs["plugin_version"] == b"1"
        assert len(n.input) == 11
    # Everything else is standard ONNX.
    assert {n.domain for n in model.graph.node} <= {"", PLUGIN_NAMESPACE}
    assert [i.name for i in model.graph.input] == INPUT_NAMES


def test_reference_variant_matches_torch_model(ckpt, tmp_path):
    path = export(ckpt, str(tmp_path / "ref.onnx"), "reference")
    args = example_inputs(load_for_export(ckpt))
    (ids, pos, slots, tables, seq_lens, qsl, idx, k_pools, v_pools, k_scales, v_scales) = args
    got_logits, got_k, got_v = ort.InferenceSession(path).run(
        None, {n: a.numpy() for n, a in zip(INPUT_NAMES, args)})

    cfg = load_model_config(ckpt)
    model = load_model(ckpt, cfg, torch.float32, torch.device("cpu"), TorchPagedAttention, cfg.max_position_embeddings)
    caches = [KVCacheLayer(k_pools[i].clone(), v_pools[i].clone()) for i in range(cfg.num_layers)]
    qlens = (qsl[1:] - qsl[:-1]).tolist()
    meta = AttentionMetadata(qsl, seq_lens, tables, slots, qlens, seq_lens.tolist(), max(qlens), int(seq_lens.max()))
    with torch.no_grad():
        ref = model.compute_logits(model(ids, pos, caches, meta)[idx])
    assert np.abs(got_logits - ref.numpy()).max() / np.abs(ref.numpy()).max() < 1e-4
    assert np.allclose(got_k, torch.stack([c.key for c in caches]).numpy(), atol=1e-5)
    assert np.allclose(got_v, torch.stack([c.value for c in caches]).numpy(), atol=1e-5)
