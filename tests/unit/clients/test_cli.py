"""clients/cli.py's entry cache without a server: one build for two starts at once, a
failed build leaves nothing reused, the key follows the files, options and versions,
and names and exposure are checked before anything is built."""

import os
import threading
import time

import pytest

from clients import cli


@pytest.fixture()
def folder(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGED_LLM_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "Model-1B"
    path.mkdir()
    (path / "config.json").write_text("{}")
    return str(path)


def fake_build(calls, fail=False):
    def build(opts, log=None):
        calls.append(opts.output)
        time.sleep(0.2)
        if fail:
            raise ValueError("invalid build option 'max_model_len': too large")
        os.makedirs(opts.output)
        open(os.path.join(opts.output, "config.pbtxt"), "w").close()
    return build


def test_two_starts_at_once_build_once(folder, monkeypatch):
    calls = []
    monkeypatch.setattr("builder.build.build", fake_build(calls))
    repos = []
    threads = [threading.Thread(target=lambda: repos.append(cli.ensure_entry(folder, "m", {}, log=lambda *_: None)))
               for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and repos[0] == repos[1]
    assert os.path.isfile(os.path.join(repos[0], "m", "config.pbtxt"))
    assert [n for n in os.listdir(os.path.dirname(repos[0])) if n.startswith(".building")] == []


def test_a_failed_build_leaves_nothing_to_reuse(folder, monkeypatch):
    calls = []
    monkeypatch.setattr("builder.build.build", fake_build(calls, fail=True))
    with pytest.raises(ValueError):
        cli.ensure_entry(folder, "m", {}, log=lambda *_: None)
    monkeypatch.setattr("builder.build.build", fake_build(calls))
    cli.ensure_entry(folder, "m", {}, log=lambda *_: None)
    assert len(calls) == 2


def test_the_key_follows_files_options_and_versions(folder, monkeypatch):
    key = cli.entry_key(folder, {"max_model_len": 512})
    assert key != cli.entry_key(folder, {"max_model_len": 1024})
    monkeypatch.setattr("backend.build_manifest.BACKEND_VERSION", "9.9.9")
    assert key != cli.entry_key(folder, {"max_model_len": 512})
    monkeypatch.undo()
    with open(os.path.join(folder, "config.json"), "a") as f:
        f.write(" ")
    assert key != cli.entry_key(folder, {"max_model_len": 512})


@pytest.mark.parametrize("argv, words", [
    (["--served-model-name", "org/model"], "letters, digits"),
    (["--host", "0.0.0.0"], "set API_KEY"),
])
def test_refused_before_anything_is_built(folder, argv, words, monkeypatch, capsys):
    monkeypatch.delenv("API_KEY", raising=False)
    monkeypatch.setattr("builder.build.build", lambda *a, **k: pytest.fail("built"))
    assert cli.main(["serve", folder, *argv]) == 2
    assert words in capsys.readouterr().err


def test_a_folder_name_becomes_the_model_name():
    assert cli.served_name("./Llama-3.2-1B/") == "Llama-3.2-1B" and cli.served_name("/a/b c") == "b-c"


def test_speculative_config_reaches_the_build(folder, monkeypatch):
    """vLLM's `--speculative-config` (JSON, or the builder's shorthand) is a build option,
    and part of the cache key."""
    seen = []

    def build(opts, log=None):
        seen.append(opts.speculative)
        os.makedirs(opts.output)
        open(os.path.join(opts.output, "config.pbtxt"), "w").close()
    monkeypatch.setattr("builder.build.build", build)
    monkeypatch.setattr("clients.tritonserver.main", lambda argv: 0)
    assert cli.main(["serve", folder, "--speculative-config",
                     '{"method": "ngram", "num_speculative_tokens": 3}']) == 0
    assert cli.main(["serve", folder, "--speculative-config", "ngram:2"]) == 0
    assert [(s.method, s.num_speculative_tokens) for s in seen] == [("ngram", 3), ("ngram", 2)]


def test_trtllm_models_are_written_in_front_under_a_key_of_their_own(folder, monkeypatch):
    """--trtllm-models (what `make serve` passes): TensorRT-LLM's three models in front of
    the entry, in a cached repository of their own, reused by the next start."""
    calls = []
    monkeypatch.setattr("builder.build.build", fake_build(calls))
    plain = cli.ensure_entry(folder, "llm", {}, log=lambda *_: None)
    fronted = cli.ensure_entry(folder, "llm", {}, log=lambda *_: None, trtllm_models=True)
    assert fronted != plain and len(calls) == 2
    assert sorted(os.listdir(fronted)) == ["ensemble", "llm", "tensorrt_llm", "tensorrt_llm_bls"]
    assert sorted(os.listdir(plain)) == ["llm"]
    assert 'value: { string_value: "llm" }' in open(os.path.join(fronted, "ensemble", "config.pbtxt")).read()
    assert cli.ensure_entry(folder, "llm", {}, log=lambda *_: None, trtllm_models=True) == fronted and len(calls) == 2


def test_a_served_name_of_a_trtllm_model_is_refused(folder, monkeypatch, capsys):
    monkeypatch.setattr("builder.build.build", lambda *a, **k: pytest.fail("built"))
    assert cli.main(["serve", folder, "--trtllm-models", "--served-model-name", "ensemble"]) == 2
    assert "TensorRT-LLM models" in capsys.readouterr().err


def test_the_launchers_options_pass_through_without_a_path(folder, monkeypatch):
    """`make serve` passes the launcher's options (--http-port 8000, --tool-call-parser
    hermes) with no PATH: their values are never taken for one."""
    seen = []

    def ensure_entry(path, name, options, log=None, trtllm_models=False):
        seen.append((path, name, trtllm_models))
        raise ValueError("stop here")
    monkeypatch.setattr(cli, "trained_checkpoint", lambda: folder)
    monkeypatch.setattr(cli, "ensure_entry", ensure_entry)
    assert cli.main(["serve", "--trtllm-models", "--http-port", "8000", "--tool-call-parser", "hermes"]) == 2
    assert seen == [(folder, "llm", True)]
