"""Offline API: `LLM(path, ...).generate(prompts, params)`, no server involved."""

from __future__ import annotations

from dataclasses import replace
from typing import Optional, Sequence, Union

from backend.config import EngineArgs
from backend.engine.runner.cpu_threads import restore_caller_threads
from backend.engine.llm_engine import LLMEngine, Prompt
from backend.engine.outputs import RequestOutput
from backend.engine.parallel_sampling import child_requests
from backend.sampling_params import SamplingParams


class LLM:
    """With tensor_parallel_size > 1 the engine starts worker processes (spawn): call
    `close()` (or use `with LLM(...) as llm:`) to stop them, and guard a script's entry
    point with `if __name__ == "__main__":`, as spawn requires."""

    def __init__(self, model: str, **engine_args) -> None:
        self.engine = LLMEngine(EngineArgs.create(model=model, **engine_args))

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: Union[Prompt, Sequence[Prompt]],
                 sampling_params: Union[None, SamplingParams, Sequence[SamplingParams]] = None,
                 priority: Optional[Sequence[int]] = None) -> list[RequestOutput]:
        """Run every prompt to completion with continuous batching; outputs in prompt order.

        A prompt is a string, a list of token ids, or vLLM's dict ({"prompt": text} or
        {"prompt_token_ids": ids}, with "multi_modal_data": {"image": [PIL images]} for a
        vision-language model). A single prompt may be passed bare.
        With `n` > 1 a prompt's output is that of its first completion, and `completions`
        holds all n in index order (child requests sharing the prompt's blocks, seeds
        `seed + i`: backend.engine.parallel_sampling). With `prompt_logprobs` each output's
        `prompt_logprobs` holds vLLM's list (None, then one entry per prompt token).
        `priority` (vLLM's argument): one per prompt, for an engine with
        scheduling_policy 'priority' (lower first); it sets each request's
        SamplingParams.priority.
        """
        if self.engine.args.runner == "pooling":
            raise ValueError("this engine pools (runner='pooling'): use LLM.embed")
        if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError("one SamplingParams per prompt, or a single one for all")
        if priority is not None:
            if len(priority) != len(prompts):
                raise ValueError("one priority per prompt")
            if any(priority) and self.engine.args.scheduling_policy != "priority":
                # (before any request is added: none is left behind in the engine)
                raise ValueError("priority needs an engine with scheduling_policy='priority'")
            sampling_params = [SamplingParams.create(**{**sp.model_dump(exclude_unset=True), "priority": p})
                               for sp, p in zip(sampling_params, priority)]
        fanned: list[tuple[str, list[str]]] = []      # (parent id, its children's ids)
        for p, sp in zip(prompts, sampling_params):
            if sp.n == 1:
                rid = self.engine.add_request(p, sp).request_id
                fanned.append((rid, [rid]))
                continue
            children = child_requests(self.engine.new_request_id(), sp)
            fanned.append((children[0][0].rsplit("/", 1)[0], [cid for cid, _ in children]))
            for cid, cp in children:
                self.engine.add_request(p, cp, request_id=cid)
        results: dict[str, RequestOutput] = {}
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        results[out.request_id] = out
        finally:
            restore_caller_threads()        # (the engine set this thread's per step: cpu_threads.py)
        outputs = []
        for parent_id, child_ids in fanned:
            if len(child_ids) == 1 and child_ids[0] == parent_id:
                outputs.append(results[parent_id])
                continue
            completions = [results[cid] for cid in child_ids]
            outputs.append(replace(completions[0], request_id=parent_id, completions=completions))
        return outputs

    def embed(self, prompts: Union[Prompt, Sequence[Prompt]]) -> list[RequestOutput]:
        """runner='pooling': each prompt's pooled vector (`pooling_output`, fp32, [hidden];
        vLLM's `LLM.embed`), the prompts batched and chunked like any prefill."""
        if self.engine.args.runner != "pooling":
            raise ValueError("LLM.embed needs an engine with runner='pooling' (an embedding model)")
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        ids = [self.engine.add_request(p).request_id for p in prompts]
        results: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished:
                    results[out.request_id] = out
        return [results[i] for i in ids]

    def close(self) -> None:
        self.engine.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def stats(self) -> dict:
        """The engine's figures (LLMEngine.stats): KV cache, scheduler, speculation, LoRA."""
        return self.engine.stats()

    # The name before it covered more than the KV cache; kept for offline scripts.
    kv_cache_stats = stats

    def reset_prefix_cache(self) -> None:
        self.engine.kv_cache.reset_prefix_cache()
