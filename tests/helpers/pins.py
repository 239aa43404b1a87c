"""Tests whose expectations were established with the pinned versions of a package
(requirements/cpu.txt) skip, saying so, where another version is installed (a GPU
image, say), rather than failing for a reason that is not the project's. Seen on the H100 image's
transformers 5.17 (2026-11-27): its Gemma 2, Phi-3 and gpt-oss references give other
greedy tokens than 5.23's on the same checkpoints, on CPU as on CUDA (its Gemma 2 output
does not change when the attention soft-cap is removed)."""

from __future__ import annotations

import importlib.metadata
import os
import re

import pytest

REQUIREMENTS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                            "requirements", "cpu.txt")


def pinned_versions() -> dict[str, str]:
    pins = {}
    with open(REQUIREMENTS) as f:
        for line in f:
            m = re.match(r"^\s*([A-Za-z0-9_.\-]+)(?:\[[^\]]*\])?==([^\s#;]+)", line)
            if m:
                pins[m.group(1).lower()] = m.group(2)
    return pins


def require_pinned(*names: str) -> None:
    pins = pinned_versions()
    for name in names:
        try:
            installed = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pytest.skip(f"{name} is not installed (pinned: {pins[name]}, requirements/cpu.txt)")
        if installed != pins[name]:
            pytest.skip(f"{name} {installed} is installed; this test's expectations hold for the pinned "
                        f"{pins[name]} (requirements/cpu.txt)")
