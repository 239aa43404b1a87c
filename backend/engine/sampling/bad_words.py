"""Bad words (vLLM's `bad_words`, TensorRT-LLM's `bad_words` / `bad_words_list`): token
sequences a request must never generate.

Request side, once per request (`resolve`, from RequestIntake.prepare: on the adding
thread under EngineLoop): each word is tokenized as vLLM does it, without and with a
leading space (so that a word is banned at the start of the text and after a space),
the spaced form kept when it starts with another token
(see tokenize_words); ids given as ids (TensorRT-LLM's `bad_words_list`, our
`bad_words_token_ids`) are taken as they are. The result, a `BadWords`, rides on the
Request.

Step side (`BadWords.banned`, from Sampler.prepare): a one-token word's id is banned at
every step; a longer word's last token is banned when the request's last generated
tokens equal the rest of the word. As in vLLM, only generated tokens count (a prefix in
the prompt bans nothing), and on a verification row the proposals before it count as
generated. The cost is the words' own tokens, never the context: the sampler reads the
last `longest_prefix` tokens of the output. The banned ids become -inf logits in the
sampler's one batched pass, with min_tokens' bans.

Limits as vLLM's (MAX_NUM_BAD_WORDS sequences after tokenization, MAX_BAD_WORDS_TOTAL_TOKENS
ids in all); a request over them, or with a word that tokenizes to nothing or an id
outside the vocabulary, is refused with an error naming the field.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from backend.engine.errors import InvalidRequestError, check_token_ids
# MAX_NUM_BAD_WORDS: token sequences per request after tokenization (SamplingParams
# checks the words, and their characters, before).
from backend.sampling_params import MAX_NUM_BAD_WORDS, SamplingParams

MAX_BAD_WORDS_TOTAL_TOKENS = 1024   # ids of all the sequences together


@dataclass(frozen=True)
class BadWords:
    """A request's banned sequences, split for the step: single ids banned always, and
    (prefix, last id) pairs banned when the output ends with the prefix."""
    always: tuple[int, ...]
    prefixed: tuple[tuple[tuple[int, ...], int], ...]
    longest_prefix: int

    @classmethod
    def from_sequences(cls, sequences: Sequence[Sequence[int]]) -> "BadWords":
        always = tuple(sorted({s[0] for s in sequences if len(s) == 1}))
        prefixed = tuple(dict.fromkeys((tuple(s[:-1]), s[-1]) for s in sequences if len(s) > 1))
        return cls(always, prefixed, max((len(p) for p, _ in prefixed), default=0))

    def banned(self, row) -> list[int]:
        """The ids banned for a sampler row: a request's state, or a verification row (its
        `verified_request` plus the `proposed` tokens before it)."""
        if not self.prefixed:
            return list(self.always)
        tail = row.output_tail(self.longest_prefix)
        n = len(tail)
        out = list(self.always)
        for prefix, last in self.prefixed:
            k = len(prefix)
            if k <= n and tuple(tail[n - k:]) == prefix:
                out.append(last)
        return out


def tokenize_words(words: Sequence[str], encode) -> list[list[int]]:
    """vLLM's tokenization of bad words: each (its leading spaces stripped) without a
    leading space, then with one when that starts with another token. `encode(text)` ->
    ids without special tokens.

    vLLM also drops the spaced form when its length differs, so that with a BPE
    tokenizer where "language" is two tokens and " language" one, " language" is not
    banned (vLLM issue 32557, fixes proposed in its pull requests 23889, 32601, 37676);
    here it is banned, as those fixes do."""
    sequences: list[list[int]] = []
    for i, word in enumerate(words):
        bare = word.lstrip()
        plain = encode(bare)
        if not plain:
            raise InvalidRequestError(f"sampling parameter 'bad_words': word {i} ({word!r}) tokenizes to no tokens")
        sequences.append(plain)
        spaced = encode(" " + bare)
        if spaced and spaced[0] != plain[0]:
            sequences.append(spaced)
        if len(sequences) > MAX_NUM_BAD_WORDS:
            raise InvalidRequestError(
                f"sampling parameter 'bad_words' has too many words: more than {MAX_NUM_BAD_WORDS} token sequences "
                "after tokenization (each word counts once, or twice when its spaced form is another token)")
    return sequences


def resolve(params: SamplingParams, tokenizer, vocab_size: int) -> Optional[BadWords]:
    """The request's bad words as token sequences, checked; None when it has none."""
    sequences: list[list[int]] = []
    if params.bad_words:
        if tokenizer is None:
            raise InvalidRequestError("sampling parameter 'bad_words' needs the checkpoint's tokenizer, and this one "
                                      "has no tokenizer files: send the words as ids (bad_words_token_ids)")
        sequences += tokenize_words(params.bad_words, lambda text: tokenizer.encode(text, add_special_tokens=False))
    if params.bad_words_token_ids:
        sequences += params.bad_words_token_ids
    # (bad_words_token_ids is what tensorrt_llm's input bad_words_list arrives as)
    name = "'bad_words'" if params.bad_words else "'bad_words_token_ids' (tensorrt_llm's bad_words_list)"
    if not sequences:
        return None
    if len(sequences) > MAX_NUM_BAD_WORDS:
        raise InvalidRequestError(f"sampling parameter {name} has {len(sequences)} token sequences, more "
                                  f"than {MAX_NUM_BAD_WORDS}")
    total = sum(len(s) for s in sequences)
    if total > MAX_BAD_WORDS_TOTAL_TOKENS:
        raise InvalidRequestError(f"sampling parameter {name} has {total} tokens in all, more than "
                                  f"{MAX_BAD_WORDS_TOTAL_TOKENS}")
    check_token_ids((t for s in sequences for t in s), vocab_size, f"sampling parameter {name}")
    return BadWords.from_sequences(sequences)
