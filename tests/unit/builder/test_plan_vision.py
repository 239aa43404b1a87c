"""A vision-language build's memory plan (builder/plan_vision.py): the tower's bytes read
from the files' headers, and the encoder cache taken from the KV cache's budget."""

from safetensors.torch import load_file

from backend.models.config import load_model_config
from builder.build import BuildOptions
from builder.plan import format_plan, memory_plan
from builder.plan_vision import vision_plan
from tests.helpers.vl_checkpoints import make_qwen2_vl


def test_the_plan_counts_the_tower_and_the_encoder_cache(tmp_path):
    path = make_qwen2_vl(str(tmp_path / "vl"))
    cfg = load_model_config(path)
    tensors = load_file(f"{path}/model.safetensors")
    tower = sum(t.numel() * t.element_size() for n, t in tensors.items() if n.startswith("visual."))
    vision = vision_plan(path, cfg, 512, None, None, 2)
    assert vision == {"vision_tower_bytes": tower, "encoder_cache_rows": 512, "encoder_cache_bytes": 512 * 64 * 2}
    # The budget rises to the largest image the processor makes (16 tokens here).
    assert vision_plan(path, cfg, 8, None, None, 2)["encoder_cache_rows"] == 16
    opts = BuildOptions.create(checkpoint=path, output=str(tmp_path / "out"), gpu_memory_gb=1.0)
    with_cache = memory_plan(cfg, 10**6, 2, opts, vision)
    without = memory_plan(cfg, 10**6, 2, opts)
    assert without["kv_cache_bytes"] - with_cache["kv_cache_bytes"] == 512 * 64 * 2
    assert "encoder cache 512 rows" in format_plan(with_cache)
    assert vision_plan(path, load_model_config(make_tiny_text(tmp_path)), 512, None, None, 2) is None


def make_tiny_text(tmp_path) -> str:
    from tests.helpers.checkpoints import make_checkpoint
    return make_checkpoint(str(tmp_path / "llama"), "llama")
