"""The embedded default model: a small random-weight Llama checkpoint with a real
byte-level BPE tokenizer, created offline and deterministically.

The tokenizer is trained with `tokenizers` on builder/data/corpus.txt (CPython's
documentation topics, committed with the project), and the weights come from a fixed
torch seed, so every machine builds the same checkpoint.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass

CORPUS = os.path.join(os.path.dirname(__file__), "data", "corpus.txt")
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>"]
# Added (not special) tokens, as Qwen3's: decoded into the text, where the frontend's
# hermes tool-call parser and reasoning parsers find them.
MARKER_TOKENS = ["<think>", "</think>", "<tool_call>", "</tool_call>"]
# So that chat works out of the box (the OpenAI frontend's /v1/chat/completions), with
# tools (Hermes/Qwen style: offered in a system line, called as <tool_call>{json}</tool_call>,
# results as `tool` turns) and thinking (`chat_template_kwargs: {"enable_thinking": true}`
# opens a <think> block, as Qwen3's template does). Without tools the text is as before.
# (transformers renders with trim_blocks: a newline right after a tag is written as {{ '\\n' }}.)
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}system: You may call these functions: {% for t in tools %}{{ t | tojson }} {% endfor %}"
    "Call one as <tool_call>{\"name\": name, \"arguments\": {...}}</tool_call>{{ '\\n' }}{% endif %}"
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] if m['content'] is not none else '' }}"
    "{% if m['tool_calls'] is defined and m['tool_calls'] %}{% for c in m['tool_calls'] %}"
    "{% set a = c['function']['arguments'] %}"
    "<tool_call>{\"name\": {{ c['function']['name'] | tojson }}, \"arguments\": "
    "{{ a if a is string else a | tojson }}}</tool_call>{% endfor %}{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% if enable_thinking %}<think>{% endif %}{% endif %}")


@dataclass(frozen=True)
class TinySpec:
    vocab_size: int = 4096
    hidden_size: int = 256
    intermediate_size: int = 768
    num_hidden_layers: int = 4
    num_attention_heads: int = 8
    num_key_value_heads: int = 4
    max_position_embeddings: int = 2048
    initializer_range: float = 0.1
    seed: int = 0


def train_tokenizer(output: str, vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - len(MARKER_TOKENS), special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    with open(CORPUS, encoding="utf-8") as f:
        text = f.read()
    # Paragraphs as training units; the trainer is deterministic for a fixed input order.
    tok.train_from_iterator([p for p in text.split("\n\n") if p.strip()], trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>")
    from tokenizers import AddedToken
    fast.add_tokens([AddedToken(t, special=False, normalized=False) for t in MARKER_TOKENS])
    fast.save_pretrained(output)
    # transformers 5 writes its own class name; older releases (NVIDIA's images) need this one.
    cfg_path = os.path.join(output, "tokenizer_config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg.pop("backend", None)
    cfg["chat_template"] = CHAT_TEMPLATE
    with open(cfg_path, "w") as f:
        json.dump(cfg, f, indent=2)
    return fast


def build_tiny(output: str, spec: TinySpec = TinySpec()) -> str:
    """Write a Hugging Face checkpoint folder (config, safetensors, tokenizer) to `output`."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    os.makedirs(output, exist_ok=True)
    tokenizer = train_tokenizer(output, spec.vocab_size)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size, num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads, num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=spec.max_position_embeddings,
        initializer_range=spec.initializer_range,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=False)
    torch.manual_seed(spec.seed)
    model = LlamaForCausalLM(config)
    model.save_pretrained(output)
    with open(os.path.join(output, "tiny_spec.json"), "w") as f:
        json.dump(asdict(spec), f, indent=2)
    return output
