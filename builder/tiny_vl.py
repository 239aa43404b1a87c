"""A small random-weight Qwen2-VL checkpoint (`python -m builder tiny --vision`): the
default model's tokenizer with Qwen2-VL's four vision tokens added, a chat template that
places each image part, the image processor's config, and random weights from a fixed
seed. For trying images end to end and for the vision benchmark; it answers nonsense."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass

VISION_TOKENS = ("<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>")
# builder/tiny.py's template with content parts: an image part is Qwen2-VL's placeholder.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: "
    "{% if m['content'] is string %}{{ m['content'] }}{% elif m['content'] %}{% for p in m['content'] %}"
    "{% if p['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif p['type'] == 'text' %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}")


@dataclass(frozen=True)
class TinyVisionSpec:
    hidden_size: int = 256
    intermediate_size: int = 768
    num_hidden_layers: int = 4
    num_attention_heads: int = 8
    num_key_value_heads: int = 4
    vision_embed_dim: int = 128
    vision_depth: int = 4
    vision_heads: int = 4
    # Images become 16 to 64 tokens (112 x 112 to 224 x 224 pixels after resizing).
    min_pixels: int = 28 * 28 * 16
    max_pixels: int = 28 * 28 * 64
    initializer_range: float = 0.1
    seed: int = 0


def build_tiny_vision(output: str, spec: TinyVisionSpec = TinyVisionSpec()) -> str:
    import torch
    import transformers as tf
    from tokenizers import AddedToken

    from builder.tiny import train_tokenizer
    os.makedirs(output, exist_ok=True)
    tokenizer = train_tokenizer(output, 4096)
    tokenizer.add_special_tokens({"additional_special_tokens": [AddedToken(t, special=True, normalized=False)
                                                                for t in VISION_TOKENS]})
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(output)
    cfg_path = os.path.join(output, "tokenizer_config.json")       # (as builder/tiny.py writes it)
    with open(cfg_path) as f:
        tok_cfg = json.load(f)
    tok_cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    tok_cfg.pop("backend", None)
    tok_cfg["chat_template"] = CHAT_TEMPLATE     # (older transformers read it here, not chat_template.jinja)
    with open(cfg_path, "w") as f:
        json.dump(tok_cfg, f, indent=2)
    ids = dict(zip(VISION_TOKENS, tokenizer.convert_tokens_to_ids(list(VISION_TOKENS))))
    mrope = spec.hidden_size // spec.num_attention_heads // 2           # rotary pairs, split 1 : 1.5 : 1.5
    section = [mrope // 4, (mrope - mrope // 4) // 2, mrope - mrope // 4 - (mrope - mrope // 4) // 2]
    text = dict(vocab_size=len(tokenizer), hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
                num_hidden_layers=spec.num_hidden_layers, num_attention_heads=spec.num_attention_heads,
                num_key_value_heads=spec.num_key_value_heads, max_position_embeddings=2048,
                initializer_range=spec.initializer_range, bos_token_id=tokenizer.bos_token_id,
                eos_token_id=tokenizer.eos_token_id,
                rope_parameters={"rope_type": "default", "mrope_section": section, "rope_theta": 10000.0})
    vision = dict(depth=spec.vision_depth, embed_dim=spec.vision_embed_dim, hidden_size=spec.hidden_size,
                  num_heads=spec.vision_heads, mlp_ratio=4, patch_size=14, spatial_merge_size=2,
                  temporal_patch_size=2, initializer_range=spec.initializer_range)
    config = tf.Qwen2VLConfig(text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
                              video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
                              vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=False)
    torch.manual_seed(spec.seed)
    tf.Qwen2VLForConditionalGeneration(config).save_pretrained(output)
    tf.Qwen2VLImageProcessorPil(min_pixels=spec.min_pixels, max_pixels=spec.max_pixels).save_pretrained(output)
    with open(os.path.join(output, "tiny_spec.json"), "w") as f:
        json.dump(asdict(spec), f, indent=2)
    return output
