"""LLaVA (backend/models/llava.py, backend/multimodal/llava.py): the CLIP tower and
projector equal transformers' bit for bit, and greedy output equals transformers' (fp32,
CPU) with images beside text-only prompts, chunks ending inside images and preemption,
for vision_feature_layer -2 with the class token dropped and for a list of layers with it
kept ("full"); the published checkpoint layout (`language_model.*`,
`vision_tower.vision_model.*`) loads too."""

import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from backend import LLM, SamplingParams
from tests.conftest import assert_pool_free, random_prompts
from tests.helpers.vl_checkpoints import hf_llava_greedy, make_images, make_llava, with_image

MAX_NEW = 10
GREEDY = SamplingParams(max_tokens=MAX_NEW, min_tokens=MAX_NEW, temperature=0)


@pytest.fixture(scope="module", params=[(-2, "default"), ((0, -1), "full")], ids=["layer-2", "layers0,-1-full"])
def llava_path(request, tmp_path_factory):
    layers, strategy = request.param
    return make_llava(str(tmp_path_factory.mktemp("llava") / "ckpt"), feature_layer=list(layers)
                      if isinstance(layers, tuple) else layers, strategy=strategy)


def prompts_and_images():
    images = make_images([(60, 90), (100, 40), (112, 112), (30, 30)], seed=3)
    texts = random_prompts(4, [9, 4, 15, 2], vocab=290, seed=8)
    return [(with_image(texts[0]), images[:1]), (texts[1] + [7] * 25, []),
            (with_image(texts[2], 2), images[1:3]), (with_image(texts[3]), images[3:])]


def run(llm, prompts):
    outs = llm.generate([{"prompt_token_ids": ids, "multi_modal_data": {"image": im}} if im else ids
                         for ids, im in prompts], GREEDY)
    return [o.token_ids for o in outs]


def test_greedy_matches_transformers(llava_path):
    prompts = prompts_and_images()
    expected = hf_llava_greedy(llava_path, prompts, MAX_NEW)
    llm = LLM(llava_path, block_size=4, num_kv_blocks=30, max_num_batched_tokens=12, max_num_seqs=8)
    assert run(llm, prompts) == expected
    stats = llm.stats()
    assert stats["num_preemptions"] > 0 and stats["num_chunked_prefills"] > 0, stats
    assert stats["encoder_images_encoded"] >= 4
    assert_pool_free(llm)


def test_the_published_layout_loads(llava_path, tmp_path):
    """llava-hf's checkpoints: `language_model.model.*`, `language_model.lm_head.*`,
    `vision_tower.vision_model.*` (transformers 5 writes `vision_tower.*` without it)."""
    published = tmp_path / "published"
    published.mkdir()
    for name in os.listdir(llava_path):
        if name != "model.safetensors":
            os.symlink(os.path.join(llava_path, name), published / name)
    state = load_file(os.path.join(llava_path, "model.safetensors"))
    assert any(k.startswith("language_model.model.") for k in state)
    save_file({("vision_tower.vision_model." + k[len("vision_tower."):] if k.startswith("vision_tower.") else k): v
               for k, v in state.items()}, str(published / "model.safetensors"))
    prompts = prompts_and_images()[:1]
    llm = LLM(str(published), block_size=4, num_kv_blocks=30)
    assert run(llm, prompts) == hf_llava_greedy(llava_path, prompts, MAX_NEW)
    assert_pool_free(llm)
    torch.testing.assert_close(llm.engine.model.vision_tower.pre_layrnorm.weight,
                               state["vision_tower.pre_layrnorm.weight"])
