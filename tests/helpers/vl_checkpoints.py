"""Random-weight vision-language checkpoints (with their image processor's config),
generated images, and greedy references from transformers itself."""

from __future__ import annotations

import os

import numpy as np
import torch

# Vocabulary ids of the tiny Qwen2-VL's special tokens (inside its 320-token vocabulary).
IMAGE, VIDEO, VISION_START, VISION_END = 300, 301, 302, 303
# Images of up to 16 merged tokens (a 112 x 112 image), at least 4.
MIN_PIXELS, MAX_PIXELS = 28 * 28 * 4, 28 * 28 * 16


# Qwen2-VL's chat template reduced to what the tests need: each image part of a message
# becomes <|vision_start|><|image_pad|><|vision_end|> where it stands.
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for p in m['content'] %}{% if p['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif p['type'] == 'text' %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}")


QWEN_SPECIALS = ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>")
GEMMA3_SPECIALS = ("<image_soft_token>", "<start_of_image>", "<end_of_image>")


def write_tokenizer(path: str, specials: tuple[str, ...] = QWEN_SPECIALS) -> None:
    """A byte-level BPE of 300 tokens (<unk> <s> </s> first) trained on the project's
    corpus, then the vision tokens as 300.., as the checkpoint's config names them."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    from builder.tiny import CORPUS
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    with open(CORPUS, encoding="utf-8") as f:
        tok.train_from_iterator([p for p in f.read().split("\n\n")[:400] if p.strip()], trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.add_special_tokens({"additional_special_tokens": [AddedToken(t, special=True, normalized=False)
                                                           for t in specials]})
    assert fast.convert_tokens_to_ids(list(specials)) == list(range(300, 300 + len(specials)))
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)


def make_qwen2_vl(path: str, seed: int = 0, tokenizer: bool = False, version: str = "2") -> str:
    """tokenizer: with tokenizer files and a chat template (what serving needs). version
    "2.5": Qwen2.5-VL (its windowed tower: windows of 2x2 merged groups, blocks 1 and 3
    attending to the whole image)."""
    import transformers as tf
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    text = dict(vocab_size=320, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=1024, initializer_range=0.25, bos_token_id=1,
                eos_token_id=2, rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3],
                                                 "rope_theta": 10000.0})
    vision = dict(depth=2, embed_dim=32, hidden_size=64, num_heads=4, mlp_ratio=2, patch_size=14,
                  spatial_merge_size=2, temporal_patch_size=2, initializer_range=0.25)
    config_cls, model_cls = tf.Qwen2VLConfig, tf.Qwen2VLForConditionalGeneration
    if version == "2.5":
        vision = dict(depth=4, hidden_size=32, out_hidden_size=64, intermediate_size=48, num_heads=4, patch_size=14,
                      spatial_merge_size=2, temporal_patch_size=2, window_size=56, fullatt_block_indexes=[1, 3],
                      initializer_range=0.25)
        config_cls, model_cls = tf.Qwen2_5_VLConfig, tf.Qwen2_5_VLForConditionalGeneration
    cfg = config_cls(text_config=text, vision_config=vision, image_token_id=IMAGE, video_token_id=VIDEO,
                     vision_start_token_id=VISION_START, vision_end_token_id=VISION_END)
    torch.manual_seed(seed)
    model_cls(cfg).eval().save_pretrained(path)
    tf.Qwen2VLImageProcessorPil(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS).save_pretrained(path)
    if tokenizer:
        write_tokenizer(path)
    return path


def make_images(sizes: list[tuple[int, int]], seed: int = 0) -> list:
    """RGB images of (height, width) each: smooth gradients with noise, so that resizing
    keeps them distinct."""
    from PIL import Image
    rng = np.random.default_rng(seed)
    out = []
    for h, w in sizes:
        base = np.linspace(0, 255, h * w * 3).reshape(h, w, 3)
        noise = rng.integers(0, 80, (h, w, 3))
        out.append(Image.fromarray(((base + noise) % 256).astype(np.uint8)))
    return out


def with_image(text_ids: list[int], n_images: int = 1, tail: list[int] = (5, 6, 7)) -> list[int]:
    """text, then <vision_start><image_pad><vision_end> per image, then a tail."""
    ids = list(text_ids)
    for _ in range(n_images):
        ids += [VISION_START, IMAGE, VISION_END]
    return ids + list(tail)


def hf_vl_greedy(path: str, prompts: list[tuple[list[int], list]], max_new_tokens: int) -> list[list[int]]:
    """transformers' generate, one prompt at a time: the placeholders expanded by the
    image processor's grid (as Qwen2VLProcessor does)."""
    import transformers as tf
    model = tf.AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    processor = tf.AutoImageProcessor.from_pretrained(path)
    outs = []
    for ids, images in prompts:
        kwargs = {}
        if images:
            px = processor(images=images, return_tensors="pt")
            counts = iter((px["image_grid_thw"].prod(-1) // 4).tolist())
            ids = [t for tok in ids for t in ([IMAGE] * next(counts) if tok == IMAGE else [tok])]
            kwargs = dict(pixel_values=px["pixel_values"], image_grid_thw=px["image_grid_thw"])
        input_ids = torch.tensor([ids])
        kwargs["mm_token_type_ids"] = (input_ids == IMAGE).int()
        with torch.no_grad():
            gen = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                                 max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, **kwargs)
        outs.append(gen[0, len(ids):].tolist())
    return outs


def make_llava(path: str, seed: int = 0, feature_layer=-2, strategy: str = "default") -> str:
    """A tiny LLaVA: a 3-layer CLIP tower on 56 x 56 images (16 patches each) and a
    2-layer Llama; placeholder token IMAGE."""
    import transformers as tf
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    text = dict(model_type="llama", vocab_size=320, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, initializer_range=0.25,
                bos_token_id=1, eos_token_id=2)
    vision = dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                  num_attention_heads=4, image_size=56, patch_size=14, projection_dim=32, initializer_range=0.25)
    cfg = tf.LlavaConfig(text_config=text, vision_config=vision, image_token_index=IMAGE,
                         vision_feature_layer=feature_layer, vision_feature_select_strategy=strategy)
    torch.manual_seed(seed)
    tf.LlavaForConditionalGeneration(cfg).eval().save_pretrained(path)
    tf.CLIPImageProcessorPil(size={"shortest_edge": 56}, crop_size={"height": 56, "width": 56}).save_pretrained(path)
    return path


def hf_llava_greedy(path: str, prompts: list[tuple[list[int], list]], max_new_tokens: int) -> list[list[int]]:
    """transformers' generate for LLaVA, one prompt at a time, placeholders expanded to
    the tower's patch count (as LlavaProcessor does)."""
    import json

    import transformers as tf
    model = tf.LlavaForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    processor = tf.AutoImageProcessor.from_pretrained(path)
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    per_image = 16 + (cfg["vision_feature_select_strategy"] == "full")
    outs = []
    for ids, images in prompts:
        kwargs = {}
        if images:
            kwargs["pixel_values"] = processor(images=images, return_tensors="pt")["pixel_values"]
            ids = [t for tok in ids for t in ([IMAGE] * per_image if tok == IMAGE else [tok])]
        input_ids = torch.tensor([ids])
        with torch.no_grad():
            gen = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                                 max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, **kwargs)
        outs.append(gen[0, len(ids):].tolist())
    return outs


# The tiny Gemma 3's image tokens (inside its 320-token vocabulary).
SOFT, BOI, EOI = 300, 301, 302


def make_gemma3(path: str, seed: int = 0) -> str:
    """A tiny Gemma 3 with images: sliding (window 12, shorter than an image's 16 tokens)
    and full layers, a 2-layer SigLIP tower on 56 x 56 images (16 patches), 4 soft tokens
    an image... pooled 2x2 from the 4x4 patch grid."""
    import transformers as tf
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    text = dict(vocab_size=320, hidden_size=64, intermediate_size=160, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, initializer_range=0.25,
                bos_token_id=1, eos_token_id=2, pad_token_id=0, sliding_window=6, query_pre_attn_scalar=24,
                layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
                                 "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}})
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=56,
                  patch_size=14, initializer_range=0.25, vision_use_head=False)
    cfg = tf.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=SOFT,
                          boi_token_index=BOI, eoi_token_index=EOI)
    torch.manual_seed(seed)
    model = tf.Gemma3ForConditionalGeneration(cfg).eval()
    with torch.no_grad():       # Gemma's norms start at zero (1 + w = 1): give them values that matter
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") and "vision_tower" not in name:
                p.normal_(0.0, 0.3)
    model.save_pretrained(path)
    tf.Gemma3ImageProcessorPil(size={"height": 56, "width": 56}).save_pretrained(path)
    return path


