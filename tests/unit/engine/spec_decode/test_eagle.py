"""EAGLE-3 and EAGLE-1 speculative decoding (fp32, CPU): random heads in the published
layouts on a random Llama. Their proposals equal a dense reference drafter's (so the
catch-up, the target's captured states and the head's own continuation line up), greedy
output equals speculation off with chunked prefill, preemption, prefix hits and async
scheduling, and the pool ends free. The trained head on the trained target:
test_trained_heads.py."""

import pytest

from backend import LLM, SamplingParams
from backend.config import ConfigError
from builder.eagle_heads import random_eagle1_head, random_head
from tests.conftest import assert_pool_free
from tests.helpers.checkpoints import hf_greedy, make_checkpoint
from tests.helpers.spec_batch import MAX_NEW, assert_greedy_unchanged
from tests.helpers.eagle_reference import DenseEagle1, DenseEagle3

# 100 blocks of 4 tokens cannot hold the ten sequences at once: preemption must happen.
ENGINE = dict(block_size=4, num_kv_blocks=100, max_num_seqs=16, max_num_batched_tokens=48, dtype="float32")


@pytest.fixture(scope="module")
def target(ckpt_dir):
    # Four layers: the head reads three of them (1, 2 and 3 here).
    return make_checkpoint(str(ckpt_dir / "llama_eagle_target"), "llama", initializer_range=0.05,
                           num_hidden_layers=4)


@pytest.fixture(scope="module")
def head(target, ckpt_dir):
    """A reduced draft vocabulary (d2t) of 200 of the 320 ids."""
    return random_head(target, str(ckpt_dir / "eagle3_head"), seed=3, draft_vocab=200)


@pytest.fixture(scope="module")
def eagle1_head(target, ckpt_dir):
    return random_eagle1_head(target, str(ckpt_dir / "eagle1_head"), seed=4)


def eagle(head: str, k: int, method: str = "eagle3") -> dict:
    return {"method": method, "model": head, "num_speculative_tokens": k}


@pytest.mark.parametrize("method,k,async_scheduling", [("eagle3", 1, False), ("eagle3", 3, False),
                                                       ("eagle3", 3, True), ("eagle", 3, True)])
def test_greedy_output_is_unchanged(target, head, eagle1_head, prompts, reference, method, k, async_scheduling):
    llm = LLM(target, speculative_config=eagle(head if method == "eagle3" else eagle1_head, k, method),
              async_scheduling=async_scheduling, **ENGINE)
    assert_greedy_unchanged(llm, prompts, reference, MAX_NEW)


def _recording(llm: LLM) -> list[tuple[list[int], list[int]]]:
    """Every proposal the head makes: (the request's tokens then, the proposals)."""
    scheduler, seen = llm.engine.scheduler, []
    set_proposals = scheduler.set_proposals

    def record(proposals):
        for request_id, (tokens, _) in proposals.tokens.items():
            request = scheduler.requests.get(request_id)
            if request is not None:
                seen.append((list(request.all_token_ids), list(tokens.tolist())))
        set_proposals(proposals)
    scheduler.set_proposals = record
    return seen


@pytest.mark.parametrize("method,async_scheduling", [("eagle3", False), ("eagle3", True), ("eagle", True)])
def test_proposals_equal_a_dense_reference(target, head, eagle1_head, prompts, method, async_scheduling):
    """Each proposal chain equals the dense drafter's over the request's tokens at that
    point (where its choice is not a near-tie), through chunked prefill and preemption.
    Prefix caching is off: a hit block's last head entry was written with its first
    computer's next token, a legitimate difference."""
    path = head if method == "eagle3" else eagle1_head
    llm = LLM(target, speculative_config=eagle(path, 3, method), async_scheduling=async_scheduling,
              enable_prefix_caching=False, **ENGINE)
    seen = _recording(llm)
    llm.generate(prompts[:10], SamplingParams(max_tokens=MAX_NEW, min_tokens=MAX_NEW, temperature=0))
    stats = llm.stats()
    assert stats["num_preemptions"] > 0 and stats["num_chunked_prefills"] > 0
    dense = (DenseEagle3 if method == "eagle3" else DenseEagle1)(path, target)
    checked = 0
    for tokens, proposed in seen[::3]:          # (a third of them: the reference is slow)
        want, margins = dense.propose(tokens, len(proposed))
        for j, (got, ref, margin) in enumerate(zip(proposed, want, margins)):
            if margin < 1e-3:
                break               # a near-tie: what follows continues from another token
            assert got == ref, f"proposal {j + 1} after {len(tokens)} tokens"
            checked += 1
    assert checked > 100
    assert_pool_free(llm)


