"""The model runner of `runner: pooling` (embedding models, vLLM's pooling runner): the
same packed forward over the paged cache as generation, but what a step returns is, for
each request whose prompt it completes, the pooled final hidden state (after the final
norm), not a sampled token. Nothing is sampled; the scheduler finishes such a request
when the vector arrives (Scheduler.update_from_output) and frees its blocks.

Pooling types (PoolerConfig): LAST, the last prompt token's hidden state (decoder
embedding models such as Qwen3-Embedding: the last token has attended to every other),
and MEAN, the average over the prompt's tokens. Prompts are prefilled in chunks like any
other, so MEAN keeps a running sum per request across its chunks here: the sum is the
runner's scratch, like the KV cache, restarted whenever a request's chunk starts at
token 0 (its first, or again after a preemption) and dropped when the request ends. A
prefix-cache hit would skip tokens the mean needs, so the engine turns prefix caching
off for MEAN (LAST always computes the last token: the cache leaves one to compute).
Vectors are L2-normalized unless `normalize` is false. Pooling is in fp32 whatever the
model's dtype; the step's vectors come to the host in one copy.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from backend.config import PoolerConfig
from backend.engine.runner.model_runner import ModelRunner
from backend.engine.outputs import ModelRunnerOutput
from backend.engine.scheduling.sched_output import SchedulerOutput


class PoolingModelRunner(ModelRunner):
    def __init__(self, *args, pooler: Optional[PoolerConfig] = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.pooler = pooler or PoolerConfig()
        # MEAN: request id -> sum of its computed tokens' hidden states.
        self._sums: dict[str, torch.Tensor] = {}

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, grammar_bitmask=None) -> ModelRunnerOutput:
        states = self.update_states(out)
        for request_id in [rid for rid in self._sums if rid not in self.states]:
            del self._sums[request_id]              # aborted mid-prompt
        step = self.inputs.build(out, states)
        hidden = self.model(step.input_ids, step.positions, self.kv_caches, step.meta)
        done = [i for i, s in enumerate(out.scheduled) if s.completes_prompt]
        if self.pooler.pooling_type == "LAST":
            # The step's sampled rows are exactly the last token of each completed prompt.
            pooled = hidden.index_select(0, step.logits_indices[:step.num_logits]).float() if done else None
        else:
            pooled = self._mean(out, hidden)
        result = ModelRunnerOutput([[] for _ in out.scheduled])
        if pooled is not None:
            if self.pooler.normalize:
                pooled = F.normalize(pooled, p=2, dim=-1)
            result.pooler_output = dict(zip(done, pooled.cpu()))
        return result

    def _mean(self, out: SchedulerOutput, hidden: torch.Tensor) -> Optional[torch.Tensor]:
        means, start = [], 0
        for s in out.scheduled:
            rows = hidden[start:start + s.num_new_tokens]
            start += s.num_new_tokens
            rid = s.request_id
            total = rows.float().sum(dim=0)
            if s.num_computed_tokens > 0 and rid in self._sums:
                total = total + self._sums[rid]
            if s.completes_prompt:
                self._sums.pop(rid, None)
                means.append(total / (s.num_computed_tokens + s.num_new_tokens))
            else:
                self._sums[rid] = total
        return torch.stack(means) if means else None
