"""The runner owns its batch (issue 51 part 1): the runner's side of the engine (runner/,
sampling/, the proposers, verification, the bitmask's application) learns about requests
only from the typed step (scheduling/sched_output.py) and keeps its own state of each
(runner/request_state.py). While engines serve with every feature on, every read of
an attribute of the scheduler's `Request` is recorded with the file that made it, and
no runner-side file may appear; no runner-side module imports `backend.engine.request`,
or anything of the scheduler's but the typed step (its block tables too are the
runner's own copies, kept by the step's diffs)."""

import ast
import sys
from pathlib import Path

import pytest

from backend import LLM, SamplingParams
from backend.engine.request import Request
from tests.conftest import assert_pool_free, random_prompts

ENGINE = Path(__file__).resolve().parents[3] / "backend" / "engine"
RUNNER_SIDE = sorted(
    [p for folder in ("runner", "sampling") for p in (ENGINE / folder).rglob("*.py")]
    + [ENGINE / "spec_decode" / name for name in ("draft_model.py", "eagle.py", "medusa.py", "rejection_sampler.py",
                                                   "tree_drafting.py", "token_tree.py", "draft_tokens.py")]
    + [ENGINE / "structured_output" / "bitmask.py"])


@pytest.fixture
def watch_reads(monkeypatch):
    """The set of files that read an attribute of a Request."""
    readers: set = set()
    real = object.__getattribute__

    def watched(self, name):
        readers.add(sys._getframe(1).f_code.co_filename)
        return real(self, name)
    monkeypatch.setattr(Request, "__getattribute__", watched)
    return readers


def _runner_side(readers: set) -> set:
    names = {str(p) for p in RUNNER_SIDE}
    return {r for r in readers if r in names}


def test_the_runner_side_never_imports_the_schedulers_request_or_state():
    assert len(RUNNER_SIDE) > 30
    for path in RUNNER_SIDE:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                assert node.module != "backend.engine.request", f"{path} imports backend.engine.request"
                assert not node.module.startswith("backend.engine.scheduling.") or \
                    node.module == "backend.engine.scheduling.sched_output", f"{path} imports {node.module}"


def test_the_runner_side_reads_no_request_with_every_feature_on(tiny_ckpt, watch_reads):
    """n-gram speculation, async scheduling, preemption, chunked prefill, n = 2, seeds,
    penalties, bad words, logprobs and prompt logprobs, stop strings, a JSON schema."""
    llm = LLM(tiny_ckpt, block_size=4, num_kv_blocks=40, max_num_seqs=8, max_num_batched_tokens=40,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2,
                                  "prompt_lookup_min": 1})
    assert llm.engine.async_scheduling
    prompts = random_prompts(7, [30, 45, 12], vocab=300, seed=4)
    params = [SamplingParams(max_tokens=24, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=24, temperature=0.8, seed=1, n=2, repetition_penalty=1.2,
                             frequency_penalty=0.3, ignore_eos=True),
              SamplingParams(max_tokens=24, temperature=0, logprobs=3, prompt_logprobs=2, ignore_eos=True),
              SamplingParams(max_tokens=24, temperature=0, stop=["e"], ignore_eos=True),
              SamplingParams(max_tokens=24, temperature=0, guided_json={"type": "object"}),
              SamplingParams(max_tokens=24, temperature=0, min_tokens=5, ignore_eos=True),
              SamplingParams(max_tokens=24, temperature=0.5, seed=3, bad_words_token_ids=[[5], [7, 8]],
                             ignore_eos=True)]
    watch_reads.clear()
    outs = llm.generate(prompts, params)
    assert len(outs) == len(prompts) and all(o.token_ids for o in outs)
    stats = llm.stats()
    assert stats["spec_decode_num_draft_tokens"] > 0 and stats["num_preemptions"] > 0, stats
    assert any(r.endswith("scheduler.py") for r in watch_reads)        # (the watch sees reads)
    assert not _runner_side(watch_reads), _runner_side(watch_reads)
    assert not len(llm.engine.runner.states)        # every finished request's state let go
    assert_pool_free(llm)


def test_the_runner_side_reads_no_request_with_a_draft_model(tiny_ckpt, tiny_draft, watch_reads):
    llm = LLM(tiny_ckpt, block_size=4, num_kv_blocks=40, max_num_seqs=8, max_num_batched_tokens=40,
              speculative_config={"method": "draft_model", "model": tiny_draft, "num_speculative_tokens": 3})
    prompts = random_prompts(5, [30, 45, 12], vocab=300, seed=5)
    watch_reads.clear()
    llm.generate(prompts, [SamplingParams(max_tokens=20, temperature=t, seed=2, ignore_eos=True)
                           for t in (0, 0.7, 0, 1.0, 0)])
    assert llm.stats()["spec_decode_num_draft_tokens"] > 0
    assert not _runner_side(watch_reads), _runner_side(watch_reads)
    assert_pool_free(llm)
