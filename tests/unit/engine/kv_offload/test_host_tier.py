"""The host-memory KV tier (backend/engine/kv_offload/): a multi-turn conversation whose
history no longer fits the device pool gets its earlier turns' blocks back from host
memory instead of recomputing them, with greedy tokens equal to the run without the
tier, with and without async scheduling. Hits, saves and loads are counted, the host
pool stays within its bound, and every block goes back to the device pool."""

import pytest

from backend import LLM, SamplingParams
from backend.config import ConfigError
from backend.engine.kv_offload.host_tier import HostBlockIndex
from tests.conftest import assert_pool_free, random_prompts
from tests.helpers.checkpoints import make_checkpoint

BLOCK = 4
TURNS = 5
REPLY = 6


@pytest.fixture(scope="module")
def base(ckpt_dir):
    return make_checkpoint(str(ckpt_dir / "llama"), "llama")


def converse(llm, seed=0):
    """TURNS turns of one conversation (each prompt: the history so far, plus a new user
    message), with two unrelated prompts between turns that push its blocks out of the
    device pool. Returns the conversation's replies and each turn's cached tokens."""
    user = random_prompts(TURNS, [23, 17, 30, 9, 26], seed=seed)
    noise = random_prompts(2 * TURNS, [60, 64], seed=seed + 100)
    params = SamplingParams(max_tokens=REPLY, min_tokens=REPLY, temperature=0)
    history, replies, cached = [], [], []
    for turn in range(TURNS):
        history = history + user[turn]
        out = llm.generate([history], params)[0]
        replies.append(out.token_ids)
        cached.append(out.num_cached_tokens)
        history = history + out.token_ids
        llm.generate(noise[2 * turn:2 * turn + 2], params)
    return replies, cached


def engine(base, **kw):
    # 48 blocks of 4 tokens: the last turns' histories (100+ tokens) and the noise between
    # them do not fit together, so the conversation's early blocks are evicted.
    return LLM(base, block_size=BLOCK, num_kv_blocks=48, max_num_seqs=4, max_num_batched_tokens=64, **kw)


def bytes_per_block(llm) -> int:
    s = llm.engine.stats()
    return s["kv_cache_bytes"] // s["num_total_blocks"]


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_turns_reload_their_history_from_host_memory(base, async_scheduling):
    plain = engine(base, async_scheduling=async_scheduling)
    want, cached_without = converse(plain)
    size = 256 * bytes_per_block(plain) / 2**30
    tiered = engine(base, async_scheduling=async_scheduling, kv_offloading_size=size)
    got, cached_with = converse(tiered)
    assert got == want
    s = tiered.engine.stats()
    assert s["kv_offload_host_blocks"] == 256
    assert s["kv_offload_saved_blocks"] >= 40 and s["kv_offload_hit_blocks"] >= 15, s
    worker = tiered.engine.runner.kv_connector
    assert worker.num_loaded_blocks == s["kv_offload_hit_blocks"]
    # (the last step's blocks are saved by the next step that runs)
    assert worker.num_saved_blocks + tiered.engine.kv_cache.connector.num_pending_saves == s["kv_offload_saved_blocks"]
    # Without the tier the late turns recompute most of their history; with it, all but
    # the newest part comes back.
    # (here: [0, 28, 48, 84, 100] against [0, 28, 48, 52, 52])
    assert sum(cached_with) >= sum(cached_without) + 15 * BLOCK, (cached_with, cached_without)
    assert cached_with[-1] >= cached_without[-1] + 10 * BLOCK, (cached_with, cached_without)
    assert_pool_free(tiered)


def test_a_small_host_pool_stays_bounded_and_exact(base):
    plain = engine(base)
    want, _ = converse(plain, seed=3)
    tiered = engine(base, kv_offloading_size=6 * bytes_per_block(plain) / 2**30)
    got, _ = converse(tiered, seed=3)
    assert got == want
    s = tiered.engine.stats()
    assert s["kv_offload_host_blocks"] == 6 and s["kv_offload_host_blocks_used"] <= 6
    assert s["kv_offload_saved_blocks"] > 6             # slots were reused
    assert_pool_free(tiered)


