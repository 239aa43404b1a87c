"""n > 1 as n one-sequence children (backend.engine.parallel_sampling), and the engine's
refusal of an unfanned n."""

import pytest

from backend import InvalidRequestError, LLM, SamplingParams
from backend.engine.parallel_sampling import child_requests


def test_one_sequence_is_the_request_itself():
    params = SamplingParams(max_tokens=4)
    assert child_requests("r", params) == [("r", params)]


def test_children_get_distinct_ids_and_offset_seeds():
    children = child_requests("r", SamplingParams(n=3, seed=7, temperature=0.8, max_tokens=5))
    assert [cid for cid, _ in children] == ["r/0", "r/1", "r/2"]
    assert [p.seed for _, p in children] == [7, 8, 9]
    assert all(p.n == 1 and p.temperature == 0.8 and p.max_tokens == 5 for _, p in children)
    assert [p.seed for _, p in child_requests("r", SamplingParams(n=2))] == [None, None]


def test_children_reproduce_their_seeded_single_requests(tiny_ckpt):
    """Child i of a seeded request is the single request with seed + i: reproducible alone,
    and the children differ."""
    llm = LLM(tiny_ckpt, block_size=8, num_kv_blocks=64)
    params = SamplingParams(n=3, seed=11, temperature=1.0, max_tokens=8, ignore_eos=True)
    children = [p for _, p in child_requests("r", params)]
    together = llm.generate(["The yield statement"] * 3, children)
    alone = [llm.generate("The yield statement", SamplingParams(seed=11 + i, temperature=1.0, max_tokens=8,
                                                                 ignore_eos=True))[0] for i in range(3)]
    assert [o.token_ids for o in together] == [o.token_ids for o in alone]
    assert len({tuple(o.token_ids) for o in together}) > 1
    assert llm.kv_cache_stats()["num_used_blocks"] == 0


def test_engine_refuses_an_unfanned_n(tiny_ckpt):
    llm = LLM(tiny_ckpt, block_size=8, num_kv_blocks=16)
    with pytest.raises(InvalidRequestError, match="'n'"):
        llm.engine.add_request("x", SamplingParams(n=2))
