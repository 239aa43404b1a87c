"""`python -m builder default` (what `make serve` and `make bench` run): the trained
reference model for `--trained`, the random-weight one without, an entry kept when it
is already the one asked for and rebuilt when it is the other."""

import json
import os

from builder.__main__ import DEFAULT_CHECKPOINT, TRAINED_CHECKPOINT, main


def built_from(repo) -> str:
    with open(os.path.join(repo, "llm", "build_manifest.json")) as f:
        return os.path.abspath(json.load(f)["options"]["checkpoint"])


def test_the_default_entry_follows_what_is_asked(tmp_path, capsys):
    repo = str(tmp_path / "repo")
    assert main(["default", "--trained", "--repository", repo]) == 0
    assert built_from(repo) == os.path.abspath(TRAINED_CHECKPOINT)
    for name in ("ensemble", "tensorrt_llm_bls", "tensorrt_llm"):
        assert os.path.isfile(os.path.join(repo, name, "config.pbtxt"))
    capsys.readouterr()
    assert main(["default", "--trained", "--repository", repo]) == 0
    assert capsys.readouterr().out.strip().endswith("exists")
    assert main(["default", "--repository", repo]) == 0                # the random one, rebuilt in place
    assert built_from(repo) == os.path.abspath(DEFAULT_CHECKPOINT)
