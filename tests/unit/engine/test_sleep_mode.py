"""Sleep mode (backend/engine/sleep_mode.py, vLLM's /sleep and /wake_up): level 1 frees
the KV cache, level 2 the weights too; after wake_up greedy tokens are the same as
before, with LoRA adapters and with the host KV tier. A sleeping engine refuses requests
as unavailable, and only an idle engine sleeps."""

import pytest

from backend import LLM, SamplingParams
from backend.engine.engine_loop import EngineLoop
from backend.engine.errors import EngineSleepingError, InvalidRequestError
from backend.engine.sleep_mode import weight_slots
from tests.conftest import assert_pool_free, random_prompts
from tests.helpers.checkpoints import make_checkpoint

PROMPTS = random_prompts(4, [7, 30, 18, 45], seed=11)
GREEDY = SamplingParams(max_tokens=8, min_tokens=8, temperature=0)


@pytest.fixture(scope="module")
def base(ckpt_dir):
    return make_checkpoint(str(ckpt_dir / "llama"), "llama")


def tokens(llm, name=None):
    params = GREEDY if name is None else SamplingParams(max_tokens=8, min_tokens=8, temperature=0, lora_name=name)
    return [o.token_ids for o in llm.generate(PROMPTS, params)]


def kv_bytes(llm) -> int:
    return sum(t.untyped_storage().nbytes() for layer in llm.engine.runner.kv_caches for t in (layer.key, layer.value))


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_then_wake_up_gives_the_same_tokens(base, level):
    llm = LLM(base, block_size=4, num_kv_blocks=64)
    want = tokens(llm)
    full = kv_bytes(llm)
    llm.engine.sleep(level)
    assert kv_bytes(llm) == 0 and llm.engine.sleep_mode.is_sleeping
    weights = [getattr(m, attr, None) for _, m, _, attr in weight_slots(llm.engine.model)]
    if level == 2:              # (on CPU level 1 leaves the weights: they are in host memory already)
        assert all(w is None or w.numel() == 0 for w in weights)
    with pytest.raises(EngineSleepingError, match="wake it up"):
        llm.generate(PROMPTS[:1], GREEDY)
    llm.engine.wake_up()
    assert kv_bytes(llm) == full and not llm.engine.sleep_mode.is_sleeping
    assert tokens(llm) == want
    assert_pool_free(llm)


def test_level_2_with_lora_adapters(base, tmp_path):
    """The weights come back by name under LoRA's wrappers (their `.base`); the adapters'
    own slots stay."""
    from tests.helpers.adapters import make_adapter
    adapter = make_adapter(base, str(tmp_path / "a"), rank=4, alpha=8, seed=3)
    llm = LLM(base, block_size=4, num_kv_blocks=64, lora_modules={"a": adapter}, max_lora_rank=8)
    want = tokens(llm, "a"), tokens(llm)
    llm.engine.sleep(2)
    llm.engine.wake_up()
    assert (tokens(llm, "a"), tokens(llm)) == want


def test_with_the_host_tier(base):
    """Sleep resets the prefix cache, the host tier's included (one AllBlocksCleared in
    KV events); after wake_up the same tokens, the prompts computed again and kept again."""
    plain = LLM(base, block_size=4, num_kv_blocks=64)
    size = 128 * plain.engine.stats()["kv_cache_bytes"] // 64 / 2**30
    llm = LLM(base, block_size=4, num_kv_blocks=64, kv_offloading_size=size)
    want = tokens(llm)
    assert llm.engine.stats()["kv_offload_host_blocks_used"] > 0
    llm.engine.sleep(1)         # (the last step's saves run first)
    assert llm.engine.stats()["kv_offload_host_blocks_used"] == 0
    llm.engine.wake_up()
    hits = llm.engine.stats()["kv_offload_hit_blocks"]
    assert tokens(llm) == want
    assert llm.engine.stats()["kv_offload_hit_blocks"] == hits and llm.engine.stats()["kv_offload_host_blocks_used"]


def test_only_an_idle_engine_sleeps_and_a_sleeping_loop_refuses_requests(base):
    llm = LLM(base, block_size=4, num_kv_blocks=64)
    with pytest.raises(InvalidRequestError, match="level must be 1"):
        llm.engine.sleep(3)
    loop = EngineLoop(llm.engine).start()
    try:
        stream = loop.add_request(PROMPTS[0], SamplingParams(max_tokens=200, min_tokens=200, temperature=0), "busy")
        next(iter(stream))
        with pytest.raises(InvalidRequestError, match="unfinished request"):
            loop.call(lambda: llm.engine.sleep(1)).result(10)
        list(stream)
        loop.call(lambda: llm.engine.sleep(1)).result(10)
        refused = list(loop.add_request(PROMPTS[1], GREEDY, "asleep"))
        assert isinstance(refused[-1].error, EngineSleepingError)
        loop.call(llm.engine.wake_up).result(60)
        done = list(loop.add_request(PROMPTS[1], GREEDY, "awake"))
        assert done[-1].error is None and len([t for o in done for t in o.new_token_ids]) == 8
    finally:
        loop.stop()
    assert_pool_free(llm)


def test_level_2_with_fp8_weights_and_their_dequantized_caches(base, tmp_path):
    """Block-wise FP8 on CPU keeps a dequantized copy of each weight once used (a private
    cache): sleep drops it, and wake_up restores the FP8 weights and scales by name."""
    from tests.helpers.quant_checkpoints import write_fp8
    llm = LLM(write_fp8(base, str(tmp_path / "fp8"), block=(32, 32)), block_size=4, num_kv_blocks=64)
    want = tokens(llm)
    cached = [m for m in llm.engine.model.modules() if getattr(m, "_dequantized", None) is not None]
    assert cached                               # (the caches this test is about exist)
    llm.engine.sleep(2)
    assert all(m._dequantized is None for m in cached)
    llm.engine.wake_up()
    assert tokens(llm) == want


def test_level_2_with_int4_weights_in_the_kernel_layout(ckpt_dir, tmp_path):
    """GPTQ INT4 on the Triton kernel (the interpreter on CPU): its weights are re-packed
    for the blocked kernel at load, and wake_up's reloaded weights are packed the same way."""
    from backend.models.int_linear import IntLinear
    from tests.helpers import int_checkpoints as ic
    wide = make_checkpoint(str(ckpt_dir / "llama-int-sleep"), "llama", hidden_size=128, intermediate_size=256)
    llm = LLM(ic.write_gptq(wide, str(tmp_path / "gptq"), 4, 128, desc_act=False), block_size=4, num_kv_blocks=64,
              attention_backend="triton")
    assert all(m._blocked for m in llm.engine.model.modules() if isinstance(m, IntLinear))
    params = SamplingParams(max_tokens=3, min_tokens=3, temperature=0)
    want = [o.token_ids for o in llm.generate(PROMPTS[:2], params)]
    llm.engine.sleep(2)
    llm.engine.wake_up()
    assert [o.token_ids for o in llm.generate(PROMPTS[:2], params)] == want
    assert_pool_free(llm)
