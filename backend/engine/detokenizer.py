"""Incremental detokenization and stop-string handling for one request.

Each new token is decoded together with a few tokens before it (vLLM's prefix/read
offsets), and the text that window adds over the window without the new token is the
delta. Decoding a window instead of a lone token keeps the spaces that tokenizers
attach to word starts; a window that ends in an incomplete UTF-8 sequence decodes to
U+FFFD and is held back until the next token completes it.
"""

from __future__ import annotations

from typing import Callable, Optional

from backend.sampling_params import SamplingParams

_CONTEXT_TOKENS = 5
_UNSET = object()


def fast_decoder(tokenizer) -> Optional[Callable[[list[int], bool], str]]:
    """The Rust tokenizer's own decode, where transformers' decode would only forward to
    it (a fast tokenizer whose class keeps the base `_decode`, cleanup off as here): the
    same text without the wrapper's per-call Python overhead, which dominated a 256-way
    decode step's host time. None where that does not hold."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not getattr(tokenizer, "is_fast", False):
        return None
    try:
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:
        return None
    if type(tokenizer)._decode is not TokenizersBackend._decode:
        return None
    return lambda ids, skip_special_tokens: backend.decode(ids, skip_special_tokens=skip_special_tokens)


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], params: SamplingParams,
                 decode: Optional[Callable[[list[int], bool], str]] = None) -> None:
        self.tokenizer = tokenizer
        self.params = params
        self._fast_decode = decode
        self.token_ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.token_ids)
        self.output_text = ""
        # The decoded window before the read offset, kept while the offsets stand: each
        # step's logprob candidates (peek) and its token share it.
        self._prefix_text: Optional[str] = None
        # What peek found for each candidate since the last token: the token then added
        # is one of them (a logprob entry lists the sampled token), so its text is known.
        self._peeks: Optional[dict[int, Optional[str]]] = None
        # Characters already handed out; stop strings may cut the text back only past it.
        self._num_sent = 0
        self._hold = max((len(s) for s in params.stop), default=1) - 1

    def _decode(self, ids: list[int]) -> str:
        if self._fast_decode is not None:
            return self._fast_decode(ids, self.params.skip_special_tokens)
        return self.tokenizer.decode(ids, skip_special_tokens=self.params.skip_special_tokens,
                                     clean_up_tokenization_spaces=False)

    def _new_text(self, window: list[int]) -> Optional[str]:
        """The text `window` (the ids from the prefix offset on, plus new ones) adds
        after the read offset; None while it is empty or ends in an incomplete UTF-8
        sequence."""
        prefix_text = self._prefix_text
        if prefix_text is None:
            prefix_text = self._prefix_text = self._decode(window[:self.read_offset - self.prefix_offset])
        full_text = self._decode(window)
        if len(full_text) <= len(prefix_text) or full_text.endswith("\ufffd"):
            return None
        return full_text[len(prefix_text):]

    def peek(self, token_id: int) -> str:
        """The text add_token(token_id) would add now, without adding it: vLLM's
        `decoded_token` of a logprob, so that the rank-1 tokens spell the output. (Only
        the window is copied: a copy of every id so far, for each candidate of each
        token, grew with the output.)"""
        if self.tokenizer is None:
            return ""
        if self._peeks is None:
            self._peeks = {}
        new_text = self._peeks.get(token_id, _UNSET)
        if new_text is _UNSET:
            window = self.token_ids[self.prefix_offset:]
            window.append(token_id)
            new_text = self._peeks[token_id] = self._new_text(window)
        return new_text or ""

    def add_token(self, token_id: int, check_stop: bool = True) -> Optional[str]:
        """Append a token. Returns the stop string matched, if any (output_text is then cut)."""
        self.token_ids.append(token_id)
        if self.tokenizer is None:
            return None
        peeks, self._peeks = self._peeks, None
        new_text = peeks.get(token_id, _UNSET) if peeks else _UNSET
        if new_text is _UNSET:
            new_text = self._new_text(self.token_ids[self.prefix_offset:])
        if new_text is None:
            return None
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        self._prefix_text = None
        search_from = max(len(self.output_text) - self._hold, 0)
        self.output_text += new_text
        if not check_stop:
            return None
        for stop in self.params.stop:
            idx = self.output_text.find(stop, search_from)
            if idx != -1:
                end = idx + len(stop) if self.params.include_stop_str_in_output else idx
                self.output_text = self.output_text[:end]
                return stop
        return None

    def take_delta(self, finished: bool) -> str:
        """Text not yet handed out. While a stop string could still be forming at the
        end, its possible start is held back."""
        end = len(self.output_text) if finished else max(len(self.output_text) - self._hold, self._num_sent)
        delta = self.output_text[self._num_sent:end]
        self._num_sent = end
        return delta
