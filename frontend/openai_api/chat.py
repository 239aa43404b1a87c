"""Chat messages -> prompt token ids, with the checkpoint's chat template (jinja, through
the tokenizer's `apply_chat_template`) or the one given with `--chat-template`.

The frontend renders and tokenizes the conversation itself and sends token ids, so the
template's own special tokens (BOS included) are not added twice, and the prompt token
count is exact.

Tokenizers load once per checkpoint, under a lock: chat requests run on worker threads,
and the first ones after a start raced on `from transformers import AutoTokenizer` (5 of
10 concurrent first requests failed). The app loads every served model's tokenizer at
start (startup.py), so the first chat request does not pay for it either.
"""

from __future__ import annotations

import os
import threading
from typing import Iterable, Optional

from frontend.openai_api.errors import APIError
from frontend.openai_api.tokenization import tokenize_or_400


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
        self._lock = threading.Lock()

    def tokenizer(self, checkpoint: Optional[str], model: str, use: str = "chat", param: str = "model"):
        """The checkpoint's tokenizer; a 400 naming `param` when the frontend has none for
        the model (`use`: what needed it, for the message)."""
        if checkpoint is None:
            raise APIError(400, f"{use} with '{model}' needs its checkpoint's tokenizer: start the frontend with "
                                "--model-repository pointing at the repository tritonserver serves", param)
        tok = self._tokenizers.get(checkpoint)
        if tok is None:
            with self._lock:            # one import, one load per checkpoint
                tok = self._tokenizers.get(checkpoint)
                if tok is None:
                    from transformers import AutoTokenizer
                    tok = self._tokenizers[checkpoint] = AutoTokenizer.from_pretrained(checkpoint)
        return tok

    def load(self, checkpoints: Iterable[Optional[str]]) -> None:
        """Load these checkpoints' tokenizers now (at start)."""
        for checkpoint in checkpoints:
            if checkpoint is not None:
                self.tokenizer(checkpoint, "")

    def render(self, checkpoint: Optional[str], model: str, messages: list[dict], tools: Optional[list[dict]] = None,
               template_kwargs: Optional[dict] = None, max_model_len: Optional[int] = None,
               add_generation_prompt: bool = True, continue_final_message: bool = False,
               add_special_tokens: bool = False) -> tuple[str, list[int]]:
        """The prompt's text and ids. `tools` reach the template as `tools` (transformers'
        convention); `template_kwargs` are the request's chat_template_kwargs.
        max_model_len, when known: a conversation that cannot fit is refused after
        tokenizing about that many tokens of it, not all of it (prompt_length.py). The
        last three: /tokenize's switches (chat sends the rendered text's ids as they are)."""
        tok = self.tokenizer(checkpoint, model)
        template = self.override or getattr(tok, "chat_template", None)
        if not template:
            raise APIError(400, f"model '{model}' has no chat template: send a prompt instead of messages, or "
                                "start the frontend with --chat-template", "messages")
        reserved = ("chat_template", "tokenize", "add_generation_prompt", "continue_final_message", "tools",
                    "conversation")
        kwargs = {k: v for k, v in (template_kwargs or {}).items() if k not in reserved}
        try:
            text = tok.apply_chat_template(messages, chat_template=template, add_generation_prompt=add_generation_prompt,
                                           continue_final_message=continue_final_message, tokenize=False, tools=tools,
                                           **kwargs)
        except Exception as e:  # a template error is about these messages
            raise APIError(400, f"the chat template could not render these messages: {e}", "messages") from None
        tokenize = lambda t: tok(t, add_special_tokens=add_special_tokens)["input_ids"]  # noqa: E731
        return text, tokenize_or_400(tokenize, text, max_model_len, "messages")
