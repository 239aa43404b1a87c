"""Building our C++ CPU kernels (backend/ops/cpu_build.py): compiled once and cached,
a private folder when the cache folder cannot be written, no foreign call on traced
tensors."""

import os
import time

import torch

from backend.attention import cpu_decode
from backend.ops import cpu_argmax, cpu_build, cpu_layer_ops  # noqa: F401  (each defines its library)


def test_built_once_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGED_LLM_CACHE_DIR", str(tmp_path))
    first = cpu_build.build(cpu_decode.SOURCE, "g++")
    mtime = os.stat(first).st_mtime_ns
    assert cpu_build.build(cpu_decode.SOURCE, "g++") == first and os.stat(first).st_mtime_ns == mtime
    assert os.listdir(tmp_path) == [os.path.basename(first)]          # no temporary file left


def test_a_build_removes_the_librarys_week_old_versions_only(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGED_LLM_CACHE_DIR", str(tmp_path))
    month_ago = time.time() - 30 * 24 * 3600
    old, recent, other = (tmp_path / n for n in ("cpu_decode-00000000.so", "cpu_decode-11111111.so",
                                                  "cpu_layer_ops-22222222.so"))
    for f in (old, recent, other):
        f.write_bytes(b"x")
    os.utime(old, (month_ago, month_ago))
    os.utime(other, (month_ago, month_ago))
    built = cpu_build.build(cpu_decode.SOURCE, "g++")
    assert sorted(os.listdir(tmp_path)) == sorted([os.path.basename(built), recent.name, other.name])
    assert cpu_build.prune(str(tmp_path), "cpu_decode", keep=built, now=time.time() + 8 * 24 * 3600) == \
        [str(recent)]                                               # a week on: the new build stays
    assert os.path.exists(built)


def test_unwritable_cache_folder_falls_back_to_a_private_temporary_folder(tmp_path, monkeypatch):
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    monkeypatch.setenv("PAGED_LLM_CACHE_DIR", str(blocked / "cache"))    # cannot be made
    import tempfile
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    private = cpu_build.cache_dir()
    assert private == str(tmp_path / f"paged_llm-{os.getuid()}")
    assert os.stat(private).st_mode & 0o077 == 0
    assert os.path.dirname(cpu_build.build(cpu_decode.SOURCE, "g++")) == private
    # A folder there that others may write is not used: a fresh private one is.
    os.chmod(private, 0o777)
    other = cpu_build.cache_dir()
    assert other != private and os.path.dirname(other) == str(tmp_path)


def test_traced_tensors_are_not_plain():
    from torch._subclasses.fake_tensor import FakeTensorMode
    x = torch.zeros(2)
    assert cpu_build.plain_tensors(x, torch.nn.Parameter(torch.zeros(2), requires_grad=False))
    with FakeTensorMode():
        fake = torch.zeros(2)
    assert not cpu_build.plain_tensors(x, fake)


def test_an_engine_on_the_cpu_builds_every_library_while_it_loads(tmp_path, monkeypatch, llama_ckpt):
    """Not in its first step: a fresh machine's compile (seconds) there would trip the
    stall watchdog of a served engine (CI's first server did)."""
    from backend import LLM
    monkeypatch.setenv("PAGED_LLM_CACHE_DIR", str(tmp_path))
    for library in cpu_build.LIBRARIES:
        monkeypatch.setattr(library, "_loaded", {})
    names = {os.path.basename(library.source_path).split(".")[0] for library in cpu_build.LIBRARIES}
    assert names >= {"cpu_decode", "cpu_argmax", "cpu_layer_ops"}
    LLM(llama_ckpt, dtype="float32", num_kv_blocks=16)
    assert {f.split("-")[0] for f in os.listdir(tmp_path)} == names
    assert all(library._loaded for library in cpu_build.LIBRARIES)