def test_bad_heads_are_refused_naming_the_argument(target, head, tmp_path, ckpt_dir):
    two_layers = make_checkpoint(str(ckpt_dir / "llama"), "llama")     # (the suite's 2-layer Llama)
    with pytest.raises(ConfigError, match="speculative_config.model.*three distinct layers"):
        LLM(two_layers, speculative_config=eagle(head, 2), num_kv_blocks=64)
    with pytest.raises(ConfigError, match="speculative_config.model.*not an EAGLE-3 head"):
        LLM(target, speculative_config=eagle(target, 2), num_kv_blocks=64)
    with pytest.raises(ConfigError, match="speculative_config.model.*is an EAGLE-3 head: use method 'eagle3'"):
        LLM(target, speculative_config=eagle(head, 2, "eagle"), num_kv_blocks=64)
    with pytest.raises(ConfigError, match="speculative_config.model.*not an EAGLE head"):
        LLM(target, speculative_config=eagle(target, 2, "eagle"), num_kv_blocks=64)
    with pytest.raises(ConfigError, match="speculative_config.model.*no checkpoint"):
        LLM(target, speculative_config=eagle(str(tmp_path / "nope"), 2), num_kv_blocks=64)
    # A reduced vocabulary without its d2t map; a full one without an LM head of its own
    # uses the target's (packed by oneDNN on CPU: shared as a module) and serves.
    import shutil

    from safetensors.torch import load_file, save_file
    no_map, full = tmp_path / "no_map", tmp_path / "full"
    shutil.copytree(head, no_map)
    state = load_file(str(no_map / "model.safetensors"))
    save_file({k: v for k, v in state.items() if k not in ("d2t", "t2d")}, str(no_map / "model.safetensors"))
    with pytest.raises(ConfigError, match="speculative_config.model.*no d2t map"):
        LLM(target, speculative_config=eagle(str(no_map), 2), num_kv_blocks=64)
    random_head(target, str(full), seed=5)
    state = load_file(str(full / "model.safetensors"))
    save_file({k: v for k, v in state.items() if k != "lm_head.weight"}, str(full / "model.safetensors"))
    llm = LLM(target, speculative_config=eagle(str(full), 2), num_kv_blocks=64, dtype="float32")
    assert len(llm.generate([5, 6, 7], SamplingParams(max_tokens=6, temperature=0))[0].token_ids) == 6
    with pytest.raises(ConfigError, match="cpu_forward_shards"):
        LLM(target, speculative_config=eagle(head, 2), num_kv_blocks=64, cpu_forward_shards=2)


def test_through_cuda_graphs(target, head, prompts):
    """The target's verify graphs and the head's own graphs (stand-ins that replay over the
    fixed buffers and overwrite one hidden-state buffer each replay, Triton kernels under
    the interpreter): the head reads its hidden input from its fixed buffer and the
    target's captured states survive the next replay, so the proposals are the eager
    run's, step by step, and the output is transformers'."""
    from tests.helpers.graphs import EagerReplayGraphs
    # (The interpreter is slow: short prompts, five tokens.) The third request does not
    # speculate: under async scheduling it runs while the others' step is in flight, so a
    # replay rewrites the graphs' hidden-state buffer before their proposals are drafted.
    few = [prompts[0], prompts[2], prompts[4][:9]]
    expected = hf_greedy(target, few, 5)
    params = [SamplingParams(max_tokens=5, min_tokens=5, temperature=0, speculative_decoding=i < 2)
              for i in range(3)]
    runs = {}
    for graphs in (False, True):
        llm = LLM(target, block_size=8, num_kv_blocks=60, max_num_seqs=4, max_num_batched_tokens=64,
                  attention_backend="triton", speculative_config=eagle(head, 3), dtype="float32")
        proposer = llm.engine.runner.drafter
        if graphs:
            llm.engine.runner.graphs = EagerReplayGraphs(llm.engine.runner, 4, verify_query_len=4)
            proposer.graphs = EagerReplayGraphs(proposer, 4, verify_query_len=4)
        seen = _recording(llm)
        outs = llm.generate(few, params)
        assert [o.token_ids for o in outs] == expected
        assert_pool_free(llm)
        runs[graphs] = [p for _, p in seen]
    assert any(s.query_len == 1 for s in proposer.graphs.replayed)
    assert any(s.query_len == 4 for s in llm.engine.runner.graphs.replayed)
    assert runs[True] == runs[False] and runs[False]
