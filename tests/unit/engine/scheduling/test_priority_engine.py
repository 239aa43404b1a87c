"""Priority scheduling through the engine: with a pool too small for everyone,
high-priority requests added after low-priority ones are running finish first and are
never preempted; every low-priority request completes; each request's greedy tokens
equal what FCFS gives it; the pool ends free. Also the offline API's `priority`
argument, and the error a priority gets from an FCFS engine."""

import pytest

from backend import LLM, SamplingParams
from backend.engine.errors import InvalidRequestError
from tests.conftest import assert_pool_free, random_prompts
from tests.helpers.checkpoints import make_checkpoint

LOW, HIGH = 10, 0


def test_high_priority_finishes_first_and_keeps_its_blocks(ckpt_dir):
    path = make_checkpoint(str(ckpt_dir / "llama"), "llama")
    lows = random_prompts(6, [20, 24, 17, 30, 22, 19], seed=21)
    highs = random_prompts(2, [25, 18], seed=22)
    low_params = SamplingParams(max_tokens=40, min_tokens=40, temperature=0, priority=LOW)
    high_params = SamplingParams(max_tokens=8, min_tokens=8, temperature=0, priority=HIGH)
    # 36 blocks of 4 tokens: the six low-priority requests alone need about 66.
    llm = LLM(path, block_size=4, num_kv_blocks=36, max_num_seqs=8, max_num_batched_tokens=64,
              scheduling_policy="priority")
    engine = llm.engine
    ids = {engine.add_request(p, low_params).request_id: ("low", i) for i, p in enumerate(lows)}
    finished, tokens = [], {}
    for _ in range(3):
        finished += [o.request_id for o in engine.step() if o.finished]
    assert not finished                                                 # the low ones are under way
    ids.update({engine.add_request(p, high_params).request_id: ("high", i) for i, p in enumerate(highs)})
    high_ids = [rid for rid, (kind, _) in ids.items() if kind == "high"]
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                finished.append(o.request_id)
                tokens[o.request_id] = o.token_ids
        for rid in high_ids:
            request = engine.scheduler.requests.get(rid)
            assert request is None or request.num_preemptions == 0, "a high-priority request lost its blocks"
    lows_done = [rid for rid in finished if ids[rid][0] == "low"]
    assert len(lows_done) == len(lows)                                  # every low one completes
    assert max(finished.index(rid) for rid in high_ids) < min(finished.index(rid) for rid in lows_done)
    assert engine.stats()["num_preemptions"] > 0
    assert_pool_free(llm)

    fcfs = LLM(path, block_size=4, num_kv_blocks=36, max_num_seqs=8, max_num_batched_tokens=64)
    ref_low = fcfs.generate(lows, SamplingParams(max_tokens=40, min_tokens=40, temperature=0))
    ref_high = fcfs.generate(highs, SamplingParams(max_tokens=8, min_tokens=8, temperature=0))
    for rid, (kind, i) in ids.items():
        assert tokens[rid] == (ref_low if kind == "low" else ref_high)[i].token_ids, (kind, i)


def test_the_offline_api_takes_vllms_priority_argument(ckpt_dir):
    path = make_checkpoint(str(ckpt_dir / "llama"), "llama")
    llm = LLM(path, block_size=4, num_kv_blocks=64, max_num_seqs=1, scheduling_policy="priority")
    prompts = random_prompts(3, [5, 6, 7], seed=23)
    outs = llm.generate(prompts, SamplingParams(max_tokens=2, temperature=0), priority=[3, 1, 2])
    assert [o.token_ids for o in outs] == [o.token_ids for o in LLM(path, block_size=4, num_kv_blocks=64).generate(
        prompts, SamplingParams(max_tokens=2, temperature=0))]


def test_an_fcfs_engine_refuses_a_priority(ckpt_dir):
    llm = LLM(make_checkpoint(str(ckpt_dir / "llama"), "llama"), block_size=4, num_kv_blocks=16)
    with pytest.raises(InvalidRequestError, match="scheduling_policy 'priority'"):
        llm.engine.add_request([5, 6], SamplingParams(priority=1))
    assert_pool_free(llm)


def test_the_policy_is_an_engine_argument_of_the_model_config(ckpt_dir, tmp_path):
    from backend.config import ConfigError
    from backend.triton_server.serving_config import load_settings
    from builder.build import BuildOptions, engine_parameters
    path = make_checkpoint(str(ckpt_dir / "llama"), "llama")
    opts = BuildOptions.create(checkpoint=path, output=str(tmp_path / "entry"), scheduling_policy="priority",
                               priority_aging_s=5.0, lower_priority_prefill_tokens=128)
    params = {k: str(v) for k, v in engine_parameters(opts, path).items() if v is not None}
    args = load_settings(params, str(tmp_path))[0]
    assert (args.scheduling_policy, args.priority_aging_s, args.lower_priority_prefill_tokens) == ("priority", 5.0, 128)
    with pytest.raises(ConfigError, match="scheduling_policy"):
        load_settings({**params, "scheduling_policy": "lifo"}, str(tmp_path))
