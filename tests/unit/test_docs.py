"""The documentation site (mkdocs.yml, docs/): it builds with `mkdocs build --strict`
(a broken link or a page left out of the navigation fails), its generated references
are what tools/docs_reference.py writes from the code now (an engine argument added
without a meaning in backend/config_help.py fails), and the README stays short."""

import os
import subprocess
import sys

import pytest
from pydantic import BaseModel

from tools import docs_reference

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_the_generated_references_are_current():
    assert docs_reference.main(["--check"]) == 0, "run: python -m tools.docs_reference"


def test_an_engine_argument_without_a_meaning_fails_the_reference():
    from backend.config import EngineArgs
    from backend.config_help import ENGINE_ARGS

    class WithANewArgument(EngineArgs):
        new_knob: int = 3
    with pytest.raises(SystemExit, match="no meaning for \\['new_knob'\\]"):
        docs_reference._table(WithANewArgument, ENGINE_ARGS)
    assert "| `block_size` | int | `16` | >= 1, <= 1024 |" in "\n".join(docs_reference._table(EngineArgs, ENGINE_ARGS))

    class Plain(BaseModel):
        a: int = 1
    with pytest.raises(SystemExit, match="meaning of no field \\['b'\\]"):
        docs_reference._table(Plain, {"a": "x", "b": "y"})


def test_the_site_builds_strictly(tmp_path):
    out = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(tmp_path / "site")],
                         cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert out.returncode == 0, out.stdout + out.stderr
    assert (tmp_path / "site" / "reference" / "configuration" / "index.html").is_file()
    assert (tmp_path / "site" / "archive" / "benchmarks" / "index.html").is_file()     # built, not in the nav


def test_the_readme_is_short_and_links_into_the_docs():
    lines = open(os.path.join(ROOT, "README.md")).read().splitlines()
    assert len(lines) <= 150, len(lines)
    text = "\n".join(lines)
    for page in ("docs/getting-started.md", "docs/reference/configuration.md", "docs/status.md"):
        assert f"({page})" in text and os.path.isfile(os.path.join(ROOT, page))
