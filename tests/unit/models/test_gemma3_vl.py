"""Gemma 3 with images (backend/models/gemma3_vl.py, backend/multimodal/gemma3.py): the
SigLIP tower and projector equal transformers' bit for bit, and greedy output equals
transformers' (fp32, CPU), whose image tokens attend to their whole image (key limits in
the attention; each image computed in one step): one and two images beside text-only
prompts, sliding layers whose window is shorter than the prompt, chunks that end before
an image rather than inside it, preemption, and prefix hits with the same image."""

import pytest
import torch

from backend import LLM, SamplingParams
from backend.engine.errors import InvalidRequestError
from tests.conftest import assert_pool_free, random_prompts
from tests.helpers.vl_checkpoints import (BOI, EOI, SOFT, hf_gemma3_greedy, make_gemma3, make_images,
                                          with_gemma3_image)

MAX_NEW = 10
GREEDY = SamplingParams(max_tokens=MAX_NEW, min_tokens=MAX_NEW, temperature=0)


@pytest.fixture(scope="module")
def gemma3_path(tmp_path_factory):
    return make_gemma3(str(tmp_path_factory.mktemp("gemma3") / "ckpt"))


def run(llm, prompts):
    outs = llm.generate([{"prompt_token_ids": ids, "multi_modal_data": {"image": im}} if im else ids
                         for ids, im in prompts], GREEDY)
    return [o.token_ids for o in outs]


def test_tower_and_projector_match_transformers(gemma3_path):
    import transformers as tf
    from backend.attention import make_attention_factory
    from backend.models.config import load_model_config
    from backend.models.loader import load_model
    ours = load_model(gemma3_path, load_model_config(gemma3_path), torch.float32, torch.device("cpu"),
                      make_attention_factory("torch"), 1024)
    ref = tf.Gemma3ForConditionalGeneration.from_pretrained(gemma3_path).eval()
    px = tf.AutoImageProcessor.from_pretrained(gemma3_path)(images=make_images([(60, 90), (112, 112)]),
                                                            return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        got = ours.encode_images(px, [(1, 4, 4)] * 2)
        want = ref.model.get_image_features(px).pooler_output
    assert all(torch.equal(g, w) for g, w in zip(got, want))


@pytest.mark.parametrize("attention", ["torch", "triton"])
def test_greedy_matches_transformers(gemma3_path, attention):
    """The Triton kernel through the interpreter, key limits and all."""
    images = make_images([(60, 90), (100, 40), (112, 112), (30, 30)], seed=3)
    texts = random_prompts(4, [9, 4, 15, 2], vocab=290, seed=8)
    prompts = [(with_gemma3_image(texts[0]), images[:1]), (texts[1] + [7] * 21, []),
               (with_gemma3_image(texts[2], 2), images[1:3]), (with_gemma3_image(texts[3]), images[3:])]
    expected = hf_gemma3_greedy(gemma3_path, prompts, MAX_NEW)
    llm = LLM(gemma3_path, block_size=4, num_kv_blocks=18, max_num_batched_tokens=8, max_num_seqs=8,
              attention_backend=attention)
    assert run(llm, prompts) == expected
    stats = llm.stats()
    assert stats["num_preemptions"] > 0 and stats["num_chunked_prefills"] > 0, stats
    assert_pool_free(llm)
    assert not llm.engine.vision.encoder_cache.refs


def test_prefix_hits_with_the_same_image_and_a_chunk_never_ends_inside_one(gemma3_path):
    first, other = make_images([(84, 84), (84, 84)], seed=4)
    ids = with_gemma3_image(random_prompts(1, [9], vocab=290, seed=5)[0], tail=[5, 6, 7, 8, 9, 10])
    expected = hf_gemma3_greedy(gemma3_path, [(ids, [first]), (ids, [other])], MAX_NEW)
    llm = LLM(gemma3_path, block_size=4, num_kv_blocks=32, max_num_batched_tokens=11)
    chunks = []
    original = llm.engine.scheduler.schedule

    def schedule(*args, **kwargs):
        out = original(*args, **kwargs)
        chunks.extend((s.num_computed_tokens, s.num_new_tokens) for s in out.scheduled if s.num_new_tokens > 1)
        return out
    llm.engine.scheduler.schedule = schedule
    assert run(llm, [(ids, [first])]) == expected[:1]
    image = (10, 14)            # 9 tokens, <start_of_image>, then the 4 soft tokens
    assert all(not (a < image[1] and a + n > image[0]) or (a <= image[0] and a + n >= image[1])
               for a, n in chunks), chunks
    hits = llm.stats()["prefix_cache_hit_tokens"]
    assert run(llm, [(ids, [first])]) == expected[:1]
    assert llm.stats()["prefix_cache_hit_tokens"] - hits == (len(ids) + 4 + 1 - 1) // 4 * 4
    assert run(llm, [(ids, [other])]) == expected[1:]
    assert_pool_free(llm)


def test_an_image_longer_than_a_step_is_refused(gemma3_path):
    llm = LLM(gemma3_path, block_size=4, num_kv_blocks=32, max_num_batched_tokens=3)
    with pytest.raises(InvalidRequestError, match="exceeds max_num_batched_tokens=3"):
        llm.engine.add_request({"prompt_token_ids": [5, BOI, 6], "multi_modal_data": {"image": make_images([(40, 40)])}},
                               GREEDY)
    assert SOFT not in [5, 6]


@pytest.mark.parametrize("attention", ["torch", "triton"])
def test_prompt_logprobs_show_the_image_attends_to_itself(gemma3_path, attention):
    """Greedy tokens barely move with the image mask on these weights; the prompt's own
    logprobs do (by 0.38 at an image position here): they equal transformers' with
    the whole-image mask, not without it."""
    import transformers as tf
    images = make_images([(60, 90)], seed=3)
    ids = with_gemma3_image(random_prompts(1, [9], vocab=290, seed=8)[0])
    model = tf.Gemma3ForConditionalGeneration.from_pretrained(gemma3_path, dtype=torch.float32).eval()
    px = tf.AutoImageProcessor.from_pretrained(gemma3_path)(images=images, return_tensors="pt")["pixel_values"]
    expanded = torch.tensor([[t for tok in ids for t in ([BOI] + [SOFT] * 4 + [EOI] if tok == BOI else [tok])]])
    with torch.no_grad():
        whole = model(input_ids=expanded, pixel_values=px, token_type_ids=(expanded == SOFT).long()).logits[0]
        causal = model(input_ids=expanded, pixel_values=px).logits[0]

    def of(logits):
        return [logits[i - 1].log_softmax(-1)[expanded[0, i]].item() for i in range(1, expanded.shape[1])]
    llm = LLM(gemma3_path, block_size=4, num_kv_blocks=32, attention_backend=attention)
    out = llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": images}},
                       SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0))[0]
    ours = [next(iter(entry.values())).logprob for entry in out.prompt_logprobs[1:]]
    assert max(abs(a - b) for a, b in zip(ours, of(whole))) < 1e-4
    assert max(abs(a - b) for a, b in zip(ours, of(causal))) > 0.1
    assert_pool_free(llm)


