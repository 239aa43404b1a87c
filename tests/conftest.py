import os
import random
import sys

# As backend/__init__.py: OpenMP threads that sleep between parallel regions (this
# process shares the 2 cores with the servers it starts), before anything imports torch.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402  (imports no triton)

# Without a usable CUDA device (none, or hidden by CUDA_VISIBLE_DEVICES), OpenAI Triton
# kernels run in its interpreter on CPU tensors, as tests/helpers/kernel_device.py
# places them. This must happen before anything imports triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from tests.helpers.checkpoints import make_checkpoint  # noqa: E402


def _share_the_gpu(fraction: float) -> None:
    """On a GPU, an engine a test leaves alive (two in one test, or one kept by a failed
    test's traceback) would hold the default 90% of the device and the next engine would
    be refused (sizing.check_startup_memory, as in vLLM): tests' engines default to a
    fraction that several can share. Tests that pass their own keep theirs."""
    from backend.config import EngineArgs
    EngineArgs.model_fields["gpu_memory_utilization"].default = fraction
    EngineArgs.model_rebuild(force=True)


if torch.cuda.is_available():
    _share_the_gpu(0.2)


@pytest.fixture(scope="session", autouse=True)
def _async_scheduling_on_the_cpu_as_on_cuda():
    """The engine runs its steps in series on the CPU unless async_scheduling is set
    (EngineArgs.async_scheduling_on). Engines made in this process still schedule ahead
    there by default, as they do on CUDA, so CI runs the async path in every test that
    leaves it unset (session-wide: module fixtures' engines included). Servers the tests
    start, and tests marked cpu_async_default, keep the engine's own default."""
    from backend.config import EngineArgs
    product = EngineArgs.async_scheduling_on
    patch = pytest.MonkeyPatch()
    patch.setattr(EngineArgs, "async_scheduling_on", lambda self, device_type: self.use_async_scheduling)
    yield product
    patch.undo()


@pytest.fixture(autouse=True)
def _cpu_async_default(request, monkeypatch, _async_scheduling_on_the_cpu_as_on_cuda):
    if "cpu_async_default" in request.keywords:
        from backend.config import EngineArgs
        monkeypatch.setattr(EngineArgs, "async_scheduling_on", _async_scheduling_on_the_cpu_as_on_cuda)


@pytest.fixture(scope="session")
def ckpt_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("ckpts")


@pytest.fixture(scope="session")
def llama_ckpt(ckpt_dir):
    return make_checkpoint(str(ckpt_dir / "llama"), "llama")


@pytest.fixture(scope="session")
def fp8_build(tiny_ckpt, tmp_path_factory):
    """An FP8 (weights and KV cache) model-repository entry of the default model."""
    from builder.build import BuildOptions, build
    out = tmp_path_factory.mktemp("fp8") / "llm"
    build(BuildOptions.create(checkpoint=tiny_ckpt, output=str(out), weights="fp8", kv_cache="fp8"),
          log=lambda *_: None, progress=False)
    return str(out)


@pytest.fixture(scope="session")
def trained_ckpt(ckpt_dir):
    """The trained reference model (default architecture), from the shipped weights."""
    from builder.train_tiny import build_trained
    return build_trained(str(ckpt_dir / "trained"))


@pytest.fixture(scope="session")
def tiny_ckpt(ckpt_dir):
    """The default model (real BPE tokenizer)."""
    from builder.tiny import build_tiny
    return build_tiny(str(ckpt_dir / "tiny"))


@pytest.fixture(scope="session")
def tiny_draft(ckpt_dir):
    """A smaller model with the default model's tokenizer (a draft for speculation)."""
    from builder.tiny import TinySpec, build_tiny
    return build_tiny(str(ckpt_dir / "tiny_draft"), TinySpec(hidden_size=64, intermediate_size=128,
                                                             num_hidden_layers=1, num_attention_heads=2,
                                                             num_key_value_heads=1, seed=3))


def random_prompts(n: int, lengths, vocab: int = 320, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(lengths[i % len(lengths)])] for i in range(n)]


def assert_pool_free(llm_or_engine) -> None:
    engine = getattr(llm_or_engine, "engine", llm_or_engine)
    stats = engine.stats()
    assert stats["num_free_blocks"] == stats["num_total_blocks"], stats
    assert all(b.ref_cnt == 0 for b in engine.kv_cache.pool.blocks)
