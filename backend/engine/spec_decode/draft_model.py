"""Draft-model proposals: a smaller model of the same tokenizer guesses the next tokens.

The draft keeps its own K/V cache tensors, but in the target's blocks: the same block
ids, block tables and slot mapping, in tensors shaped for the draft's layers. So the
KV cache manager manages both at once (allocated, preempted, freed and prefix-cached with
the target request's blocks) and nothing here tracks blocks of its own. The scheduler
reserves the slots of what the draft writes ahead when it schedules the step
(`ScheduledRequest.num_lookahead_tokens`). How far the draft's K/V reaches is the
runner's (`RequestState.num_draft_computed`, runner/request_state.py): set at admission
to the prefix-cache hits, advanced here, reset by a preemption.

The draft runs inside the runner's step (ModelRunner.collect), right after the step's
tokens come back and before they are appended, from the runner's request states plus
the step's new tokens. For the step's requests it
1. catches up: one packed forward over the tokens it has no K/V for (this step's prefill
   chunk or accepted tokens), through the newest token for the requests that propose,
   whose logits give proposal 1;
2. proposes: k - 1 more one-token forwards. Each proposal is drawn from the draft's
   distribution under the request's sampling settings (argmax for greedy requests) and
   written into the next forward's input on the device. The proposals stay on the
   device (draft_tokens.py): the step that verifies them reads them there, and the
   host learns them with that step's own copy, so drafting adds no copy to the host.
The distributions go with the proposals to the rejection sampler, which needs q.

On CUDA the draft has CUDA graphs of its own (captured by the engine after the target's,
backend/engine/runner/cuda_graphs.py), over its own step inputs: the one-token forwards replay
its decode ladder, and a catch-up of at most k + 1 tokens a row (a verification's
accepted tokens and the target's next: the steady state) its verify ladder. A catch-up
with a longer row (a prompt's chunk) runs eagerly, as do steps past both ladders.

A prefix-cache hit reuses the draft's K/V of the hit blocks too. It is whatever the
draft wrote there: right unless the request that computed the block was preempted or
aborted while its step was in flight (async scheduling). Stale draft K/V lowers the
acceptance rate, never the output's correctness.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F

from backend.config import ConfigError
from backend.engine.runner.buffers import GrowingStagedBuffer
from backend.engine.runner.cuda_graphs import DecodeGraphs, capture_decode_graphs, sampled_logits
from backend.engine.runner.model_runner import run_model
from backend.engine.runner.request_state import RequestState
from backend.engine.sampling.sampler import Sampler
from backend.engine.spec_decode.rejection_sampler import VerifyRow
from backend.engine.spec_decode.draft_tokens import DraftTokens
from backend.engine.spec_decode.proposals import Proposals
from backend.engine.runner.step_inputs import StepInputBuilder
from backend.ops.cpu_argmax import argmax_rows


def check_same_tokenizer(target_tokenizer, draft_tokenizer, target_vocab: int, draft_vocab: int) -> None:
    """The draft's proposals are token ids: they mean the same text only under one vocabulary."""
    if target_tokenizer is not None and draft_tokenizer is not None:
        if target_tokenizer.get_vocab() != draft_tokenizer.get_vocab():
            raise ConfigError("invalid engine argument 'speculative_config.model': the draft's tokenizer differs "
                              "from the target's (a draft model must share the target's vocabulary)")
    elif target_vocab != draft_vocab:
        raise ConfigError(f"invalid engine argument 'speculative_config.model': the draft's vocabulary has "
                          f"{draft_vocab} tokens, the target's {target_vocab}")


