"""bad_words (vLLM's; TensorRT-LLM's bad_words_list as `bad_words_token_ids`): the last
token of a banned sequence cannot be drawn where the output ends with the rest of it.
The words are resolved at intake (backend/engine/sampling/bad_words.py) from the same
params that turn this processor on, so a state carries them exactly when is_on holds;
each step reads only the words' own tokens, never the context."""

from __future__ import annotations

from backend.engine.sampling.logits_processors.min_tokens import BannedTokens


class BadWordsBan(BannedTokens):
    name = "bad_words"

    @classmethod
    def is_on(cls, row, params) -> bool:
        return bool(params.bad_words or params.bad_words_token_ids)

    def add_row(self, i: int, state, row) -> None:
        if state.bad_words is not None:
            self.ban(i, state.bad_words.banned(state))
