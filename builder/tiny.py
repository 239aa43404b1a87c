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
# So that chat works out of the box (the OpenAI frontend's /v1/chat/completions).
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")


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
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    with open(CORPUS, encoding="utf-8") as f:
        text = f.read()
    # Paragraphs as training units; the trainer is deterministic for a fixed input order.
    tok.train_from_iterator([p for p in text.split("\n\n") if p.strip()], trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>")
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
