"""Trees of proposals (vLLM's speculative_token_tree; backend/engine/spec_decode/
token_tree.py), fp32 on CPU: the tree's layout and walk, and greedy output with Medusa
and EAGLE-3 trees equal to transformers' (random heads in the published layouts on a
random Llama), with chunked prefill, preemption, prefix hits and async scheduling, the
torch path and the Triton kernel; the pool ends free."""

import pytest

from backend import LLM, SamplingParams
from backend.config import SpeculativeConfig
from backend.engine.spec_decode.token_tree import TokenTree, TreeError, moves, parse_tree
from builder.eagle_heads import random_head
from builder.medusa_heads import random_heads
from tests.conftest import assert_pool_free
from tests.helpers.checkpoints import make_checkpoint
from tests.helpers.spec_batch import MAX_NEW, assert_greedy_unchanged

ENGINE = dict(block_size=4, num_kv_blocks=120, max_num_seqs=16, max_num_batched_tokens=64, dtype="float32")
TREE = "[(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (1, 0, 0)]"


def test_the_tree_layout():
    tree = TokenTree.parse("[(1, 0), (0,), (1,), (0, 0), (0, 1), (0, 0, 0)]")
    assert tree.paths == ((0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0))       # breadth-first
    assert tree.parents.tolist() == [-1, -1, 0, 0, 1, 2]
    assert tree.depths.tolist() == [1, 1, 2, 2, 2, 3] and tree.depth == 3 and tree.max_children == 2
    assert tree.bits.tolist() == [0b1, 0b10, 0b101, 0b1001, 0b10010, 0b100101]
    assert tree.levels == [(0, 2), (2, 5), (5, 6)]
    assert tree.nodes_within(1) == 2 and tree.nodes_within(2) == 5 and tree.nodes_within(9) == 6
    assert tree.prefix(3).paths == tree.paths[:3] and tree.path_of(5) == [0, 2, 5]
    # Rows: root, then node j at 1 + j. Node 1 and node 4 stand: the walk takes 1 then 4.
    flags = [0, 0, 1, 0, 0, 1, 0]
    assert tree.walk(flags, 0) == [1, 4] and tree.walk([9] + flags, 1) == [1, 4]
    assert tree.walk([0, 0, 0, 1, 0, 1, 1], 0) == []                  # (no depth-1 node stands)
    assert moves([1, 4], 10) == ([12, 15], [11, 12]) and moves([0, 2, 5], 10) == ([13, 16], [12, 13])
    assert TokenTree.chain(3).is_chain and not tree.is_chain


@pytest.mark.parametrize("text, message", [("[(0,), (0, 0, 1)]", "no parent"), ("[]", "no nodes"),
                                           ("[(0,), (0,)]", "twice"), ("[(-1,)]", "negative"),
                                           ("zero", "not a list"), (str([(i,) for i in range(64)]), "at most 63")])
def test_bad_trees_are_refused(text, message):
    with pytest.raises(TreeError, match=message):
        parse_tree(text)
    with pytest.raises(ValueError, match="speculative_token_tree"):
        SpeculativeConfig(method="medusa", model="m", speculative_token_tree=text)


def test_the_config_counts_the_tree():
    spec = SpeculativeConfig(method="eagle3", model="m", speculative_token_tree=[[0], [1], [0, 0]])
    assert spec.num_speculative_tokens == 3 and spec.token_tree.paths == ((0,), (1,), (0, 0))
    assert SpeculativeConfig(method="eagle3", model="m", speculative_token_tree="[(0,), (0, 0)]").token_tree is None
    with pytest.raises(ValueError, match="has 3 nodes; num_speculative_tokens is 2"):
        SpeculativeConfig(method="eagle3", model="m", num_speculative_tokens=2, speculative_token_tree="[(0,), (1,), (0, 0)]")
    with pytest.raises(ValueError, match="needs method 'eagle', 'eagle3' or 'medusa'"):
        SpeculativeConfig(method="ngram", speculative_token_tree="[(0,), (1,)]")


@pytest.fixture(scope="module")
def target(ckpt_dir):
    return make_checkpoint(str(ckpt_dir / "llama_tree_target"), "llama", initializer_range=0.05, num_hidden_layers=4)


@pytest.fixture(scope="module")
def medusa_heads(target, ckpt_dir):
    return random_heads(target, str(ckpt_dir / "medusa_tree"), num_heads=3, num_layers=1, seed=5)


@pytest.fixture(scope="module")
def eagle_head(target, ckpt_dir):
    return random_head(target, str(ckpt_dir / "eagle3_tree_head"), seed=3, draft_vocab=200)


@pytest.mark.parametrize("method, async_scheduling, attention", [
    ("medusa", False, "torch"), ("medusa", True, "torch"), ("eagle3", False, "torch"), ("eagle3", True, "torch")])
def test_greedy_output_is_unchanged(target, medusa_heads, eagle_head, prompts, reference, method, async_scheduling,
                                    attention):
    spec = {"method": method, "model": medusa_heads if method == "medusa" else eagle_head,
            "speculative_token_tree": TREE}
    llm = LLM(target, speculative_config=spec, async_scheduling=async_scheduling, attention_backend=attention,
              **ENGINE)
    assert_greedy_unchanged(llm, prompts, reference, MAX_NEW)


def test_the_triton_kernel_verifies_and_drafts_trees(target, eagle_head, prompts, reference):
    """The Triton kernel (through the interpreter) with the tree masks of the target's
    verifications and of the head's levels: a few short prompts, the same tokens."""
    picked = [0, 2, 6]
    llm = LLM(target, speculative_config={"method": "eagle3", "model": eagle_head, "speculative_token_tree": TREE},
              attention_backend="triton", dtype="float32", block_size=4, num_kv_blocks=64)
    outs = llm.generate([prompts[i] for i in picked], SamplingParams(max_tokens=8, min_tokens=8, temperature=0))
    assert [o.token_ids for o in outs] == [reference[i][:8] for i in picked]
    assert llm.stats()["spec_decode_num_draft_tokens"] > 0
    assert_pool_free(llm)


def test_a_tree_on_a_sliding_window_model_is_refused(ckpt_dir):
    """A node's window would follow its place in the sequence, not its rotary position."""
    from backend.config import ConfigError
    mistral = make_checkpoint(str(ckpt_dir / "mistral-tree-w8"), "mistral", sliding_window=8)
    with pytest.raises(ConfigError, match="speculative_token_tree.*sliding window"):
        LLM(mistral, speculative_config={"method": "medusa", "model": "heads", "speculative_token_tree": TREE},
            num_kv_blocks=16)


def test_a_chain_given_as_a_tree_keeps_the_chains_limit():
    with pytest.raises(ValueError, match="a chain of 17 proposals"):
        SpeculativeConfig(method="eagle3", model="m", speculative_token_tree=str([(0,) * i for i in range(1, 18)]))
    with pytest.raises(ValueError, match="speculative_token_tree"):
        SpeculativeConfig(method="eagle3", model="m", speculative_token_tree=[0, 1])
