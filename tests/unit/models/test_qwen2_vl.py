"""Qwen2-VL and Qwen2.5-VL (backend/models/qwen2_vl.py, qwen2_5_vl.py, backend/multimodal/,
the encoder cache in backend/engine/scheduling/encoder_cache.py): greedy output equals transformers' (fp32,
CPU) with images of several sizes and aspect ratios, one and several per prompt beside
text-only prompts, prompt chunks ending inside images, preemption, and the prefix and
encoder caches keyed by the image's content."""

import os

import pytest
import torch

from backend import LLM, SamplingParams
from backend.engine.errors import InvalidRequestError
from tests.conftest import assert_pool_free, random_prompts
from tests.helpers.checkpoints import make_checkpoint
from tests.helpers.vl_checkpoints import (IMAGE, VISION_START, hf_vl_greedy, make_images, make_qwen2_vl,
                                          with_image)

MAX_NEW = 12
GREEDY = SamplingParams(max_tokens=MAX_NEW, min_tokens=MAX_NEW, temperature=0)


@pytest.fixture(scope="module")
def vl_path(tmp_path_factory):
    return make_qwen2_vl(str(tmp_path_factory.mktemp("qwen2_vl") / "ckpt"))


@pytest.fixture(scope="module", params=["2", "2.5"])
def each_vl_path(request, tmp_path_factory):
    """Qwen2-VL, then Qwen2.5-VL (windowed tower)."""
    return make_qwen2_vl(str(tmp_path_factory.mktemp(f"qwen{request.param}_vl") / "ckpt"), version=request.param)


def as_prompt(ids, images):
    return {"prompt_token_ids": ids, "multi_modal_data": {"image": images}} if images else ids


def run(llm, prompts):
    outs = llm.generate([as_prompt(ids, images) for ids, images in prompts], GREEDY)
    return [o.token_ids for o in outs]


def settled(llm):
    assert_pool_free(llm)
    assert not llm.engine.vision.encoder_cache.refs     # every reference released


def test_vision_tower_matches_transformers(each_vl_path):
    import transformers as tf
    vl_path = each_vl_path
    from backend.attention import make_attention_factory
    from backend.models.config import load_model_config
    from backend.models.loader import load_model
    cfg = load_model_config(vl_path)
    ours = load_model(vl_path, cfg, torch.float32, torch.device("cpu"), make_attention_factory("torch"), 1024)
    ref = tf.AutoModelForImageTextToText.from_pretrained(vl_path).eval()
    px = tf.AutoImageProcessor.from_pretrained(vl_path)(images=make_images([(60, 90), (100, 40), (112, 112)]),
                                                        return_tensors="pt")
    with torch.no_grad():
        got = ours.encode_images(px["pixel_values"], [tuple(g) for g in px["image_grid_thw"].tolist()])
        want = ref.model.get_image_features(px["pixel_values"], px["image_grid_thw"]).pooler_output
    assert [tuple(g.shape) for g in got] == [tuple(w.shape) for w in want]
    assert all(torch.equal(g, w) for g, w in zip(got, want))


def test_greedy_matches_transformers_in_a_batch_mix(each_vl_path):
    """Text-only, one-image and two-image prompts together; a 20-token step budget cuts
    prompts inside images (16 tokens the largest), and a small pool preempts."""
    vl_path = each_vl_path
    images = make_images([(60, 90), (100, 40), (112, 112), (30, 30), (200, 50), (56, 140)], seed=1)
    texts = random_prompts(6, [7, 12, 3, 20, 1, 9], vocab=290, seed=3)
    prompts = [(with_image(texts[0]), [images[0]]), (texts[1], []),
               (with_image(texts[2], 2), [images[1], images[2]]), (with_image(texts[3]), [images[3]]),
               (with_image(texts[4], 3), [images[4], images[5], images[0]]), (texts[5] + [4] * 30, [])]
    expected = hf_vl_greedy(vl_path, prompts, MAX_NEW)
    llm = LLM(vl_path, block_size=4, num_kv_blocks=40, max_num_batched_tokens=20, max_num_seqs=8)
    assert run(llm, prompts) == expected
    stats = llm.stats()
    assert stats["num_preemptions"] > 0 and stats["num_chunked_prefills"] > 0, stats
    settled(llm)
    # With n-gram speculation: its verified tokens take the requests' M-RoPE offsets.
    spec = LLM(vl_path, block_size=4, num_kv_blocks=64, max_num_batched_tokens=20, max_num_seqs=8,
               speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1})
    assert run(spec, prompts) == expected
    assert spec.stats()["spec_decode_num_draft_tokens"] > 0
    settled(spec)
    # With a draft model (a text model of the same vocabulary, drafting on plain positions;
    # the target verifies on its own).
    draft = make_checkpoint(os.path.join(os.path.dirname(vl_path), "draft"), "qwen2", seed=3, num_hidden_layers=1)
    drafted = LLM(vl_path, block_size=4, num_kv_blocks=96, max_num_batched_tokens=20, max_num_seqs=8,
                  speculative_config={"method": "draft_model", "model": draft, "num_speculative_tokens": 2})
    assert run(drafted, prompts) == expected
    assert drafted.stats()["spec_decode_num_draft_tokens"] > 0
    settled(drafted)


