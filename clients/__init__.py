"""Clients for the served model: gRPC streaming, benchmarks, server launcher."""

import os as _os
import sys as _sys

# As backend/__init__.py: OpenMP threads that sleep between parallel regions, and large
# tensors on transparent huge pages, set before a client (benchmarks/bench.py and others)
# imports torch ahead of the backend.
if "torch" not in _sys.modules:
    _os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    _os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
