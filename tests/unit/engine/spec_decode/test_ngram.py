import numpy as np
import pytest

from backend.engine.spec_decode.ngram_index import lookup


def t(*xs):
    return np.asarray(xs, dtype=np.int64)


def test_longest_suffix_wins_and_the_latest_occurrence():
    # Suffix [3, 4] occurred at 1 (followed by 9) and at 5 (followed by 7 8); [4] alone also at 10.
    tokens = t(0, 3, 4, 9, 0, 3, 4, 7, 8, 1, 4, 2, 3, 4)
    assert lookup(tokens, 1, 3, 2) == [7, 8]
    assert lookup(tokens, 1, 1, 3) == [2, 3, 4]            # n = 1: the latest 4 before the suffix


def test_no_match_and_bounds():
    assert lookup(t(1, 2, 3), 1, 3, 4) == []
    assert lookup(t(5), 1, 3, 4) == []
    assert lookup(t(1, 2, 1), 2, 3, 4) == []                # only n = 1 matches, below the minimum
    # The continuation may run into the suffix itself (a period of 2), never past the end.
    assert lookup(t(1, 2, 1, 2), 1, 2, 5) == [1, 2]


def _brute_force(tokens: list[int], n_min: int, n_max: int, k: int) -> list[int]:
    L = len(tokens)
    for n in range(min(n_max, L - 1), n_min - 1, -1):
        for start in range(L - n - 1, -1, -1):
            if tokens[start:start + n] == tokens[L - n:]:
                return tokens[start + n:start + n + k]
    return []


def test_matches_a_brute_force_search():
    rng = np.random.default_rng(0)
    for _ in range(2000):
        tokens = rng.integers(0, 4, rng.integers(1, 40)).tolist()
        lo, hi = sorted(rng.integers(1, 5, 2).tolist())
        assert lookup(np.asarray(tokens), lo, hi, 3) == _brute_force(tokens, lo, hi, 3), (tokens, lo, hi)


@pytest.mark.parametrize("scan_max", [None, 10])
def test_proposer_arrays_follow_the_requests(monkeypatch, scan_max):
    """The proposer keeps each request's tokens in an array appended to step by step, and
    (past the scan's threshold: 10 tokens here) their index: its proposals are lookup's
    over the whole token list, as outputs grow, shrink, are replaced, and requests come
    and go."""
    import random

    from backend.engine.spec_decode import ngram_index
    if scan_max is not None:
        monkeypatch.setattr(ngram_index, "SCAN_MAX_TOKENS", scan_max)
        monkeypatch.setattr(ngram_index, "MIN_PENDING", 8)

    from backend.engine.request import Request
    from backend.engine.spec_decode.ngram import NgramProposer
    from backend.sampling_params import SamplingParams
    rng = random.Random(0)
    proposer = NgramProposer(1, 3)
    requests = [Request(request_id=f"r{i}", prompt_token_ids=[rng.randrange(4) for _ in range(rng.randrange(1, 30))],
                        sampling_params=SamplingParams(), arrival_time=0.0, max_tokens=500) for i in range(6)]
    for step in range(200):
        running = rng.sample(requests, rng.randrange(1, len(requests) + 1))
        proposals = proposer.propose(running, [(r, 3) for r in running])
        for r in running:
            assert proposals.tokens[r.request_id][0] == lookup(np.asarray(r.all_token_ids), 1, 3, 3), (step, r.request_id)
        for r in requests:
            event = rng.random()
            if event < 0.7:
                r.output_token_ids.extend(rng.randrange(4) for _ in range(rng.choice([1, 1, 3])))
            elif event < 0.75 and r.output_token_ids:
                del r.output_token_ids[-rng.randrange(1, len(r.output_token_ids) + 1):]
            elif event < 0.8:
                r.output_token_ids = r.output_token_ids + [rng.randrange(4)]
    assert len(proposer._tokens) <= len(requests)


def test_arrays_of_finished_requests_are_pruned():
    """Arrays of requests that finished go once their number passes a doubling mark (a step
    never walks every array), and those of requests still unfinished stay."""
    from backend.engine.request import Request, RequestStatus
    from backend.engine.spec_decode.ngram import NgramProposer
    from backend.sampling_params import SamplingParams
    proposer = NgramProposer(1, 3)
    live = Request(request_id="live", prompt_token_ids=[1, 2, 1, 2], sampling_params=SamplingParams(),
                   arrival_time=0.0, max_tokens=8)
    done = []
    for i in range(100):
        r = Request(request_id=f"r{i}", prompt_token_ids=[1, 2, 1], sampling_params=SamplingParams(),
                    arrival_time=0.0, max_tokens=8)
        proposer.propose([r, live], [(r, 2), (live, 2)])
        r.status = RequestStatus.FINISHED
        done.append(r)                  # (kept alive: pruned for finishing, not for being collected)
    assert "live" in proposer._tokens and len(proposer._tokens) <= 66


def test_the_engine_drops_a_requests_arrays_when_it_ends(llama_ckpt):
    """Finished, aborted and stopped requests' token arrays (and indexes) go when they end,
    not at the next doubling of the prune mark."""
    from backend import LLM, SamplingParams
    from tests.conftest import assert_pool_free, random_prompts
    llm = LLM(llama_ckpt, block_size=4, num_kv_blocks=128,
              speculative_config={"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1,
                                  "prompt_lookup_max": 2})
    proposer = llm.engine.speculator.proposer
    llm.generate(random_prompts(3, [12, 20], vocab=8, seed=2), SamplingParams(max_tokens=10, temperature=0))
    assert proposer._tokens == {}
    engine = llm.engine
    engine.add_request([1, 2, 1, 2, 1, 2], SamplingParams(max_tokens=50, temperature=0), request_id="a")
    engine.add_request([3, 4, 3, 4, 3, 4], SamplingParams(max_tokens=50, temperature=0), request_id="s")
    for _ in range(4):
        engine.step()
    assert {"a", "s"} <= set(proposer._tokens)
    engine.abort_request("a")
    engine.stop_requests(["s"])
    assert proposer._tokens == {}
    while engine.has_unfinished_requests():
        engine.step()
    assert_pool_free(llm)