def test_a_chunk_ends_inside_an_image(vl_path):
    """Text of 4 tokens, then an image of 16: a 12-token budget computes the image's
    tokens in two steps from one encoder run."""
    image = make_images([(112, 112)], seed=2)
    prompt = (with_image([10, 11, 12, 13]), image)
    llm = LLM(vl_path, block_size=4, num_kv_blocks=32, max_num_batched_tokens=12)
    assert run(llm, [prompt]) == hf_vl_greedy(vl_path, [prompt], MAX_NEW)
    stats = llm.stats()
    assert stats["encoder_images_encoded"] == 1 and stats["num_chunked_prefills"] >= 2, stats
    settled(llm)


def test_prefix_cache_keys_carry_the_image(vl_path):
    """The same text and image hit every full block; the same text with another image
    of the same size hits only the blocks before it."""
    first, other = make_images([(84, 84), (84, 84)], seed=4)
    text = random_prompts(1, [8], vocab=290, seed=5)[0]
    ids = with_image(text, tail=[5, 6, 7, 8, 9, 10, 11])      # 8 + 1 + 9 + 1 + 7 = 26 tokens
    llm = LLM(vl_path, block_size=4, num_kv_blocks=32)
    expected = hf_vl_greedy(vl_path, [(ids, [first]), (ids, [other])], MAX_NEW)
    assert run(llm, [(ids, [first])]) == expected[:1]
    hits = llm.stats()["prefix_cache_hit_tokens"]
    assert run(llm, [(ids, [first])]) == expected[:1]
    same = llm.stats()["prefix_cache_hit_tokens"] - hits
    assert run(llm, [(ids, [other])]) == expected[1:]
    different = llm.stats()["prefix_cache_hit_tokens"] - hits - same
    assert same == (26 - 1) // 4 * 4 and different == 8, (same, different)
    settled(llm)


def test_a_repeated_image_is_encoded_once(vl_path):
    """Other text before the same image: no prefix hit, but the encoder cache serves it."""
    image = make_images([(70, 100)], seed=6)
    a, b = random_prompts(2, [5, 9], vocab=290, seed=7)
    prompts = [(with_image(a), image), (with_image(b), image)]
    llm = LLM(vl_path, block_size=4, num_kv_blocks=32)
    expected = hf_vl_greedy(vl_path, prompts, MAX_NEW)
    assert run(llm, prompts[:1]) + run(llm, prompts[1:]) == expected
    stats = llm.stats()
    assert stats["encoder_images_encoded"] == 1 and stats["encoder_cache_hits"] == 1, stats
    settled(llm)


def test_bad_image_requests_are_refused_alone(vl_path, ckpt_dir):
    image = make_images([(50, 50)])
    llm = LLM(vl_path, block_size=4, num_kv_blocks=32, limit_mm_per_prompt={"image": 2})
    engine = llm.engine
    cases = [({"prompt_token_ids": [5, IMAGE, 6], "multi_modal_data": {"image": image * 2}}, "placeholder"),
             ({"prompt_token_ids": [5, IMAGE, IMAGE, IMAGE], "multi_modal_data": {"image": image * 3}},
              "limit_mm_per_prompt allows 2"),
             ({"prompt_token_ids": [5, IMAGE], "multi_modal_data": {"video": image}}, "modality 'video'"),
             ({"prompt_token_ids": [5, IMAGE], "multi_modal_data": {"image": ["http://example.com/a.png"]}},
              "scheme 'http'"),
             ({"prompt_token_ids": [5, IMAGE], "multi_modal_data": {"image": [b"not an image"]}}, "not a decodable"),
             ({"prompt_token_ids": [5], "prompt": "x"}, "exactly one")]
    for prompt, message in cases:
        with pytest.raises(InvalidRequestError, match=message):
            engine.add_request(prompt, GREEDY)
    ok = (with_image([VISION_START, 9]), image)
    assert run(llm, [ok]) == hf_vl_greedy(vl_path, [ok], MAX_NEW)
    settled(llm)
    text_only = LLM(make_checkpoint(str(ckpt_dir / "llama"), "llama"), block_size=4, num_kv_blocks=16)
    with pytest.raises(InvalidRequestError, match="does not accept images"):
        text_only.engine.add_request({"prompt_token_ids": [5, 6], "multi_modal_data": {"image": image}}, GREEDY)


