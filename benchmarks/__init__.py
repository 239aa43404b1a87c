"""Benchmarks, measurements and device scripts: what the project's figures come from
(docs/archive/benchmarks.md). Apart from `clients/`, the tools users run against a served model."""

import os as _os
import sys as _sys

# As backend/__init__.py: OpenMP threads that sleep between parallel regions, and large
# tensors on transparent huge pages, set before a benchmark imports torch ahead of the backend.
if "torch" not in _sys.modules:
    _os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    _os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
