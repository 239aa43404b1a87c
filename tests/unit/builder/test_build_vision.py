"""`builder build` of vision-language checkpoints (Qwen2-VL here): FP8 and INT4 builds
quantize the language model's projections only (the tower's weights stay the source's,
bit for bit), serve images, and agree with the source on prompts with images as often as
on text; what is not supported yet (W8A8 weights, exported graphs) is refused by name."""

import pytest
import torch
from safetensors.torch import load_file

from backend import LLM, SamplingParams
from builder.build import BuildError, BuildOptions, build
from tests.conftest import assert_pool_free, random_prompts
from tests.helpers.vl_checkpoints import make_images, make_qwen2_vl, with_image


@pytest.fixture(scope="module")
def vl_ckpt(tmp_path_factory):
    return make_qwen2_vl(str(tmp_path_factory.mktemp("vl") / "ckpt"))


@pytest.mark.parametrize("weights, options, layer, projection", [
    ("fp8", {}, "FP8Linear", "q_proj.weight"),
    ("int4", {"group_size": 32}, "IntLinear", "q_proj.weight_packed")])
def test_a_quantized_build_quantizes_the_decoder_only_and_serves_images(vl_ckpt, tmp_path, weights, options, layer,
                                                                         projection):
    entry = build(BuildOptions.create(checkpoint=vl_ckpt, output=str(tmp_path / "llm"), weights=weights,
                                      block_size=4, num_kv_blocks=64, **options), log=lambda *_: None)
    source, built = load_file(f"{vl_ckpt}/model.safetensors"), load_file(f"{entry}/checkpoint/model.safetensors")
    tower = [k for k in source if k.startswith("visual.")]
    # (written in transformers 5's layout, model.visual.*; the loader reads both)
    assert tower and all(torch.equal(source[k], built.get(k, built.get("model." + k))) for k in tower)
    projections = [k for k in built if k.endswith(projection) and "layers" in k]
    assert projections and all(built[k].dtype in (torch.float8_e4m3fn, torch.int32) for k in projections)
    images = make_images([(60, 90), (112, 112), (84, 84), (50, 120)] * 4, seed=2)
    texts = random_prompts(16, [6, 11, 3, 9], vocab=290, seed=4)
    prompts = [{"prompt_token_ids": with_image(p), "multi_modal_data": {"image": [im]}}
               for p, im in zip(texts, images)]
    text_only = [p + [5, 6, 7, 8] for p in texts]
    params = SamplingParams(max_tokens=1, temperature=0)
    fp8 = LLM(f"{entry}/checkpoint", block_size=4, num_kv_blocks=64)
    assert type(fp8.engine.model.model.layers[0].self_attn.qkv_proj).__name__ == layer
    source = LLM(vl_ckpt, block_size=4, num_kv_blocks=64)

    def agreement(batch) -> int:
        return sum(a.token_ids == b.token_ids for a, b in zip(fp8.generate(batch, params),
                                                               source.generate(batch, params)))
    # Quantization moves near-ties of these random tiny weights (FP8: about 0.6 top-1
    # agreement; INT4 less): prompts with an image agree with the source as often as
    # text-only ones do.
    with_images, text = agreement(prompts), agreement(text_only)
    assert with_images >= min(8, text) and with_images >= text - 2, (with_images, text)
    # The image is read: the same text with other images gives other tokens.
    swapped = [{**p, "multi_modal_data": {"image": [images[(i + 1) % 4]]}} for i, p in enumerate(prompts)]
    assert [o.token_ids for o in fp8.generate(swapped, params)] != [o.token_ids for o in fp8.generate(prompts, params)]
    assert_pool_free(fp8)


@pytest.mark.parametrize("options, message", [
    (dict(weights="w8a8"), "w8a8 is not supported for vision-language checkpoints"),
    (dict(engine="onnxruntime"), "graphs take token ids only")])
def test_what_is_not_supported_yet_is_refused_by_name(vl_ckpt, tmp_path, options, message):
    with pytest.raises(BuildError, match=message):
        build(BuildOptions.create(checkpoint=vl_ckpt, output=str(tmp_path / "llm"), **options), log=lambda *_: None)
