"""Adapters loaded and unloaded while the engine serves (backend/engine/runtime_lora.py,
through EngineLoop as the Triton adapter drives it): outputs equal transformers + PEFT
after a load, an adapter in use is dropped only after its requests finish, a name loaded
again never reuses the old adapter's cached KV, and each kind of bad adapter is a clear
error while serving goes on."""

import json
import os
import shutil

import pytest

from backend import LLM, SamplingParams
from backend.engine.engine_loop import EngineLoop
from backend.engine.errors import InvalidRequestError
from backend.lora.adapter import LoRAConfigError
from backend.lora.manager import RuntimeLoRAError
from tests.conftest import assert_pool_free, random_prompts
from tests.helpers.adapters import make_adapter, peft_greedy
from tests.helpers.checkpoints import make_checkpoint

N = 8
PROMPT = random_prompts(1, [21], seed=7)[0]


@pytest.fixture(scope="module")
def base(ckpt_dir):
    return make_checkpoint(str(ckpt_dir / "llama"), "llama")


@pytest.fixture(scope="module")
def adapters(base, tmp_path_factory):
    root = tmp_path_factory.mktemp("runtime_loras")
    return {"a": make_adapter(base, str(root / "a"), rank=8, alpha=16, seed=11),
            "b": make_adapter(base, str(root / "b"), rank=4, alpha=8, targets=("q_proj", "v_proj"), seed=12),
            "too_big": make_adapter(base, str(root / "too_big"), rank=32, alpha=32, seed=13)}


@pytest.fixture(scope="module")
def reference(base, adapters):
    return {name: peft_greedy(base, adapters.get(name), [PROMPT], N)[0] for name in (None, "a", "b")}


def params(name=None, n=N):
    return SamplingParams(max_tokens=n, min_tokens=n, temperature=0, lora_name=name)


@pytest.fixture
def loop(base, adapters):
    llm = LLM(base, block_size=4, num_kv_blocks=64, max_num_seqs=4, enable_lora=True,
              lora_modules={"a": adapters["a"]}, max_loras=1, max_lora_rank=16)
    lp = EngineLoop(llm.engine).start()
    yield lp
    lp.stop()
    assert_pool_free(llm)


def tokens(stream):
    outs = list(stream)
    assert outs[-1].error is None, outs[-1].error
    return [t for o in outs for t in o.new_token_ids]


def test_load_while_streaming_equals_peft(loop, adapters, reference):
    """A long base-model stream runs while `b` is loaded; `b`'s request then equals PEFT's,
    and so do the base model's and `a`'s, in the same steps (max_loras=1: slots swap)."""
    long = loop.add_request(PROMPT, params(None, 40), "long")
    loop.add_lora("b", adapters["b"]).result(10)
    assert loop.engine.runtime_lora.listing() == {"loaded": ["a", "b"], "unloading": []}
    streams = {name: loop.add_request(PROMPT, params(name), f"r-{name}") for name in ("b", None, "a")}
    for name, stream in streams.items():
        assert tokens(stream) == reference[name], name
    assert tokens(long)[:N] == reference[None]


def test_unload_waits_for_its_requests(loop, adapters, reference):
    running = loop.add_request(PROMPT, params("a", 60), "running")
    first = next(iter(running))                     # it is in the engine
    assert loop.remove_lora("a").result(10) is False            # in use: dropped later
    refused = list(loop.add_request(PROMPT, params("a"), "late"))
    assert "LoRA a is being unloaded" in str(refused[-1].error)
    with pytest.raises(RuntimeLoRAError, match="being unloaded"):
        loop.add_lora("a", adapters["b"]).result(10)
    rest = tokens(running)
    assert (first.new_token_ids + rest)[:N] == reference["a"]   # ran to its end under the same weights
    listing = lambda: loop.call(loop.engine.runtime_lora.listing).result(10)     # noqa: E731 (on the engine thread)
    for _ in range(100):
        if listing()["unloading"] == []:
            break
    assert listing() == {"loaded": [], "unloading": []}
    manager = loop.engine.lora
    assert manager._free == [0] and not manager._host            # slot and host copy released
    late = list(loop.add_request(PROMPT, params("a"), "after"))
    assert "LoRA a is not supported" in str(late[-1].error)


