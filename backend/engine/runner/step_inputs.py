"""A scheduled step as the model's packed-token inputs, built on the host with numpy and
sent to the device in one copy.

All integer inputs live in one int32 staging buffer at fixed offsets (capacities set
once from the engine limits):

    input_ids [T] | positions [T] | slot_mapping [T] | logits_indices [T] |
    query_start_loc [B + 1] | seq_lens [B] | row_slots [B] | table_updates [2 B M]

so the upload is a single copy of a prefix of that buffer (the block-table updates in
use come last), and every input is a view at an address that never changes, which is what
a captured CUDA graph reads. Per-token work (positions, slots) is numpy over arrays;
Python loops run once per request, not per token.

Block tables persist across steps (PersistentBlockTables): each request keeps a row (its
slot) of a device table [B + 1, M] for as long as it holds blocks, and a step sends only
the block ids its requests gained since the last step (or a whole row for a request new
to the table or re-admitted), as flat (index, id) pairs that one index_put writes into
the table. The step's own block tables [B, M] (fixed address, what kernels and graphs
read) are then gathered from the table by `row_slots` on the device; a step whose rows and
tables did not change skips even that. Host work per step is O(batch + new blocks), not
O(context).

Padding (for a CUDA graph of a larger batch) adds rows that write nothing (slot -1) and
belong to empty sequences (query length 0, sequence length 0, the all-zero table row 0);
for a verify graph (query_len tokens per row) the tokens are padded to num_seqs x
query_len the same way.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from typing import Callable, NamedTuple, Optional, Sequence

import numpy as np
import torch

from backend.attention.metadata import AttentionMetadata
from backend.engine.runner import image_attention, mrope
from backend.engine.runner.buffers import GrowingStagedBuffer, StagedBuffer
from backend.engine.runner.persistent_block_tables import PersistentBlockTables
from backend.engine.runner.request_state import RequestState
from backend.engine.scheduling.sched_output import SchedulerOutput
from backend.engine.spec_decode.draft_tokens import DraftTokens
from backend.engine.spec_decode.token_tree import TokenTree, step_tree_rows


class GraphShape(NamedTuple):
    """A captured graph: rows, and tokens per row (1 for decode, k + 1 for verify)."""
    num_seqs: int
    query_len: int = 1

    @property
    def num_tokens(self) -> int:
        return self.num_seqs * self.query_len


@dataclass
class StepInputs:
    input_ids: torch.Tensor                 # int32 [T]
    positions: torch.Tensor                 # int32 [T]
    meta: AttentionMetadata
    logits_indices: torch.Tensor            # int32 [R]: packed rows whose logits are sampled,
                                            # then the rows of prompt logprobs, if any
    num_logits: int                         # R, 0 when only mid-prompt chunks ran and none asked
    all_rows_sampled: bool                  # logits_indices == arange(T): no gather needed
    num_tokens: int                         # T before padding
    num_seqs: int                           # B before padding
    # Host copy of logits_indices[:num_logits], so the CPU's sharded forward
    # (cpu_shards.py) can plan without reading the device's.
    logits_indices_cpu: Optional[np.ndarray] = None
    # Async scheduling: (index into input_ids, request id) of each token sampled by the
    # step still in flight; its id is 0 here and comes from that step on the device.
    placeholders: list[tuple[int, str]] = field(default_factory=list)
    # A draft model's proposals verified in this step, left on the device by the draft:
    # (index into input_ids of the first, the proposals); their ids are 0 here.
    proposals: list[tuple[int, DraftTokens]] = field(default_factory=list)
    # M-RoPE models: the step's [3, T] positions when it holds prompt tokens of a
    # request with images (mrope.py); the runner sends them with the image rows.
    mrope_positions: Optional[np.ndarray] = None
    # What the model's forward takes beside the packed inputs (vision-language models:
    # mm_embeds, mrope_positions; set by the runner); empty for text-only steps.
    model_kwargs: dict = field(default_factory=dict)


class StepInputBuilder:
    def __init__(self, max_num_tokens: int, max_num_seqs: int, max_blocks_per_seq: int, block_size: int,
                 device: torch.device, staging_slots: int = 1, long_rope: Optional[tuple[int, int]] = None,
                 mrope: bool = False, image_attention: bool = False, tree: Optional[TokenTree] = None) -> None:
        """staging_slots: host buffers used in turn (buffers.py), for a builder that builds
        several forwards a step (the draft model's). long_rope (LongRoPE models):
        (original_max_position_embeddings, the table's long-mode offset). tree: the
        speculative tree (token_tree.py) whose nodes a verification holds, or None."""
        self.T, self.B, self.M = max_num_tokens, max_num_seqs, max_blocks_per_seq
        self.block_size = block_size
        off, sizes = {}, [("input_ids", self.T), ("positions", self.T), ("slot_mapping", self.T),
                          ("logits_indices", self.T), ("query_start_loc", self.B + 1), ("seq_lens", self.B),
                          ("row_slots", self.B), ("table_updates", 2 * self.B * self.M)]
        pos = 0
        for name, n in sizes:
            off[name] = pos
            pos += n
        self.offsets = off
        self.buffer = StagedBuffer(pos, torch.int32, device, staging_slots)
        # The device table and its host side (each rank keeps its own: built from its
        # own request states, backend/parallel/rank.py).
        self.tables = PersistentBlockTables(self.B, self.M)
        self.table_device = torch.zeros(self.B + 1, self.M, dtype=torch.int32, device=device)
        # The step's block tables, gathered from the table: fixed address.
        self.step_tables = torch.zeros(self.B, self.M, dtype=torch.int32, device=device)
        self._gathered: Optional[np.ndarray] = None    # the row slots step_tables holds
        self.num_table_updates = 0
        self._built = (0, 0, 0, 1)                  # the last build's tokens, rows, logits rows, table width
        # LongRoPE (backend/models/rotary.py): (original_max_position_embeddings, offset of
        # the long rows in the rotary table), or None.
        self.long_rope = long_rope
        self.mrope = mrope          # (Qwen2-VL: runner/mrope.py)
        self.image_attention = image_attention      # (Gemma 3: runner/image_attention.py)
        self.tree = tree
        self._tree_rows = GrowingStagedBuffer(torch.int64, device, slots=staging_slots)   # (pinned: no sync)
        self.device = device

    def _host(self, name: str, n: int) -> np.ndarray:
        o = self.offsets[name]
        return self.buffer.writable()[o:o + n]

    def device_view(self, name: str, n: int) -> torch.Tensor:
        o = self.offsets[name]
        return self.buffer.device[o:o + n]

    def block_tables_view(self, rows: int, cols: int) -> torch.Tensor:
        """[rows, cols] view with row stride M (kernels take the stride)."""
        return self.step_tables[:rows, :cols]

    def build(self, out: SchedulerOutput, states: Sequence[RequestState],
              pad_to: Optional[GraphShape] = None) -> StepInputs:
        """The scheduled step: each request's new tokens from its computed ones, its
        proposed tokens last; logits for the last token of each request whose prompt is
        complete, and for each proposed token (the target scores them all). `states`:
        the scheduled requests' states (request_state.py), their block tables those of
        this step; a token past what a state holds is a placeholder, sampled by the step
        in flight."""
        sched = out.scheduled
        B = len(sched)
        starts = np.fromiter((s.num_computed_tokens for s in sched), dtype=np.int64, count=B)
        n_new = np.fromiter((s.num_new_tokens for s in sched), dtype=np.int64, count=B)
        rows = np.fromiter(((1 + len(s.spec_token_ids)) if s.completes_prompt else 0 for s in sched),
                           dtype=np.int64, count=B)
        placeholders: list[tuple[int, int]] = []       # (request index, its position)
        proposals: list[tuple[int, int, DraftTokens]] = []     # (request index, first position, tokens)

        def tokens(i: int, a: int, b: int) -> list[int]:
            r = states[i]
            n = r.num_tokens
            if b <= n:
                return r.token_slice(a, b)
            known = r.token_slice(a, n) if a < n else []
            spec = sched[i].spec_token_ids
            if isinstance(spec, DraftTokens):       # on the device: written there (ModelRunner.launch)
                proposals.append((i, n, spec[:b - n]))
                return known + [0] * min(len(spec), b - n)
            if spec:
                return known + spec[:b - n]
            placeholders.extend((i, p) for p in range(max(a, n), b))
            return known + [0] * (b - max(a, n))

        # Prompt logprobs: the positions the scheduler gave each request, as rows of the
        # packed step (after every sampled row: the sampler reads the first ones).
        extra = [(i, np.arange(s.num_prompt_logprob_rows) + (s.prompt_logprob_start - s.num_computed_tokens))
                 for i, s in enumerate(sched) if s.num_prompt_logprob_rows]
        long_rope = None
        if self.long_rope is not None:
            long_rope = np.fromiter((state.long_rope for state in states), dtype=bool, count=B)
        deltas = mrope.deltas(sched, states) if self.mrope else None
        # A verification of a tree: its proposals are the tree's first nodes, after the root.
        trees = [(i, int(starts[i] + n_new[i]) - len(s.spec_token_ids), self.tree.prefix(len(s.spec_token_ids)))
                 for i, s in enumerate(sched) if s.spec_token_ids and s.completes_prompt] if self.tree else None
        step = self.build_segments([s.request_id for s in sched], starts, n_new, rows, tokens,
                                   [state.block_ids for state in states], pad_to.num_seqs if pad_to else None,
                                   long_rope,
                                   extra_rows=extra or None, pad_tokens_to=pad_to.num_tokens if pad_to else None,
                                   mrope_deltas=deltas, trees=trees or None)
        if deltas is not None:
            step.mrope_positions = mrope.table(sched, states, int(step.input_ids.shape[0]))
        limits = (image_attention.key_limits(sched, states, int(step.input_ids.shape[0]))
                  if self.image_attention else None)
        if limits is not None:
            step.meta.key_limits = torch.from_numpy(limits).to(self.device)
        if placeholders or proposals:
            first = np.cumsum(n_new) - n_new
            step.placeholders = [(int(first[i] + p - starts[i]), sched[i].request_id)
                                 for i, p in placeholders]
            step.proposals = [(int(first[i] + p - starts[i]), spec) for i, p, spec in proposals]
        return step

    def build_segments(self, request_ids: list[str], start: np.ndarray, n_new: np.ndarray, num_rows: np.ndarray,
                       tokens: Callable[[int, int, int], list[int]], block_tables: Sequence[list[int]],
                       pad_to: Optional[int] = None, long_rope: Optional[np.ndarray] = None,
                       extra_rows: Optional[list[tuple[int, np.ndarray]]] = None,
                       pad_tokens_to: Optional[int] = None,
                       mrope_deltas: Optional[tuple[np.ndarray, np.ndarray]] = None,
                       trees: Optional[list[tuple[int, int, TokenTree]]] = None) -> StepInputs:
        """Sequence i adds tokens start[i]:start[i] + n_new[i] (their ids from tokens(i, a,
        b)) over its cached ones, in the blocks block_tables[i] lists (its slot in the
        persistent table is kept by request id), and wants logits for its last num_rows[i] of them; then,
        after every such row, for the rows extra_rows lists as (sequence i, offsets into
        its new tokens). long_rope[i] (LongRoPE models): sequence i's tokens take the long
        frequencies. pad_to / pad_tokens_to: rows and tokens of the graph replayed.
        trees: (sequence i, the index where its tree's nodes start, the tree): its tokens
        from there on are nodes, at their tree positions and masks (token_tree.py)."""
        B = len(request_ids)
        Bp = pad_to or B
        bs = self.block_size
        T = int(n_new.sum())
        Tp = max(T + (Bp - B), pad_tokens_to or 0)     # at least one token per padding row
        if Tp > self.T or Bp > self.B:
            raise ValueError(f"step of {Tp} tokens / {Bp} sequences exceeds the buffers "
                             f"({self.T} tokens / {self.B} sequences)")
        qsl = self._host("query_start_loc", Bp + 1)
        qsl[0] = 0
        np.cumsum(n_new, out=qsl[1:B + 1])
        qsl[B + 1:] = T
        seq_lens = self._host("seq_lens", Bp)
        seq_lens[:B] = start + n_new
        seq_lens[B:] = 0

        # Per token: its sequence and position; positions of padding rows are 0.
        seq_of_token = np.repeat(np.arange(B), n_new)
        positions = self._host("positions", Tp)
        positions[:T] = np.arange(T) - qsl[seq_of_token] + start[seq_of_token]
        positions[T:] = 0

        input_ids = self._host("input_ids", Tp)
        row_slots = self._host("row_slots", Bp)
        index: list[int] = []
        values: list[int] = []
        self.tables.begin()
        # One Python pass per request, over Python ints (numpy scalars and a slice
        # assignment per request cost more than the work); the arrays filled once after.
        ids: list[int] = []
        slots_of_rows: list[int] = []
        row = self.tables.row
        widest = 1
        for i, (request_id, a, n, table) in enumerate(zip(request_ids, start.tolist(), n_new.tolist(),
                                                          block_tables)):
            ids += tokens(i, a, a + n)
            slots_of_rows.append(row(request_id, table, index, values))
            if len(table) > widest:
                widest = len(table)
        input_ids[:T] = ids
        row_slots[:B] = slots_of_rows
        row_slots[B:] = 0
        input_ids[T:] = 0
        slots = self._host("slot_mapping", Tp)
        pos = positions[:T]
        slots[:T] = self.tables.host[row_slots[seq_of_token], pos // bs] * bs + pos % bs
        slots[T:] = -1
        tree_rows = step_tree_rows(trees, start, qsl, pos, Tp) if trees else None     # (rotary positions: after the slots)
        if long_rope is not None:
            # After the slots, which need the true positions: tokens of requests in
            # LongRoPE's long mode index the rotary table's second half.
            pos += self.long_rope[1] * long_rope[seq_of_token].astype(pos.dtype)
        if mrope_deltas is not None:
            mrope.shift(pos, seq_of_token, mrope_deltas)     # (after the slots too)
        n_updates = len(index)
        self.num_table_updates = n_updates      # (block-table entries this step sends)
        updates = self._host("table_updates", 2 * n_updates)
        updates[:n_updates] = index
        updates[n_updates:] = values

        # The last num_rows[i] packed rows of each sequence, in order.
        num_sampled = int(num_rows.sum())
        extra = np.concatenate([qsl[i] + offsets for i, offsets in extra_rows]) if extra_rows else None
        num_logits = num_sampled + (len(extra) if extra is not None else 0)
        logits_idx = self._host("logits_indices", max(Bp, num_logits))
        first = np.repeat(qsl[1:B + 1] - num_rows, num_rows)
        logits_idx[:num_sampled] = first + np.arange(num_sampled) - np.repeat(np.cumsum(num_rows) - num_rows, num_rows)
        if extra is not None:
            logits_idx[num_sampled:num_logits] = extra
        logits_idx[num_logits:] = 0             # graphs read at least row 0; dropped
        all_rows = num_logits == Tp and extra is None
        self._built = (Tp, Bp, num_logits, widest)

        self.buffer.upload(self.offsets["table_updates"] + 2 * n_updates)
        if n_updates or self._gathered is None or not np.array_equal(self._gathered, row_slots):
            self._apply_tables(n_updates, Bp)
            self._gathered = row_slots.copy()
        step = self._views(Tp, Bp, T, B, widest, num_logits, all_rows,
                           n_new.tolist() + [0] * (Bp - B), seq_lens.tolist())
        if tree_rows is not None:
            step.meta.tree = self._tree_rows.upload(tree_rows.reshape(-1)).view(-1, 2)
        return step

    def _apply_tables(self, n_updates: int, Bp: int) -> None:
        """Device side, after the upload: the new block ids into the table, then the
        step's rows gathered from it."""
        if n_updates:
            pairs = self.device_view("table_updates", 2 * n_updates)
            self.table_device.view(-1).index_put_((pairs[:n_updates],), pairs[n_updates:])
        torch.index_select(self.table_device, 0, self.device_view("row_slots", Bp), out=self.step_tables[:Bp])

    def _views(self, Tp: int, Bp: int, T: int, B: int, widest: int, num_logits: int, all_rows: bool,
               query_lens: list[int], seq_lens: list[int]) -> StepInputs:
        meta = AttentionMetadata(
            query_start_loc=self.device_view("query_start_loc", Bp + 1),
            seq_lens=self.device_view("seq_lens", Bp),
            block_tables=self.block_tables_view(Bp, widest),
            slot_mapping=self.device_view("slot_mapping", Tp),
            query_lens_cpu=query_lens, seq_lens_cpu=seq_lens,
            max_query_len=max(query_lens[:B]), max_seq_len=max(seq_lens[:B]))
        return StepInputs(
            input_ids=self.device_view("input_ids", Tp), positions=self.device_view("positions", Tp), meta=meta,
            logits_indices=self.device_view("logits_indices", max(num_logits, 1)), num_logits=num_logits,
            all_rows_sampled=all_rows, num_tokens=T, num_seqs=B,
            logits_indices_cpu=self.buffer.np[self.offsets["logits_indices"]:][:num_logits].copy())

    def digest(self) -> int:
        """A CRC of what the last build's forward reads (tokens, positions, slots, logits
        rows, query and sequence lengths, and the rows' block tables by content, as wide
        as the step reads them: never max_blocks_per_seq wide, which can be thousands of
        columns): the tensor- and pipeline-parallel ranks check theirs against rank 0's."""
        Tp, Bp, num_logits, widest = self._built
        host, off = self.buffer.np, self.offsets
        crc = 0
        for name, n in (("input_ids", Tp), ("positions", Tp), ("slot_mapping", Tp), ("logits_indices", num_logits),
                        ("query_start_loc", Bp + 1), ("seq_lens", Bp)):
            crc = zlib.crc32(host[off[name]:off[name] + n], crc)
        rows = host[off["row_slots"]:off["row_slots"] + Bp]
        return zlib.crc32(self.tables.host[rows, :widest], crc)


def static_decode_inputs(builder: StepInputBuilder, shape: GraphShape, num_splits: int) -> StepInputs:
    """The views a graph of `shape` reads (num_seqs rows of query_len tokens): the
    buffers' first entries at their fixed addresses, block tables at full width. Writes
    nothing; a replay sees whatever build(..., pad_to=shape) last uploaded. The fixed
    split-KV factor keeps the attention on its one-token kernel, which takes any mix of
    query lengths."""
    b, size, n = builder, shape.num_seqs, shape.num_tokens
    meta = AttentionMetadata(
        query_start_loc=b.device_view("query_start_loc", size + 1), seq_lens=b.device_view("seq_lens", size),
        block_tables=b.block_tables_view(size, b.M), slot_mapping=b.device_view("slot_mapping", n),
        query_lens_cpu=[shape.query_len] * size, seq_lens_cpu=[shape.query_len] * size,
        max_query_len=shape.query_len, max_seq_len=shape.query_len, num_splits=num_splits)
    return StepInputs(input_ids=b.device_view("input_ids", n), positions=b.device_view("positions", n),
                      meta=meta, logits_indices=b.device_view("logits_indices", n), num_logits=n,
                      all_rows_sampled=True, num_tokens=n, num_seqs=size)


def dummy_decode(builder: StepInputBuilder, shape: GraphShape, token_ids: np.ndarray, num_splits: int) -> StepInputs:
    """Uploads num_seqs sequences of query_len tokens at positions 0.. that write nothing
    to the cache (slot -1) and attend only to their own keys, and returns the static
    views over them: what a graph is captured and checked with."""
    b, size, q, n = builder, shape.num_seqs, shape.query_len, shape.num_tokens
    b._host("input_ids", n)[:] = token_ids
    b._host("positions", n)[:] = np.tile(np.arange(q), size)
    b._host("slot_mapping", n)[:] = -1
    b._host("logits_indices", n)[:] = np.arange(n)
    b._host("query_start_loc", size + 1)[:] = np.arange(size + 1) * q
    b._host("seq_lens", size)[:] = q
    b.buffer.upload(b.offsets["row_slots"])
    b.step_tables[:size].zero_()
    b._gathered = None                          # the next build gathers its rows again
    return static_decode_inputs(b, shape, num_splits)
