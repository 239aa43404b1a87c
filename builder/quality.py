"""How close a quantized model's logits stay to its source's, on held-out text: the
quality report every quantized build writes (FP8, INT8, INT4)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch


@dataclass
class QualityReport:
    held_out_tokens: int
    relative_logit_error: float
    top1_agreement: float


def load_source(src: str, dtype="auto"):
    """(the source model, a function from texts to token-id tensors of at most 256). A
    vision-language checkpoint comes as its language model (LanguageModelView)."""
    from transformers import AutoModelForCausalLM
    from backend.models.architectures import reads_images
    if reads_images(src):
        from transformers import AutoModelForImageTextToText
        model = LanguageModelView(AutoModelForImageTextToText.from_pretrained(src, dtype=dtype).eval())
    else:
        model = AutoModelForCausalLM.from_pretrained(src, dtype=dtype).eval()
    encode_one = text_encoder(src, model.config.vocab_size)

    def encode(texts: list[str]) -> list[torch.Tensor]:
        return [torch.tensor(encode_one(t)[:256]) for t in texts]
    return model, encode


class LanguageModelView:
    """A vision-language model as the quantizers read a causal LM: its forward on token
    ids (text only), `model.layers` (the decoder's), the text config, and named_modules
    over the decoder and the LM head only, so that nothing of the vision tower is
    calibrated or quantized; state_dict() is the whole model's (the tower saved as it is)."""

    layers_prefix = "model.language_model.layers"      # (the decoder layers' module names: GPTQ's walk)

    def __init__(self, model) -> None:
        self.full = model
        self.model = model.model.language_model
        self.config = model.config.get_text_config()
        self.config.tie_word_embeddings = model.config.tie_word_embeddings

    def __call__(self, input_ids):
        return self.full(input_ids=input_ids)

    def named_modules(self):
        for name, module in self.full.named_modules():
            if name.startswith(("model.language_model", "lm_head")):
                yield name, module

    def named_parameters(self):
        return ((n, p) for n, p in self.full.named_parameters() if n.startswith(("model.language_model", "lm_head")))

    def state_dict(self):
        return self.full.state_dict()


def text_encoder(src: str, vocab_size: int) -> Callable[[str], list[int]]:
    """Text -> token ids with the checkpoint's tokenizer; token-id-only checkpoints (no
    tokenizer files): the bytes of the text as ids, in range."""
    import os

    from transformers import AutoTokenizer
    if not any(os.path.isfile(os.path.join(src, f)) for f in ("tokenizer.json", "tokenizer.model")):
        return lambda t: [b % vocab_size for b in t.encode()]
    return AutoTokenizer.from_pretrained(src).encode


@torch.no_grad()
def run_with_hooks(model, batches: list[torch.Tensor], hooks: list) -> None:
    """The calibration prompts through the model (the hooks observe), then the hooks
    removed, also on error."""
    try:
        for ids in batches:
            model(ids[None])
    finally:
        for h in hooks:
            h.remove()


@torch.no_grad()
def logit_quality(model, texts: list[torch.Tensor], weights: dict[str, torch.Tensor],
                  input_hook: Optional[Callable[[str], Callable]] = None,
                  reference: Optional[list[torch.Tensor]] = None) -> QualityReport:
    """Source logits vs the same model with `weights` (module name -> the weight the
    quantized engine computes with) swapped in, and with `input_hook(name)`, if given, as
    a forward pre-hook on each such module (FP8's rounded activations). `reference`: the
    source's logits of `texts`, when `model` is no longer the source (W8A8's smoothing)."""
    ref = reference if reference is not None else [model(ids[None]).logits[0].float() for ids in texts]
    modules = dict(model.named_modules())
    saved, hooks = {}, []
    for name, w in weights.items():
        lin = modules[name]
        saved[name] = lin.weight.data
        lin.weight.data = w.to(lin.weight.dtype)
        if input_hook is not None:
            hooks.append(lin.register_forward_pre_hook(input_hook(name)))
    try:
        got = [model(ids[None]).logits[0].float() for ids in texts]
    finally:
        for h in hooks:
            h.remove()
        for name, w in saved.items():
            modules[name].weight.data = w
    num = sum((g - r).norm() ** 2 for g, r in zip(got, ref)) ** 0.5
    den = sum(r.norm() ** 2 for r in ref) ** 0.5
    agree = sum((g.argmax(-1) == r.argmax(-1)).sum().item() for g, r in zip(got, ref))
    n = sum(r.shape[0] for r in ref)
    return QualityReport(held_out_tokens=n, relative_logit_error=float(num / den), top1_agreement=agree / n)