def test_name_loaded_again_never_reuses_old_kv(loop, adapters, reference):
    """`a` computes the prompt's blocks; then `a` is unloaded and loaded again from `b`'s
    folder. The prefix cache holds the old `a`'s blocks for that prompt: the new `a` must
    not hit them (its own cache salt), so its tokens are `b`'s."""
    assert tokens(loop.add_request(PROMPT, params("a"), "old")) == reference["a"]
    assert loop.remove_lora("a").result(10) is True
    loop.add_lora("a", adapters["b"]).result(10)
    hits = loop.engine.kv_cache.prefix_cache_hit_tokens
    assert tokens(loop.add_request(PROMPT, params("a"), "new")) == reference["b"]
    assert loop.engine.kv_cache.prefix_cache_hit_tokens == hits


def test_bad_adapters_are_clear_errors(loop, adapters, reference, tmp_path):
    wrong_target = str(tmp_path / "wrong_target")
    shutil.copytree(adapters["b"], wrong_target)
    cfg_path = os.path.join(wrong_target, "adapter_config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    with open(cfg_path, "w") as f:
        json.dump({**cfg, "target_modules": ["q_proj", "lm_head"]}, f)
    no_weights = str(tmp_path / "no_weights")
    os.makedirs(no_weights)
    shutil.copy(os.path.join(adapters["b"], "adapter_config.json"), no_weights)
    def variant(name, config=None, weights=None):
        path = str(tmp_path / name)
        shutil.copytree(adapters["b"], path)
        if config is not None:
            with open(os.path.join(path, "adapter_config.json"), "w") as f:
                f.write(config if isinstance(config, str) else json.dumps({**cfg, **config}))
        if weights is not None:
            with open(os.path.join(path, "adapter_model.safetensors"), "wb") as f:
                f.write(weights)
        return path
    cases = {
        adapters["too_big"]: "field 'r' is 32, above max_lora_rank=16",
        wrong_target: "unknown target module 'lm_head' in field 'target_modules'",
        str(tmp_path / "missing"): "no adapter_config.json",
        no_weights: "no adapter_model.safetensors",
        variant("r0", {"r": 0}): "field 'r' must be a positive integer, not 0",
        variant("rnull", {"r": None}): "field 'r' must be a positive integer, not None",
        variant("alpha", {"lora_alpha": "big"}): "field 'lora_alpha' must be a number",
        variant("json", "{not json"): "adapter_config.json is not valid JSON",
        variant("corrupt", weights=b"\x00" * 40): "adapter_model.safetensors cannot be read",
    }
    stream = loop.add_request(PROMPT, params(None, 30), "meanwhile")
    for path, message in cases.items():
        with pytest.raises(LoRAConfigError, match=message):
            loop.add_lora("bad", path)
    with pytest.raises(RuntimeLoRAError, match="has already been loaded"):
        loop.add_lora("a", adapters["b"]).result(10)
    with pytest.raises(RuntimeLoRAError, match="cannot be found"):
        loop.remove_lora("nope").result(10)
    with pytest.raises(InvalidRequestError, match="'lora_path' must be"):
        loop.add_lora("x", "")
    assert tokens(stream)[:N] == reference[None]                 # serving went on
    assert loop.engine.runtime_lora.listing()["loaded"] == ["a"]


def test_offline_engine_and_disabled_lora(base, adapters, reference):
    llm = LLM(base, block_size=4, num_kv_blocks=64, enable_lora=True, max_lora_rank=16)
    llm.engine.add_lora("b", adapters["b"])
    assert llm.generate([PROMPT], params("b"))[0].token_ids == reference["b"]
    assert llm.engine.remove_lora("b") is True
    plain = LLM(base, block_size=4, num_kv_blocks=16)
    with pytest.raises(InvalidRequestError, match="needs the engine argument enable_lora"):
        plain.engine.add_lora("b", adapters["b"])
