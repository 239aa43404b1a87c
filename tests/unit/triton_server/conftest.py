import importlib
import sys

import pytest

from tests.helpers import fake_pb_utils

ADAPTER_MODULES = ("backend.triton_server.errors", "backend.triton_server.metrics",
                   "backend.triton_server.response_writer", "backend.triton_server.trtllm_front")


@pytest.fixture
def stub(monkeypatch):
    """A fake stub (tests/helpers/fake_pb_utils.py) as `triton_python_backend_utils`, and
    the adapter's modules imported against it; both gone after the test."""
    stub = fake_pb_utils.Stub()
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", fake_pb_utils.install(stub))
    for name in ADAPTER_MODULES:
        monkeypatch.delitem(sys.modules, name, raising=False)
    stub.modules = {name.rsplit(".", 1)[1]: importlib.import_module(name) for name in ADAPTER_MODULES}
    yield stub
    for name in ADAPTER_MODULES:
        sys.modules.pop(name, None)
