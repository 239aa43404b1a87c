"""The composition root (backend/engine/assembly.py): each part gets its collaborators
when it is constructed. Neither the assembly nor the engine assigns an attribute of
another object (nothing injected after construction), and an engine with a draft
model, n-gram speculation and structured output hands each part what it needs."""

import ast
import pathlib

import pytest

from backend import LLM
from backend.engine.spec_decode.speculator import Speculator
from tests.helpers.checkpoints import make_checkpoint

ROOT = pathlib.Path(__file__).resolve().parents[3]
FILES = ("backend/engine/assembly.py", "backend/engine/llm_engine.py")


def _assigned_attributes(tree: ast.AST):
    for node in ast.walk(tree):
        targets = (node.targets if isinstance(node, ast.Assign)
                   else [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
        stack = list(targets)
        while stack:
            t = stack.pop()
            if isinstance(t, (ast.Tuple, ast.List)):
                stack.extend(t.elts)
            elif isinstance(t, ast.Attribute):
                yield t


@pytest.mark.parametrize("path", FILES)
def test_no_attribute_of_another_object_is_assigned(path):
    tree = ast.parse((ROOT / path).read_text())
    injected = [f"{path}:{t.lineno} {ast.unparse(t)}" for t in _assigned_attributes(tree)
                if not (isinstance(t.value, ast.Name) and t.value.id == "self")]
    assert not injected, injected


@pytest.mark.parametrize("method", ["draft_model", "ngram"])
def test_parts_get_their_collaborators_at_construction(ckpt_dir, method):
    path = make_checkpoint(str(ckpt_dir / "llama"), "llama")
    spec = {"method": method, "num_speculative_tokens": 3, **({"model": path} if method == "draft_model" else {})}
    engine = LLM(path, block_size=8, num_kv_blocks=64, speculative_config=spec).engine
    scheduler, runner, speculator = engine.scheduler, engine.runner, engine.speculator
    assert scheduler.structured is not None and not hasattr(runner, "structured")    # (bitmasks come per step)
    assert scheduler.may_speculate == Speculator.can_speculate
    if method == "draft_model":
        assert runner.drafter is speculator.proposer and scheduler.num_lookahead_tokens == 3
    else:
        assert runner.drafter is None and scheduler.num_lookahead_tokens == 0
