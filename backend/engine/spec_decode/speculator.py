"""Which requests speculate each step, how far, and how it went.

A running request speculates when it is decoding (its prompt is done), did not switch
it off (`speculative_decoding: false`), and asks for nothing speculation cannot give:
a grammar (each proposal would need the matcher advanced) or logprobs. It proposes at
most num_speculative_tokens, and never more than its remaining max_tokens leave room for
(the accepted tokens plus the target's own one).

Counters follow vLLM's spec-decode metrics: drafts (verifications with at least one
proposal), draft tokens proposed and accepted; the acceptance rate is accepted / draft
tokens and the mean acceptance length 1 + accepted / drafts (tokens per verification,
the target's own one included).
"""

from __future__ import annotations

from typing import Iterable

from backend.config import SpeculativeConfig
from backend.engine.request import Request
from backend.engine.spec_decode.proposals import Proposals


class Speculator:
    def __init__(self, config: SpeculativeConfig, proposer) -> None:
        self.config = config
        self.proposer = proposer
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        # vLLM's per-position acceptance: [i] counts verifications whose proposal i + 1
        # was accepted (so the counts fall with i).
        self.num_accepted_tokens_per_pos = [0] * config.num_speculative_tokens

    @staticmethod
    def can_speculate(request: Request) -> bool:
        p = request.sampling_params
        return p.speculative_decoding and request.grammar is None and p.logprobs is None

    @property
    def in_runner(self) -> bool:
        """A draft model proposes inside the runner's step (ModelRunner.drafter), into
        slots the scheduler reserved when scheduling it; a lookup proposes after the
        scheduler applied the step (`propose`)."""
        return self.proposer.in_runner

    def eligible(self, running: list[Request]) -> list[tuple[Request, int]]:
        """The running requests that speculate next step, each with how many proposals."""
        eligible = []
        for r in running:
            if r.num_computed_tokens != r.num_tokens - 1 or not self.can_speculate(r):
                continue
            k = min(self.config.num_speculative_tokens, r.max_tokens - r.num_output_tokens - 1)
            if k > 0:
                eligible.append((r, k))
        return eligible

    def propose(self, running: list[Request], eligible: list[tuple[Request, int]]) -> Proposals:
        """A lookup's proposals for the next step of `eligible`, from their tokens after
        the step. Nothing here changes a request: the scheduler applies the result."""
        return self.proposer.propose(running, eligible)

    def forget(self, request_ids: Iterable[str]) -> None:
        """These requests ended: the proposer drops what it keeps for them (a long
        request's n-gram index holds megabytes)."""
        self.proposer.forget(request_ids)

    def record(self, scheduled: Iterable) -> None:
        for s in scheduled:
            if s.spec_token_ids:
                self.num_drafts += 1
                self.num_draft_tokens += len(s.spec_token_ids)
                accepted = len(s.spec_token_ids) - s.num_rejected
                self.num_accepted_tokens += accepted
                for i in range(accepted):
                    self.num_accepted_tokens_per_pos[i] += 1

    def stats(self) -> dict[str, float]:
        return {
            "spec_decode_num_drafts": self.num_drafts,
            "spec_decode_num_draft_tokens": self.num_draft_tokens,
            "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
            "spec_decode_num_accepted_tokens_per_pos": list(self.num_accepted_tokens_per_pos),
            "spec_decode_acceptance_rate": self.num_accepted_tokens / self.num_draft_tokens
            if self.num_draft_tokens else 0.0,
            "spec_decode_mean_acceptance_length": 1.0 + self.num_accepted_tokens / self.num_drafts
            if self.num_drafts else 0.0,
        }


def make_proposer(config: SpeculativeConfig, draft, block_size: int, kv_layers, inputs, sampler, vocab_size: int):
    """The proposer the config names; `draft` is what load_drafter returned."""
    if config.method == "ngram":
        from backend.engine.spec_decode.ngram import NgramProposer
        return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    if config.method == "medusa":
        from backend.engine.spec_decode.medusa import MedusaProposer
        return MedusaProposer(draft[0], block_size, sampler, vocab_size, inputs.table_device.device, config.token_tree)
    if config.method in ("eagle", "eagle3"):
        from backend.engine.spec_decode.eagle import EagleProposer
        return EagleProposer(draft[0], kv_layers, block_size, inputs, sampler, vocab_size, config.token_tree)
    from backend.engine.spec_decode.draft_model import DraftModelProposer
    return DraftModelProposer(draft[0], kv_layers, block_size, inputs, sampler, vocab_size)


def load_drafter(config: SpeculativeConfig, target, stage, tokenizer, vocab_size: int, dtype, device,
                 attention_backend: str, max_position: int):
    """The drafter network the config names and the config of its K/V in the target's
    blocks: (draft model, its ModelConfig), (EAGLE head, its layers' ModelConfig), or
    (Medusa heads, None); None for n-gram lookup. A head reads the target's hidden states,
    so it needs the torch model on one rank. Errors name the engine argument."""
    if config.method == "ngram":
        return None
    if config.method == "draft_model":
        from backend.engine.spec_decode.draft_model import load_draft
        return load_draft(config.model, vocab_size, tokenizer, dtype, device, attention_backend, max_position)
    from backend.config import ConfigError
    from backend.models.draft_heads import HeadConfigError
    if target is None or stage is not None:
        raise ConfigError(f"invalid engine argument 'speculative_config.method': '{config.method}' needs the torch "
                          "model on one rank (model_runner 'torch', no pipeline parallelism)")
    try:
        if config.method == "medusa":
            from backend.engine.spec_decode.medusa import load_medusa
            return load_medusa(config, target, dtype, device), None
        from backend.engine.spec_decode.eagle import load_eagle
        return load_eagle(config.method, config.model, target, dtype, device, attention_backend, max_position)
    except (HeadConfigError, OSError) as e:
        raise ConfigError(f"invalid engine argument 'speculative_config.model': {e}") from None
