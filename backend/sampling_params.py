"""Per-request sampling parameters (vLLM's names and meanings)."""

from __future__ import annotations

import json
import math
from typing import Optional, Union

from pydantic import BaseModel, ConfigDict, Field, create_model, field_validator, model_validator
from typing_extensions import Self      # (typing's from Python 3.11; the project runs on 3.10 too)

from backend.config import validated
from backend.engine.sampling.logits_processors import request_fields


# Bad words limits (vLLM's; backend/engine/sampling/bad_words.py checks the tokenized words).
MAX_NUM_BAD_WORDS = 128
MAX_BAD_WORDS_TOTAL_CHARS = 16 * 1024

GREEDY_BELOW = 1e-5      # temperatures below this sample greedily (vLLM's _SAMPLING_EPS)
GUIDED_FIELDS = ("guided_json", "guided_json_object", "guided_regex", "guided_choice", "guided_grammar")


def json_object(text: str) -> dict:
    """A JSON object given as text (vLLM's backend takes nested values either way)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"not valid JSON: {e.msg} (column {e.colno})") from None
    except RecursionError:              # json recurses per level: ~1000 levels overflow it
        raise ValueError("nests too deeply to be read") from None
    if not isinstance(value, dict):
        raise ValueError("must be a JSON object")
    return value


class SamplingParamsError(ValueError):
    """Bad sampling parameters; the message names the field."""


class _CoreSamplingParams(BaseModel):
    """The parameters the engine handles itself; SamplingParams adds the logits
    processors' (backend/engine/logits_processors: min_p, ...)."""
    model_config = ConfigDict(extra="forbid")

    # Sequences to generate for the prompt (vLLM's `n`). The engine runs one sequence
    # per request: a caller fans n > 1 out (backend.engine.parallel_sampling). At most
    # the engine's max_n (backend/engine/request_limits.py checks every engine limit).
    n: int = Field(1, ge=1)
    max_tokens: Optional[int] = Field(16, ge=1)
    min_tokens: int = Field(0, ge=0)
    temperature: float = Field(1.0, ge=0.0)
    top_k: int = Field(-1, ge=-1)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: Optional[int] = Field(None, ge=-2**63, le=2**63 - 1)     # int64, as torch's generators take
    # Logits are divided or multiplied by it in float32: outside this range they overflow
    # (or the penalty rounds to 0), and NaN logits would slip past top-k, top-p and grammars.
    repetition_penalty: float = Field(1.0, ge=1e-30, le=1e30)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    stop: list[str] = Field(default_factory=list)
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # Log probabilities of each generated token and of this many most likely ones (vLLM's
    # name; 0: the generated token's only). None: none are computed. At most the
    # engine's max_logprobs.
    logprobs: Optional[int] = Field(None, ge=0)
    # Log probabilities of each prompt token given the tokens before it, with this many
    # most likely tokens at each position (vLLM's name and meaning; 0: the prompt token's
    # only). None: none are computed. At most the engine's max_logprobs. A request that
    # asks computes its prompt in full (no prefix-cache hits for those positions).
    prompt_logprobs: Optional[int] = Field(None, ge=0)
    # Added to the token's logit before sampling (OpenAI's logit_bias: -100..100).
    logit_bias: Optional[dict[int, float]] = None
    # Words never generated (vLLM's bad_words): each tokenized without and with a leading
    # space; a one-token word is banned always, a longer one's last token when the output
    # ends with the rest of it (backend/engine/sampling/bad_words.py).
    bad_words: Optional[list[str]] = None
    # The same as token id sequences, used as they are: TensorRT-LLM's bad_words_list
    # (vLLM computes this list from bad_words and does not take it as input).
    bad_words_token_ids: Optional[list[list[int]]] = None
    # Structured output (vLLM's guided decoding; at most one): the output follows a JSON
    # schema, any JSON object, a regular expression, one of the given strings, or an
    # EBNF grammar (xgrammar's GBNF dialect). Enforced by a token mask in the sampler
    # (backend/engine/structured_output/grammar.py).
    guided_json: Optional[Union[dict, str]] = None
    guided_json_object: bool = False
    guided_regex: Optional[str] = None
    guided_choice: Optional[list[str]] = None
    guided_grammar: Optional[str] = None
    # With structured output: the token ids that end a reasoning block (e.g. </think>).
    # The grammar applies only after the output holds them, so the reasoning is free and
    # the answer is shaped, as vLLM does with a reasoning parser. The OpenAI frontend sets
    # it when its --reasoning-parser is on and the reply reasons.
    reasoning_end_token_ids: Optional[list[int]] = None
    # With the engine's speculative_config: false verifies no proposed tokens for this
    # request (it decodes one token per step). Guided and logprobs requests never speculate.
    speculative_decoding: bool = True
    # Multi-LoRA: the adapter (a name from the engine's lora_modules) this request runs
    # under; None: the base model. In `sampling_parameters`, as Triton's vLLM backend takes it.
    lora_name: Optional[str] = None
    # With the engine's scheduling_policy "priority": this request's rank, lower first
    # (vLLM's `priority`, which its offline API takes beside the sampling parameters:
    # LLM.generate does too). Must be 0 under "fcfs".
    priority: int = Field(0, ge=-2**31, le=2**31 - 1)
    # A deadline for this request, seconds from arrival: unfinished then, it is aborted
    # with an error. At most the engine's request_timeout_s when it has one.
    request_timeout_s: Optional[float] = Field(None, gt=0.0)
    # Prefill/decode disaggregation (vLLM's `kv_transfer_params`): {"do_remote_decode":
    # true} keeps the prompt's blocks for a decode engine when the request finishes, and
    # its final output says where they are (backend/engine/scheduling/kv_handoff.py).
    kv_transfer_params: Optional[dict] = None

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_list(cls, v: Union[None, str, list]) -> list:
        if v is None:
            return []
        if isinstance(v, str):
            return [v]
        return v

    @field_validator("stop")
    @classmethod
    def _stop_nonempty(cls, v: list[str]) -> list[str]:
        if any(s == "" for s in v):
            raise ValueError("stop strings must not be empty")
        return v

    @field_validator("temperature", "top_p", "repetition_penalty",
                     "presence_penalty", "frequency_penalty", "request_timeout_s")
    @classmethod
    def _finite(cls, v: Optional[float]) -> Optional[float]:
        if v is not None and not math.isfinite(v):
            raise ValueError("must be a finite number")
        return v

    @field_validator("temperature")
    @classmethod
    def _tiny_temperature_is_greedy(cls, v: float) -> float:
        # vLLM's rule (_SAMPLING_EPS): a float32 division by a tinier temperature overflows
        # to inf, and the softmax of that is NaN. The draw it approaches is the argmax.
        return 0.0 if v < GREEDY_BELOW else v

    @field_validator("guided_json")
    @classmethod
    def _schema_is_json(cls, v: Union[None, dict, str]) -> Union[None, dict, str]:
        return json_object(v) if isinstance(v, str) else v

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v: Optional[dict[int, float]]) -> Optional[dict[int, float]]:
        if v and any(not -100.0 <= b <= 100.0 for b in v.values()):
            raise ValueError("biases must be within [-100, 100]")
        return v or None

    @field_validator("bad_words")
    @classmethod
    def _bad_words(cls, v: Optional[list[str]]) -> Optional[list[str]]:
        if v is None:
            return None
        if len(v) > MAX_NUM_BAD_WORDS:
            raise ValueError(f"has {len(v)} words, more than {MAX_NUM_BAD_WORDS}")
        if any(not w.strip() for w in v):
            raise ValueError("words must be non-empty strings (not only spaces)")
        try:
            [w.encode("utf-8") for w in v]      # what a tokenizer can take: no lone surrogates
        except UnicodeEncodeError:
            raise ValueError("words must be valid Unicode text (a lone surrogate is not)") from None
        if sum(len(w) for w in v) > MAX_BAD_WORDS_TOTAL_CHARS:
            raise ValueError(f"has more than {MAX_BAD_WORDS_TOTAL_CHARS} characters in all")
        return v or None

    @field_validator("bad_words_token_ids")
    @classmethod
    def _bad_word_ids(cls, v: Optional[list[list[int]]]) -> Optional[list[list[int]]]:
        if v is None:
            return None
        if len(v) > MAX_NUM_BAD_WORDS:
            raise ValueError(f"has {len(v)} sequences, more than {MAX_NUM_BAD_WORDS}")
        if any(not s for s in v) or any(t < 0 for s in v for t in s):
            raise ValueError("must be non-empty lists of token ids (>= 0)")
        return v or None

    @field_validator("guided_choice")
    @classmethod
    def _choices(cls, v: Optional[list[str]]) -> Optional[list[str]]:
        if v is not None and (not v or any(c == "" for c in v)):
            raise ValueError("needs at least one choice, none of them empty")
        return v

    @field_validator("reasoning_end_token_ids")
    @classmethod
    def _end_ids(cls, v: Optional[list[int]]) -> Optional[list[int]]:
        if v is not None and (not v or any(t < 0 for t in v)):
            raise ValueError("needs at least one token id, none negative")
        return v

    @model_validator(mode="after")
    def _check(self) -> Self:
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        guided = self.guided_fields()
        if len(guided) > 1:
            raise ValueError(f"at most one of {', '.join(guided)} may be set")
        if guided and self.min_tokens:
            raise ValueError(f"min_tokens cannot be combined with {guided[0]}: the grammar decides where the output ends")
        return self

    def guided_fields(self) -> list[str]:
        """The structured-output fields this request sets (0 or 1 once validated)."""
        return [name for name in GUIDED_FIELDS if getattr(self, name) not in (None, False)]

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @classmethod
    def create(cls, **kwargs) -> Self:
        return validated(cls, SamplingParamsError, "sampling parameter", **kwargs)


# Each registered logits processor's parameter is a field too, validated like the rest.
SamplingParams = create_model("SamplingParams", __base__=_CoreSamplingParams, __module__=__name__,
                              **request_fields())