def with_gemma3_image(text_ids: list[int], n_images: int = 1, tail: list[int] = (5, 6, 7)) -> list[int]:
    return list(text_ids) + [BOI, 9] * n_images + list(tail)


def hf_gemma3_greedy(path: str, prompts: list[tuple[list[int], list]], max_new_tokens: int) -> list[list[int]]:
    """transformers' generate for Gemma 3, one prompt at a time, each <start_of_image>
    expanded to <start_of_image> + 4 soft tokens + <end_of_image> (this checkpoint has no
    tokenizer: no "\\n\\n" around them), token_type_ids marking the soft tokens."""
    import transformers as tf
    model = tf.Gemma3ForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    processor = tf.AutoImageProcessor.from_pretrained(path)
    outs = []
    for ids, images in prompts:
        kwargs = {}
        if images:
            kwargs["pixel_values"] = processor(images=images, return_tensors="pt")["pixel_values"]
            ids = [t for tok in ids for t in ([BOI] + [SOFT] * 4 + [EOI] if tok == BOI else [tok])]
        input_ids = torch.tensor([ids])
        with torch.no_grad():
            gen = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                                 token_type_ids=(input_ids == SOFT).long(), max_new_tokens=max_new_tokens,
                                 min_new_tokens=max_new_tokens, **kwargs)
        outs.append(gen[0, len(ids):].tolist())
    return outs
