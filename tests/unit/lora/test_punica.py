"""SGMV shrink/expand: the torch reference against a dense per-row computation, and the
Triton kernel (interpreter on CPU) against the reference, on a batch that mixes slots,
base-model rows, ranks below max_lora_rank and a column slice of the output."""

import pytest
import torch

from backend.lora import punica
from backend.ops import lora_triton
from tests.helpers.kernel_device import KERNEL_DEVICE


def batch(seed=0, S=4, R=16, K=48, N=40, T=23, device=torch.device("cpu")):
    """Slots 0-2 in use (slot 3 holds an adapter no row runs under)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, K, generator=g)
    a = torch.randn(S, R, K, generator=g)
    b = torch.randn(S, N, R, generator=g)
    a[1, 4:] = 0                                    # slot 1 holds a rank-4 adapter
    b[1, :, 4:] = 0
    slots = [2, -1, 0, 1, -1, 2, 0]                 # per request; -1: the base model
    sizes = [5, 3, 1, 7, 2, 4, 1]
    meta = punica.LoRAMetadataBuilder(64, S, device).build(slots, sizes)
    token_slots = [s for s, n in zip(slots, sizes) for _ in range(n)]
    scaling = torch.tensor([0.5, 2.0, 1.25, 3.0])
    return x, a, b, meta, token_slots, scaling


def dense(x, a, b, token_slots, scaling, base):
    out = base.clone()
    for t, s in enumerate(token_slots):
        if s >= 0:
            out[t] += (x[t] @ a[s].t()) @ b[s].t() * scaling[s]
    return out


def test_metadata_groups_rows_by_slot():
    *_, meta, token_slots, _ = batch()
    rows = meta.sorted_rows.tolist()
    starts = meta.slot_starts_cpu
    assert starts == meta.slot_starts.tolist() == [0, 2, 9, 18, 18]
    assert meta.active_slots.tolist() == [0, 1, 2]
    assert meta.row_active.tolist() == token_slots          # all three in use: index = slot
    one = punica.LoRAMetadataBuilder(16, 4, torch.device("cpu")).build([3, -1, 3], [2, 1, 1])
    assert one.active_slots.tolist() == [3] and one.row_active.tolist() == [0, 0, -1, 0]
    for s in range(3):
        group = rows[starts[s]:starts[s + 1]]
        assert group == sorted(group) and all(token_slots[r] == s for r in group)
    assert sorted(rows) == [t for t, s in enumerate(token_slots) if s >= 0]
    assert meta.max_rows_per_slot == 9
    assert punica.LoRAMetadataBuilder(8, 2, torch.device("cpu")).build([-1, -1], [3, 1]) is None


@pytest.mark.parametrize("impl", ["torch-grouped", "torch-all-slots", "triton"])
def test_shrink_expand_equal_dense(impl, monkeypatch):
    """torch-grouped: per slot (prefill-sized steps); torch-all-slots: every slot in two
    GEMMs (decode-sized steps)."""
    monkeypatch.setattr(punica, "DENSE_MAX_ROWS", 0 if impl == "torch-grouped" else 64)
    monkeypatch.setattr(punica, "DENSE_MIN_ADAPTERS", 1)
    dev = KERNEL_DEVICE if impl == "triton" else torch.device("cpu")   # compiled on a GPU, interpreted on CPU
    x, a, b, meta, token_slots, scaling = batch(device=dev)
    b = b.permute(1, 0, 2).contiguous().permute(1, 0, 2)     # as LoRALinear stores B: [N, S, R] underneath
    shrink, expand = (lora_triton.shrink, lora_triton.expand) if impl == "triton" else (
        punica.shrink_torch, punica.expand_torch)
    base = torch.randn(x.shape[0], 100)
    cols = slice(30, 70)                            # the slice of a fused projection's output
    out = base.clone().to(dev)
    y = torch.full((x.shape[0], a.shape[1]), float("nan"), device=dev)     # base rows are never read
    shrink(x.to(dev), a.to(dev), meta, y)
    expand(y, b.to(dev), meta, out[:, cols], scaling.to(dev), scaling.tolist())
    out = out.cpu()
    want = base.clone()
    want[:, cols] = dense(x, a, b, token_slots, scaling, base[:, cols])
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-4)
    base_rows = [t for t, s in enumerate(token_slots) if s < 0]
    assert torch.equal(out[base_rows], base[base_rows])    # untouched, bit for bit


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("slice_sizes", [[16, 8, 24], [40, 8]])
def test_expand_of_a_fused_projections_slices_in_one_call(impl, slice_sizes):
    """qkv_proj's q, k, v (or gate/up) in one expand: slice i adds y's columns
    [i R, (i + 1) R) times its rows of B into its own columns only (the Triton kernel
    reads every slice's B as zeros outside its slice); equal to one expand per slice."""
    dev = KERNEL_DEVICE if impl == "triton" else torch.device("cpu")
    S, R, N, T = 4, 16, sum(slice_sizes), 23
    x, _, _, meta, token_slots, scaling = batch(device=dev)
    g = torch.Generator().manual_seed(7)
    y = torch.randn(T, len(slice_sizes) * R, generator=g)
    b = torch.randn(N, S, R, generator=g).permute(1, 0, 2)         # [S, N, R] over [N, S, R], as LoRALinear
    base = torch.randn(T, N + 5, generator=g)
    out = base.clone().to(dev)
    expand = lora_triton.expand if impl == "triton" else punica.expand_torch
    expand(y.to(dev), b.to(dev), meta, out[:, :N], scaling.to(dev), scaling.tolist(), slice_sizes)
    want, off = base.clone(), 0
    for i, n in enumerate(slice_sizes):
        for t, s in enumerate(token_slots):
            if s >= 0:
                want[t, off:off + n] += y[t, i * R:(i + 1) * R] @ b[s, off:off + n].t() * scaling[s]
        off += n
    torch.testing.assert_close(out.cpu(), want, rtol=1e-5, atol=1e-5)
    assert torch.equal(out.cpu()[:, N:], base[:, N:])
