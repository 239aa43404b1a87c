"""Gemma 2, Gemma 3 (text) and Phi-3 against transformers, greedy, token for token (fp32,
CPU), in a mixed batch with chunked prefill, preemption and prefix-cache hits; windows
shorter than the prompts, soft-caps that bind, LongRoPE past its original context.
The tiny configs are in tests/helpers/checkpoints.py."""

import pytest

from backend import LLM, SamplingParams
from tests.conftest import assert_pool_free, random_prompts
from tests.helpers.checkpoints import hf_greedy, hf_logprobs, make_checkpoint
from tests.helpers.pins import require_pinned

LENGTHS = [1, 200, 7, 64, 33, 150, 2, 99, 16, 120, 50, 60]
MAX_NEW = 24


def mixed_prompts(seed: int) -> list[list[int]]:
    """Ragged prompts plus two sharing the first 40 tokens of the 200-token one (prefix
    hits once its blocks are computed): one long itself, one of 50 tokens (under Phi-3's
    64-token original context, so LongRoPE must not share the long one's blocks)."""
    prompts = random_prompts(len(LENGTHS), LENGTHS, seed=seed)
    extra = random_prompts(2, [60, 10], seed=seed + 100)
    return prompts + [prompts[1][:40] + extra[0], prompts[1][:40] + extra[1]]


def serve(path: str, prompts: list[list[int]], max_new: int = MAX_NEW, **engine) -> tuple[list[list[int]], dict]:
    # 100 blocks of 4 tokens cannot hold every sequence at once: preemption must happen.
    args = dict(block_size=4, num_kv_blocks=100, max_num_seqs=16, max_num_batched_tokens=48)
    llm = LLM(path, **{**args, **engine})
    outs = llm.generate(prompts, SamplingParams(max_tokens=max_new, min_tokens=max_new, temperature=0))
    assert all(o.finish_reason == "length" for o in outs)
    stats = llm.stats()
    assert_pool_free(llm)
    return [o.token_ids for o in outs], stats


@pytest.mark.parametrize("arch,overrides", [
    ("gemma2", {}), ("gemma3", {}), ("phi3", {}),
    # Phi-4-mini's shape of Phi-3: RoPE over 3/4 of each head, tied embeddings.
    ("phi3", {"partial_rotary_factor": 0.75, "tie_word_embeddings": True}),
], ids=["gemma2", "gemma3", "phi3", "phi3-partial-rotary-tied"])
def test_greedy_matches_transformers(ckpt_dir, arch, overrides):
    if arch != "gemma3":
        require_pinned("transformers")    # other versions' references differ: tests/helpers/pins.py
    name = "-".join([arch] + sorted(overrides))
    path = make_checkpoint(str(ckpt_dir / name), arch, **overrides)
    prompts = mixed_prompts(seed=1)
    expected = hf_greedy(path, prompts, MAX_NEW)
    got, stats = serve(path, prompts)
    for i, (out, ref) in enumerate(zip(got, expected)):
        assert out == ref, f"prompt {i} (len {len(prompts[i])}) differs"
    assert stats["num_preemptions"] > 0
    assert stats["num_chunked_prefills"] > 0
    assert stats["prefix_cache_hit_tokens"] > 0
    if arch == "phi3":
        # Prompts of 50 and 60 tokens generate past position 64: each was recomputed with
        # the long factors there, as transformers' generate does.
        assert stats["num_long_rope_restarts"] >= 2


def test_gemma2_features_bind(ckpt_dir):
    """The test config's window and attention soft-cap change transformers' own greedy
    output: the tests here check them, not a model on which they are no-ops. The final
    soft-cap is monotonic (greedy tokens cannot see it): the engine's logprobs are
    transformers' capped ones, which differ from the uncapped ones."""
    require_pinned("transformers")    # other versions' references differ: tests/helpers/pins.py
    path = make_checkpoint(str(ckpt_dir / "gemma2"), "gemma2")
    prompts = random_prompts(3, [90, 40, 25], seed=5)
    ref = hf_greedy(path, prompts, 12)
    for name, override in [("attention soft-cap", dict(attn_logit_softcapping=None)),
                           ("window", dict(sliding_window=4096))]:
        other = make_checkpoint(str(ckpt_dir / f"gemma2-{name}"), "gemma2", **override)
        assert hf_greedy(other, prompts, 12) != ref, name

    llm = LLM(path, block_size=4, num_kv_blocks=100, max_num_batched_tokens=32)
    out = llm.generate(prompts[:1], SamplingParams(max_tokens=4, temperature=0, logprobs=5, ignore_eos=True))[0]
    assert_pool_free(llm)
    assert out.token_ids == ref[0][:4]
    capped = hf_logprobs(path, prompts[0], out.token_ids)
    uncapped = hf_logprobs(make_checkpoint(str(ckpt_dir / "gemma2-final"), "gemma2", final_logit_softcapping=None),
                           prompts[0], out.token_ids)
    for pos, entry in enumerate(out.logprobs):
        for token, lp in entry.items():
            assert lp.logprob == pytest.approx(capped[pos, token].item(), abs=1e-4)
    token = out.token_ids[0]
    assert abs(capped[0, token] - uncapped[0, token]) > 0.1


def test_gemma2_triton_backend_matches_transformers(ckpt_dir):
    """Soft-capping and the window in the Triton kernels (interpreter on CPU), both the
    tiled prompt kernel and the one-token decode kernel, in a mixed batch with chunked
    prefill and preemption."""
    require_pinned("transformers")    # other versions' references differ: tests/helpers/pins.py
    path = make_checkpoint(str(ckpt_dir / "gemma2"), "gemma2")
    prompts = random_prompts(5, [1, 40, 9, 23, 17], seed=2)
    expected = hf_greedy(path, prompts, 8)
    got, stats = serve(path, prompts, 8, block_size=8, num_kv_blocks=7, max_num_seqs=8,
                       max_num_batched_tokens=16, attention_backend="triton")
    assert got == expected
    assert stats["num_preemptions"] > 0 and stats["num_chunked_prefills"] > 0


def test_phi3_longrope_crossing_with_async_scheduling_off(ckpt_dir):
    """The restart at position 64 also in the synchronous engine (no token in flight)."""
    require_pinned("transformers")    # other versions' references differ: tests/helpers/pins.py
    path = make_checkpoint(str(ckpt_dir / "phi3"), "phi3")
    prompts = random_prompts(3, [50, 63, 70], seed=3)
    expected = hf_greedy(path, prompts, 20)
    got, stats = serve(path, prompts, 20, async_scheduling=False, num_kv_blocks=200)
    assert got == expected
    assert stats["num_long_rope_restarts"] == 2
