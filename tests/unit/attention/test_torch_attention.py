"""The torch path's paged-block gather: the same values into a buffer reused from call to
call (fresh CPU tensors of this size are page-faulted in on every step)."""

import torch

from backend.attention.torch_attention import _gather


def test_gather_into_reused_buffer_equals_fresh_gather():
    g = torch.Generator().manual_seed(0)
    cache = torch.randn(40, 4, 2, 8, generator=g)
    tables = torch.randint(0, 40, (3, 5), generator=g)
    fresh = _gather(cache, tables, 1.0, torch.float32)
    reused = _gather(cache, tables, 1.0, torch.float32, slot=0)
    assert fresh.shape == reused.shape == (3, 20, 2, 8)
    assert torch.equal(fresh, reused) and torch.equal(fresh[1, 4:8], cache[tables[1, 1]])
    again = _gather(cache, tables[:2], 1.0, torch.float32, slot=0)     # a smaller batch: same buffer
    assert again.data_ptr() == reused.data_ptr() and torch.equal(again, fresh[:2])


def test_buffer_made_during_inference_serves_calls_outside_it():
    """An engine step (inference_mode) may create the buffer; exports and direct model
    calls then gather outside inference_mode into the same buffer."""
    import threading
    result = {}

    def run():   # a fresh thread: a fresh workspace, first made inside inference_mode
        cache = torch.randn(30, 4, 2, 8)
        tables = torch.randint(0, 30, (2, 3))
        with torch.inference_mode():
            _gather(cache, tables, 1.0, torch.float32, slot=0)
        result["out"] = _gather(cache, tables, 1.0, torch.float32, slot=0).clone()
        result["ref"] = _gather(cache, tables, 1.0, torch.float32)
    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert torch.equal(result["out"], result["ref"])