class DraftModelProposer:
    def __init__(self, model, kv_caches, block_size: int, inputs: StepInputBuilder, sampler: Sampler,
                 vocab_size: int) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.inputs = inputs
        self.sampler = sampler
        self.vocab_size = vocab_size
        self.device = kv_caches[0].key.device
        self.block_size = block_size
        self._index = GrowingStagedBuffer(torch.int64, self.device)
        # The draft's own CUDA graphs over its step inputs (capture_graphs, when graphs
        # are on): a decode ladder for the one-token forwards, a verify ladder of
        # k + 1 tokens a row for the catch-up after a verification. None: eager.
        self.graphs: Optional[DecodeGraphs] = None

    in_runner = True        # runs inside the runner's step, into slots the scheduler reserved
    reads_target_hidden = False     # (an EAGLE head reads the target's hidden states: eagle.py)
    lora = None             # (what capture_decode_graphs asks of what it captures)

    def capture_graphs(self, max_num_seqs: int, max_model_len: int, verify_query_len: int) -> None:
        """Capture the draft's own graphs (it runs on rank 0 alone: no collectives)."""
        self.graphs = capture_decode_graphs(self, max_num_seqs, max_model_len, verify_query_len,
                                            of="the draft model")

    def forget(self, request_ids) -> None:
        """Nothing is kept per request (the draft's K/V lives in the target's blocks)."""

    # Positions the draft runs behind the request's tokens when it proposes: a draft
    # model's last catch-up position holds the newest token (1); an EAGLE head's holds the
    # token before it, read with the target's state there (2: eagle.py).
    lag = 1

    tree = None             # a tree of proposals (token_tree.py; EAGLE drafts trees: eagle.py)

    @torch.inference_mode()
    def propose(self, sched, states: list[RequestState], sampled_token_ids: list[list[int]],
                target_hidden: Optional[torch.Tensor] = None,
                paths: Optional[dict[int, list[int]]] = None) -> Proposals:
        """Proposals after the step `sched` (its ScheduledRequests), whose new tokens per
        request are `sampled_token_ids` (accepted proposals and the target's next, or none
        mid-prompt): for each request with reserved lookahead slots, up to as many
        proposals as those slots and its max_tokens allow. `target_hidden`: what the
        target's forward left in `captured_hidden` for the step's rows (EAGLE). `paths`:
        a tree verification's accepted nodes, by index in the step."""
        rows = rows_after_step(sched, states, sampled_token_ids, self.block_size, paths, self.tree)
        if self.tree is not None:
            return self._propose_tree(rows, target_hidden)
        first = self._catch_up(rows, target_hidden)
        proposing = [row for row in rows if row.k > 0]
        if first is None:
            return Proposals()
        num_forwards = max(row.k for row in proposing)
        # Every index the forwards and the hand-over take, in one upload: a staging buffer
        # rewritten within the step would first wait for the device to have read it.
        keeps, places, starts_of = _layout(proposing, num_forwards)
        index = self._index.upload(np.concatenate([*keeps, *places]))
        tokens, probs = [first[0]], [first[1]]
        active, used = proposing, 0
        for j in range(1, num_forwards):
            keep, prev_tokens, kept = keeps[j - 1], tokens[-1], None
            if len(keep) < len(active):
                kept = index[used:used + len(keep)]
                prev_tokens = prev_tokens.index_select(0, kept)
            used += len(keep)
            active = [active[i] for i in keep]
            starts = np.asarray([row.num_tokens - self.lag + j for row in active], dtype=np.int64)
            ones = np.ones(len(active), np.int64)
            logits = self._forward([row.state for row in active], starts, ones, ones,
                                   lambda i, a, b: [0], prev_tokens, kept)
            t, p = self._draw(logits, [row.as_sampled for row in active])
            tokens.append(t)
            probs.append(p)
        ordered = torch.cat(tokens).index_select(0, index[used:])
        return Proposals(self._hand_over(proposing, ordered, places, starts_of, probs))

    def _catch_up(self, rows: list[_Row], target_hidden: Optional[torch.Tensor] = None):
        """The forward over what the draft lacks (each request's state then records how
        far the draft's K/V reaches): proposal 1 per proposing row and its
        distributions, or None when no row proposes."""
        segments = []
        for row in rows:
            end = row.num_tokens if row.k > 0 else row.num_computed
            if end > row.state.num_draft_computed:
                segments.append((row, row.state.num_draft_computed, end))
        if not segments:
            return None
        logits = self._forward(
            [row.state for row, _, _ in segments], np.asarray([a for _, a, _ in segments], dtype=np.int64),
            np.asarray([b - a for _, a, b in segments], dtype=np.int64),
            np.asarray([int(row.k > 0) for row, _, _ in segments], dtype=np.int64),
            lambda i, a, b: segments[i][0].token_slice(a, b))
        for row, _, end in segments:
            row.state.num_draft_computed = end
        if logits is None:
            return None
        return self._draw(logits, [row.as_sampled for row, _, _ in segments if row.k > 0])

    def _forward(self, states: list[RequestState], starts: np.ndarray, n_new: np.ndarray, num_rows: np.ndarray,
                 tokens, input_ids: Optional[torch.Tensor] = None, kept: Optional[torch.Tensor] = None,
                 trees: Optional[list] = None) -> Optional[torch.Tensor]:
        """The draft over a packed step (StepInputBuilder.build_segments' arguments, its
        sequences those of `states`, in their blocks), the
        logits of its sampled rows or None when it samples none. `input_ids`: the step's
        tokens as a device tensor (a proposal drawn by the previous forward), written
        over what `tokens` gave; `kept`: which of the previous forward's rows these are
        (None: all of them). A captured graph replays the step where one holds it (its
        rows padded to write nothing), else it runs eagerly (as a tree's levels do: `trees`,
        StepInputBuilder.build_segments')."""
        shape = self.graphs.shape_for(len(states), int(n_new.max())) \
            if self.graphs is not None and not trees else None
        step = self.inputs.build_segments([state.request_id for state in states], starts, n_new, num_rows, tokens,
                                          [state.block_ids for state in states],
                                          pad_to=shape.num_seqs if shape else None,
                                          pad_tokens_to=shape.num_tokens if shape else None, trees=trees)
        if input_ids is not None:
            step.input_ids[:len(input_ids)].copy_(input_ids)
        return self._run(step, shape)

    def _run(self, step, shape) -> Optional[torch.Tensor]:
        if shape is None:
            return run_model(self.model, self.kv_caches, step)
        logits = self.graphs.replay(shape)
        return sampled_logits(logits, shape, step) if step.num_logits else None

    def _draw(self, logits: torch.Tensor, requests: list[VerifyRow]) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        return draw_proposals(self.sampler, logits, requests, self.vocab_size)

    def _hand_over(self, proposing: list[_Row], ordered: torch.Tensor, places: list[np.ndarray],
                   starts_of: list[int], probs: list[Optional[torch.Tensor]]
                   ) -> dict[str, tuple[DraftTokens, Optional[torch.Tensor]]]:
        """The proposals by request id, left on the device (draft_tokens.py): `ordered`
        holds them in request order, and each request's are a slice of it. probs[j]:
        forward j's distributions, whose rows start at starts_of[j] in `places`' terms
        (None when forward j drew every row greedily)."""
        out, start, read = {}, 0, [None]       # (read: one host copy for all, if ever read)
        for row, own in zip(proposing, places):
            q = None
            if not row.state.sampling_params.greedy:
                # The rejection sampler's q: its row in each forward's distributions.
                q = torch.stack([probs[j][p - starts_of[j]] for j, p in enumerate(own.tolist())])
            # (the K/V of the proposals is rewritten by the next catch-up)
            out[row.state.request_id] = (DraftTokens(ordered, start, len(own), read), q)
            start += len(own)
        return out