def test_images_are_placed_as_the_gemma3_processor_places_them(gemma3_path, tmp_path):
    """With the checkpoint's tokenizer: a text prompt is expanded before tokenizing
    ("\\n\\n<start_of_image>" + soft tokens + "<end_of_image>\\n\\n", as transformers'
    Gemma3Processor writes it), token ids with the tokenizer's "\\n\\n" ids; both give
    the image's soft tokens where they stand."""
    import os
    from backend.multimodal.gemma3 import Gemma3Processor
    from backend.models.config import load_model_config
    from tests.helpers.vl_checkpoints import GEMMA3_SPECIALS, write_tokenizer
    folder = tmp_path / "with_tokenizer"
    folder.mkdir()
    for name in os.listdir(gemma3_path):
        os.symlink(os.path.join(gemma3_path, name), folder / name)
    write_tokenizer(str(folder), GEMMA3_SPECIALS)
    processor = Gemma3Processor(str(folder), load_model_config(str(folder)).hf_config)
    text = processor.expand_text("look:\n<start_of_image>what?")
    assert text == "look:\n\n\n<start_of_image>" + "<image_soft_token>" * 4 + "<end_of_image>\n\nwhat?"
    from transformers import AutoTokenizer
    ids = AutoTokenizer.from_pretrained(str(folder)).encode(text, add_special_tokens=False)
    placed, mm = processor.process(ids, make_images([(40, 40)]))
    assert placed == ids and placed[mm.items[0].offset:mm.items[0].end] == [SOFT] * 4
    newlines = processor.newline_ids()
    placed, mm = processor.process([7, BOI, 8], make_images([(40, 40)]))
    assert placed == [7] + newlines + [BOI] + [SOFT] * 4 + [EOI] + newlines + [8]
    assert mm.items[0].offset == 2 + len(newlines) and newlines


def test_image_tokens_typed_into_a_prompt_are_refused(gemma3_path):
    """Soft tokens that are not a whole image as the processor writes it (a user can type
    the special token's text) are a 400, not an image placed over other tokens."""
    llm = LLM(gemma3_path, block_size=4, num_kv_blocks=32)
    image = make_images([(40, 40)])
    for ids in ([5, SOFT, 6], [5, BOI, SOFT, SOFT, SOFT, SOFT, 6], [BOI, SOFT, SOFT, EOI, BOI, SOFT, SOFT, EOI]):
        with pytest.raises(InvalidRequestError, match="not each <start_of_image>|image placeholder"):
            llm.engine.add_request({"prompt_token_ids": ids, "multi_modal_data": {"image": image}}, GREEDY)
    assert_pool_free(llm)
