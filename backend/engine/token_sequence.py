"""What the scheduler's `Request` and the runner's `RequestState` both read of a request's
tokens: a prompt and the output after it, as one sequence, without building the
concatenation where a slice will do."""

from __future__ import annotations


class TokenSequence:
    """Mixed into a class with `prompt_token_ids` and `output_token_ids` lists."""
    prompt_token_ids: list[int]
    output_token_ids: list[int]

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def token_slice(self, a: int, b: int) -> list[int]:
        """Tokens a:b of prompt + output, without building the concatenation (whose cost
        grows with the context: step inputs and block hashes need a block's worth)."""
        prompt, output = self.prompt_token_ids, self.output_token_ids
        p = len(prompt)
        if b <= p:
            return prompt[a:b]
        if a >= p:
            return output[a - p:b - p]
        return prompt[a:] + output[:b - p]

    def output_tail(self, k: int) -> list[int]:
        """The last k generated tokens (fewer when there are fewer)."""
        out = self.output_token_ids
        return out[max(0, len(out) - k):]