def test_refused_where_it_cannot_work(base):
    with pytest.raises(ValueError, match="kv_offloading_size is not supported where enable_prefix_caching is false"):
        engine(base, kv_offloading_size=1.0, enable_prefix_caching=False)
    with pytest.raises(ConfigError, match="holds no block"):
        engine(base, kv_offloading_size=1e-12)


def test_index_evicts_least_recently_used_never_pinned():
    index = HostBlockIndex(2)
    a, _ = index.insert(b"a", None, (1, 2), set())
    b, _ = index.insert(b"b", b"a", (3, 4), set())
    assert index.find(b"a", None, (1, 2)) == a          # a is now the most recent
    assert index.find(b"a", None, (1, 9)) is None and index.find(b"b", None, (3, 4)) is None   # checked
    assert index.insert(b"c", None, (5, 6), set()) == (b, b"b") and b"b" not in index
    assert index.insert(b"d", None, (7, 8), pinned={a, b}) == (None, None)
    assert len(index) == 2


def request(rid, tokens):
    from backend.engine.request import Request
    return Request(rid, list(tokens), SamplingParams(max_tokens=1), 0.0, max_tokens=1)


def test_a_block_saved_and_reloaded_in_one_step_is_saved_first():
    """A's blocks are computed (their saves recorded); in the next schedule B's
    allocation evicts them from the device pool, and D, with A's prompt, finds them on
    the host. One step carries both copies: the saves must run before the loads, and the
    forward must wait for the saves (B writes the evicted blocks)."""
    import torch

    from backend.attention.metadata import KVCacheLayer
    from backend.engine.kv_offload.connector import KVTransfers
    from backend.engine.kv_offload.host_cache import HostKVCache
    from backend.engine.kv_offload.host_tier import HostOffloadScheduler
    from backend.engine.scheduling.kv_cache_manager import KVCacheManager
    kv = KVCacheManager(4, 2, True, connector=HostOffloadScheduler(8, 2))
    a = request("a", [1, 2, 3, 4, 5])
    assert kv.find_cached_blocks(a) == [] and kv.allocate_slots(a, 5)
    a.num_computed_tokens = 5
    kv.cache_computed_blocks(a)
    kv.free(a)
    b = request("b", range(10, 18))
    assert kv.allocate_slots(b, 8)                   # every block: A's are evicted
    kv.free(b)
    d = request("d", [1, 2, 3, 4, 5])
    hits = kv.find_cached_blocks(d)
    assert len(hits) == 2 and kv.allocate_slots(d, 1, hits)
    t = kv.take_transfers()
    assert {s for _, s in t.saves} == {h.location for h in hits} and t.wait_for_saves
    assert [s for s, _ in t.loads] == [h.location for h in hits]
    # The runner's side: a save and a load of one slot in one step.
    layer = KVCacheLayer(torch.zeros(3, 2, 1, 2), torch.zeros(3, 2, 1, 2))
    layer.key[0], layer.value[0] = 7.0, 8.0
    HostKVCache([layer], num_slots=2).start_transfers(KVTransfers(saves=[(0, 1)], loads=[(1, 2)]))
    assert (layer.key[2] == 7).all() and (layer.value[2] == 8).all()


def test_the_size_is_an_engine_argument_of_the_model_config_and_model_json(base, tmp_path):
    import json

    from backend.triton_server.serving_config import load_settings
    from backend.triton_server.vllm_model_json import read_model_json
    from builder.build import BuildOptions, engine_parameters
    opts = BuildOptions.create(checkpoint=base, output=str(tmp_path / "entry"), kv_offloading_size=2.5)
    params = {k: str(v) for k, v in engine_parameters(opts, base).items() if v is not None}
    assert load_settings(params, str(tmp_path))[0].kv_offloading_size == 2.5
    with pytest.raises(ConfigError, match="kv_offloading_size"):
        load_settings({**params, "kv_offloading_size": "-1"}, str(tmp_path))
    (tmp_path / "1").mkdir()
    (tmp_path / "1" / "model.json").write_text(json.dumps({"model": base, "kv_offloading_size": 4}))
    assert read_model_json(str(tmp_path), "1")[0]["kv_offloading_size"] == "4"