def test_a_lora_adapter_on_the_language_model_gives_peft_tokens(vl_path, tmp_path):
    """An adapter of the decoder's projections, with images: transformers + PEFT's tokens;
    one that adapts the vision tower is refused by name."""
    import transformers as tf
    from peft import LoraConfig, PeftModel, get_peft_model
    from backend.lora.adapter import LoRAConfigError

    def adapter(path: str, targets: str) -> str:
        model = tf.Qwen2VLForConditionalGeneration.from_pretrained(vl_path, dtype=torch.float32)
        peft = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=targets, lora_dropout=0.0))
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for name, p in peft.named_parameters():
                if "lora_" in name:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
        peft.save_pretrained(path)
        return path
    decoder = adapter(str(tmp_path / "decoder"), r".*language_model.*\.(q_proj|v_proj|down_proj)")
    images = make_images([(60, 90)], seed=1)
    ids = with_image(random_prompts(1, [7], vocab=290)[0])
    reference = PeftModel.from_pretrained(tf.Qwen2VLForConditionalGeneration.from_pretrained(
        vl_path, dtype=torch.float32).eval(), decoder).eval()
    px = tf.AutoImageProcessor.from_pretrained(vl_path)(images=images, return_tensors="pt")
    n = int(px["image_grid_thw"].prod(-1)[0] // 4)
    expanded = torch.tensor([[t for tok in ids for t in ([IMAGE] * n if tok == IMAGE else [tok])]])
    with torch.no_grad():
        expected = reference.generate(input_ids=expanded, attention_mask=torch.ones_like(expanded),
                                      pixel_values=px["pixel_values"], image_grid_thw=px["image_grid_thw"],
                                      mm_token_type_ids=(expanded == IMAGE).int(), do_sample=False,
                                      max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW)[0, expanded.shape[1]:].tolist()
    llm = LLM(vl_path, block_size=4, num_kv_blocks=64, lora_modules={"decoder": decoder}, max_lora_rank=8)
    with_lora = SamplingParams(max_tokens=MAX_NEW, min_tokens=MAX_NEW, temperature=0, lora_name="decoder")
    prompt = {"prompt_token_ids": ids, "multi_modal_data": {"image": images}}
    assert llm.generate(prompt, with_lora)[0].token_ids == expected
    assert llm.generate(prompt, GREEDY)[0].token_ids == hf_vl_greedy(vl_path, [(ids, images)], MAX_NEW)[0] != expected
    settled(llm)
    tower = adapter(str(tmp_path / "tower"), r".*visual.*\.qkv")
    with pytest.raises(LoRAConfigError, match="adapts the vision tower"):
        LLM(vl_path, block_size=4, num_kv_blocks=64, lora_modules={"tower": tower}, max_lora_rank=8)


def test_decode_graphs_take_the_offsets_and_a_short_last_prompt_chunk_runs_eagerly(vl_path):
    """With (CPU stand-in) CUDA graphs, over the Triton kernel in the interpreter as on a
    GPU (a graph's static views carry no host lengths): decode steps replay graphs on the 1-D positions
    shifted by the request's M-RoPE offset; a prompt whose last chunk is one token (a
    full prefix hit of the same image and text) runs that chunk eagerly, its text after
    the image at its M-RoPE position (a graph would have dropped it)."""
    from tests.helpers.graphs import EagerReplayGraphs
    image = make_images([(56, 56)], seed=9)                  # 4 tokens
    ids = with_image([10, 11, 12, 13, 14], tail=[5, 6, 7, 8, 9, 10])      # 17 tokens with the image's 4
    llm = LLM(vl_path, block_size=4, num_kv_blocks=64, attention_backend="triton")
    runner = llm.engine.runner
    runner.graphs = EagerReplayGraphs(runner, 4)
    prompt = {"prompt_token_ids": ids, "multi_modal_data": {"image": image}}
    expected = hf_vl_greedy(vl_path, [(ids, image)], MAX_NEW)[0]
    assert llm.generate(prompt, GREEDY)[0].token_ids == expected
    assert runner.graphs.replayed                                   # decode steps took graphs
    assert len(llm.engine.scheduler.requests) == 0
    prompt_len = len(ids) + 4 - 1
    assert (prompt_len - 1) % 4 == 0                                 # a full hit leaves one token
    replays = len(runner.graphs.replayed)
    assert llm.generate(prompt, GREEDY)[0].token_ids == expected
    assert llm.stats()["prefix_cache_hit_tokens"] >= prompt_len - 1
    assert len(runner.graphs.replayed) - replays == MAX_NEW - 1      # the one-token prompt chunk ran eagerly
    settled(llm)

