"""Runs one scheduled step: packs tokens, runs the model over the paged cache, samples."""

from __future__ import annotations

import logging
from typing import Callable, Optional

import torch

from backend.attention.metadata import AttentionMetadata, KVCacheLayer
from backend.engine.request import Request
from backend.engine.sampler import Sampler
from backend.engine.scheduler import SchedulerOutput
from backend.models.config import ModelConfig
from backend.models.llama import CausalLM

logger = logging.getLogger(__name__)


def kv_cache_bytes_per_block(cfg: ModelConfig, block_size: int, kv_dtype: torch.dtype) -> int:
    return cfg.kv_bytes_per_token * block_size * torch.tensor([], dtype=kv_dtype).element_size()


def allocate_kv_cache(cfg: ModelConfig, num_blocks: int, block_size: int, kv_dtype: torch.dtype,
                      device: torch.device) -> list[KVCacheLayer]:
    shape = (num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
    return [KVCacheLayer(torch.zeros(shape, dtype=kv_dtype, device=device),
                         torch.zeros(shape, dtype=kv_dtype, device=device))
            for _ in range(cfg.num_layers)]


class ModelRunner:
    def __init__(self, model: CausalLM, kv_caches: list[KVCacheLayer], block_size: int,
                 device: torch.device, sampler: Sampler,
                 block_table_of: Callable[[str], list[int]]) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self.sampler = sampler
        self._block_table_of = block_table_of

    def prepare(self, out: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start_loc = [0]
        seq_lens: list[int] = []
        query_lens: list[int] = []
        tables: list[list[int]] = []
        logits_rows: list[int] = []
        for s in out.scheduled:
            r = s.request
            start, end = r.num_computed_tokens, r.num_computed_tokens + s.num_new_tokens
            n_prompt = r.num_prompt_tokens
            input_ids.extend(r.prompt_token_ids[start:end])
            if end > n_prompt:
                input_ids.extend(r.output_token_ids[max(start - n_prompt, 0):end - n_prompt])
            table = self._block_table_of(r.request_id)
            positions.extend(range(start, end))
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            query_start_loc.append(query_start_loc[-1] + s.num_new_tokens)
            seq_lens.append(end)
            query_lens.append(s.num_new_tokens)
            tables.append(table)
            if s.completes_prompt:
                logits_rows.append(query_start_loc[-1] - 1)
        max_blocks = max(len(t) for t in tables)
        padded = [t + [0] * (max_blocks - len(t)) for t in tables]
        dev = self.device
        meta = AttentionMetadata(
            query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=torch.tensor(padded, dtype=torch.int32, device=dev),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            query_lens_cpu=query_lens,
            seq_lens_cpu=seq_lens,
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
        )
        return (torch.tensor(input_ids, dtype=torch.long, device=dev),
                torch.tensor(positions, dtype=torch.long, device=dev), meta, logits_rows)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                logits_rows: list[int]) -> Optional[torch.Tensor]:
        """Runs the decoder over the packed step (writing its K/V into the cache) and
        returns the logits of `logits_rows` ([R, V]), or None when R is 0."""
        hidden = self.model(input_ids, positions, self.kv_caches, meta)
        return self.model.compute_logits(hidden[logits_rows]) if logits_rows else None

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> list[Optional[int]]:
        """One forward pass. Returns, per scheduled request, its next token, or None
        when the request is mid-prefill (its chunk did not reach the last token)."""
        input_ids, positions, meta, logits_rows = self.prepare(out)
        logits = self.forward(input_ids, positions, meta, logits_rows)
        sampling = [s.request for s in out.scheduled if s.completes_prompt]
        tokens = self.sampler(logits, sampling) if sampling else []
        it = iter(tokens)
        return [next(it) if s.completes_prompt else None for s in out.scheduled]
