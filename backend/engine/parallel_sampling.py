"""Parallel sampling (`n` > 1) as n one-sequence child requests.

As vLLM v1 does it: the engine schedules, caches and samples one sequence per request;
a request for n completions becomes n children that share the prompt (prefix caching
computes its full blocks once) and whose seeds, when the request has one, are
`seed + index`, so each child is reproducible on its own and the n differ. Prompt
logprobs describe the prompt, which they share: the first child alone computes them
(the others may then take its blocks from the prefix cache).
"""

from __future__ import annotations

from backend.sampling_params import SamplingParams


def child_requests(parent_id: str, params: SamplingParams) -> list[tuple[str, SamplingParams]]:
    """(request id, sampling params) of each child, in index order. n == 1: the request itself."""
    if params.n == 1:
        return [(parent_id, params)]
    return [(f"{parent_id}/{i}",
             params.model_copy(update={"n": 1, "seed": None if params.seed is None else params.seed + i,
                                      **({"prompt_logprobs": None} if i else {})}))
            for i in range(params.n)]