def rows_after_step(sched, states: list[RequestState], sampled_token_ids: list[list[int]], block_size: int,
                    paths: Optional[dict[int, list[int]]] = None, tree=None) -> list["_Row"]:
    """The step's requests still running, as the step leaves them (_Row), each with the
    row of its first position in the step's packed tokens (and a tree verification's
    accepted path, from `paths` by index; with `tree`, k counts nodes). `states`: the
    step's requests' states as the runner launched it."""
    rows, step_row = [], 0
    for i, (s, state, new) in enumerate(zip(sched.scheduled, states, sampled_token_ids)):
        if state.running:           # (not finished or preempted since)
            row = _Row.after(s, state, new, len(state.block_ids) * block_size, step_row, tree)
            if paths and paths.get(i):
                row.path = paths[i]
                row.tree_root = s.num_computed_tokens + s.num_new_tokens - len(s.spec_token_ids) - 1
            rows.append(row)
        step_row += s.num_new_tokens
    return rows


def draw_proposals(sampler: Sampler, logits: torch.Tensor, requests: list[VerifyRow], vocab_size: int
                   ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Proposals from a drafter's logits under each request's sampling settings, and the
    distributions they came from (None when every request is greedy)."""
    V = vocab_size
    if all(plain_greedy(r, V) for r in requests):
        # What the sampler would draw (no processor changes these rows' logits), without
        # its per-row preparation: a fresh set of rows every forward, so never kept.
        return argmax_rows(logits[:, :V]), None
    if logits.shape[-1] < V:
        logits = F.pad(logits.float(), (0, V - logits.shape[-1]), value=float("-inf"))
    logits = logits[:, :V]
    tokens, probs = sampler.sample_with_distributions(logits, sampler.prepare(requests, V))
    if probs is None:
        return tokens, None
    # q as the rejection sampler reads it: normalised (top-p and min-p leave gaps).
    return tokens, probs / probs.sum(dim=-1, keepdim=True)


def plain_greedy(request: VerifyRow, vocab_size: int) -> bool:
    """A greedy request whose logits no token processor changes (no penalties, bad words,
    bias or min_tokens): its draw is the logits' argmax."""
    row = request.sampling_row
    return row is not None and row.vocab_size == vocab_size and row.greedy and not row.token_processors


def _layout(proposing: list["_Row"], num_forwards: int) -> tuple[list[np.ndarray], list[np.ndarray], list[int]]:
    """(for forwards 1..num_forwards-1, the rows of the previous forward that go on: those
    with more than j proposals; for each proposing row, the places of its proposals in
    the forwards' concatenated output, forward by forward; where each forward's rows
    start in that output)."""
    keeps, places, starts_of = [], [[] for _ in proposing], []
    active = list(range(len(proposing)))
    offset = 0
    for j in range(num_forwards):
        starts_of.append(offset)
        for n, i in enumerate(active):
            places[i].append(offset + n)
        offset += len(active)
        if j + 1 < num_forwards:
            keep = [n for n, i in enumerate(active) if proposing[i].k > j + 1]
            keeps.append(np.asarray(keep, dtype=np.int64))
            active = [active[n] for n in keep]
    return keeps, [np.asarray(p, dtype=np.int64) for p in places], starts_of


@dataclass
class _Row:
    """A scheduled request as the step leaves it, before its new tokens are appended:
    its tokens are the state's plus `new`."""
    state: RequestState
    new: list[int]
    num_tokens: int             # after the step
    num_computed: int           # tokens with the target's K/V after the step
    k: int                      # proposals to make (0: catch up only)
    step_start: int = 0         # the step's first position (its num_computed_tokens)
    step_row: int = 0           # the row of that position in the step's packed tokens
    # A tree verification's accepted nodes and its root's position: the accepted tokens'
    # rows in the step are their nodes' (hidden_rows).
    path: Optional[list[int]] = None
    tree_root: int = -1

    def hidden_rows(self, a: int, b: int) -> np.ndarray:
        """The step's packed rows of positions a..b-1 (what the target's forward computed
        for them: its hidden states)."""
        positions = np.arange(a, b, dtype=np.int64)
        rows = self.step_row + positions - self.step_start
        if self.path:
            after = positions > self.tree_root
            nodes = np.asarray(self.path, dtype=np.int64)[positions[after] - self.tree_root - 1]
            rows[after] = self.step_row + self.tree_root - self.step_start + 1 + nodes
        return rows

    @classmethod
    def after(cls, s, state: RequestState, new: list[int], held_slots: int, step_row: int = 0, tree=None) -> "_Row":
        """`held_slots`: the slots the request's blocks hold now. With async scheduling
        the next step's schedule may have taken back proposal-only blocks since this step
        was scheduled (Scheduler._reclaim_proposal_blocks): the draft writes only into
        slots still held."""
        rejected = s.rejected_among(new)      # (the scheduler records it when it applies the step)
        num_tokens = state.num_tokens + len(new)
        k = 0
        if new and s.num_lookahead_tokens:
            # Room for k proposals and the target's own token within max_tokens; the
            # newest token and proposals 1..k-1 written at num_tokens - 1 onwards.
            room = state.max_tokens - state.num_output_tokens - len(new) - 1
            # (a tree: its nodes within that depth; they and the newest token take as many slots)
            k = min(s.num_lookahead_tokens, tree.nodes_within(room) if tree is not None else room,
                    held_slots - num_tokens + 1)
        return cls(state, new, num_tokens, s.num_computed_tokens + s.num_new_tokens - rejected, max(k, 0),
                   s.num_computed_tokens, step_row)

    @property
    def as_sampled(self) -> VerifyRow:
        """The request as the draft's sampler sees it: the step's new tokens count as
        output (penalties, min_tokens, bad words), as they will once applied."""
        return VerifyRow(self.state, self.new)

    def token_slice(self, a: int, b: int) -> list[int]:
        n = self.state.num_tokens
        if b <= n:
            return self.state.token_slice(a, b)
        return self.state.token_slice(a, n) + self.new[max(a - n, 0):b - n] if a < n else self.new[a - n:b - n]


def load_draft(path: str, target_vocab: int, target_tokenizer, dtype: torch.dtype, device: torch.device,
               attention_backend: str, max_position: int):
    """(the draft model, its ModelConfig), after checking that it speaks the target's
    vocabulary. Errors name speculative_config.model."""
    from backend.attention import make_attention_factory
    from backend.models.config import load_model_config
    from backend.models.loader import load_model, load_tokenizer
    from backend.ops import make_layer_ops
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ConfigError(f"invalid engine argument 'speculative_config.model': no checkpoint (config.json) "
                          f"in '{path}'")
    cfg = load_model_config(path)
    check_same_tokenizer(target_tokenizer, load_tokenizer(path), target_vocab, cfg.vocab_size)
    model = load_model(path, cfg, dtype, device, make_attention_factory(attention_backend),
                       max(max_position, cfg.max_position_embeddings), make_layer_ops(attention_backend))
    return model, cfg
