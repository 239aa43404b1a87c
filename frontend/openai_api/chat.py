"""Chat messages -> prompt token ids, with the checkpoint's chat template (jinja, through
the tokenizer's `apply_chat_template`) or the one given with `--chat-template`.

The frontend renders and tokenizes the conversation itself and sends token ids, so the
template's own special tokens (BOS included) are not added twice, and the prompt token
count is exact.
"""

from __future__ import annotations

import os
from typing import Optional

from frontend.openai_api.errors import APIError


def load_template(value: Optional[str]) -> Optional[str]:
    """--chat-template: a file's path, or the template itself."""
    if value and os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    return value


class ChatTemplates:
    def __init__(self, override: Optional[str] = None) -> None:
        self.override = override
        self._tokenizers: dict[str, object] = {}

    def tokenizer(self, checkpoint: Optional[str], model: str):
        if checkpoint is None:
            raise APIError(400, f"chat with '{model}' needs its checkpoint's tokenizer: start the frontend with "
                                "--model-repository pointing at the repository tritonserver serves", "model")
        if checkpoint not in self._tokenizers:
            from transformers import AutoTokenizer
            self._tokenizers[checkpoint] = AutoTokenizer.from_pretrained(checkpoint)
        return self._tokenizers[checkpoint]

    def prompt_ids(self, checkpoint: Optional[str], model: str, messages: list[dict]) -> list[int]:
        return self.render(checkpoint, model, messages)[1]

    def render(self, checkpoint: Optional[str], model: str, messages: list[dict], tools: Optional[list[dict]] = None,
               template_kwargs: Optional[dict] = None) -> tuple[str, list[int]]:
        """The prompt's text and ids. `tools` reach the template as `tools` (transformers'
        convention); `template_kwargs` are the request's chat_template_kwargs."""
        tok = self.tokenizer(checkpoint, model)
        template = self.override or getattr(tok, "chat_template", None)
        if not template:
            raise APIError(400, f"model '{model}' has no chat template: use /v1/completions, or start the "
                                "frontend with --chat-template", "messages")
        kwargs = {k: v for k, v in (template_kwargs or {}).items()
                  if k not in ("chat_template", "tokenize", "add_generation_prompt", "tools", "conversation")}
        try:
            text = tok.apply_chat_template(messages, chat_template=template, add_generation_prompt=True,
                                           tokenize=False, tools=tools, **kwargs)
        except Exception as e:  # a template error is about these messages
            raise APIError(400, f"the chat template could not render these messages: {e}", "messages") from None
        return text, tok(text, add_special_tokens=False)["input_ids"]
