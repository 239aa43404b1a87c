"""backend/engine/kv_offload/host_cache.py on the CPU: the host pool's shape and bound, and
the copies of a step's KVTransfers (saves, then loads, in place), per layer, for K and V."""

import torch

from backend.attention.metadata import KVCacheLayer
from backend.engine.kv_offload.connector import KVTransfers
from backend.engine.kv_offload.host_cache import HostKVCache


def _layers(num_layers=2, num_blocks=4, block_size=2, heads=1, head_dim=3, dtype=torch.float32):
    """Layers whose every block holds distinct values (layer, K or V, block)."""
    out = []
    for i in range(num_layers):
        shape = (num_blocks, block_size, heads, head_dim)
        key = torch.stack([torch.full(shape[1:], 100.0 * i + b) for b in range(num_blocks)]).to(dtype)
        value = torch.stack([torch.full(shape[1:], 100.0 * i + 50 + b) for b in range(num_blocks)]).to(dtype)
        out.append(KVCacheLayer(key, value))
    return out


def test_the_host_pool_is_one_buffer_of_exactly_its_slots():
    layers = _layers(num_layers=3, dtype=torch.bfloat16)
    cache = HostKVCache(layers, num_slots=5)
    block_bytes = layers[0].key[0].numel() * layers[0].key.element_size()
    assert cache._buffer.numel() == 2 * 3 * 5 * block_bytes             # K and V of every layer, no rounding
    assert len(cache.host) == 3
    for host_k, host_v in cache.host:
        assert host_k.shape == host_v.shape == (5, *layers[0].key.shape[1:])
        assert host_k.dtype == torch.bfloat16
        assert host_k.untyped_storage().data_ptr() == cache._buffer.untyped_storage().data_ptr()


def test_saved_blocks_come_back_into_other_blocks_per_layer_for_k_and_v():
    layers = _layers()
    expected = [(layer.key.clone(), layer.value.clone()) for layer in layers]
    cache = HostKVCache(layers, num_slots=3)
    cache.start_transfers(KVTransfers(saves=[(1, 2), (3, 0)]))
    for layer in layers:                    # the device blocks are reused meanwhile
        layer.key.zero_()
        layer.value.zero_()
    cache.start_transfers(KVTransfers(loads=[(2, 0), (0, 2)]))
    for (key, value), layer in zip(expected, layers):
        assert torch.equal(layer.key[0], key[1]) and torch.equal(layer.value[0], value[1])
        assert torch.equal(layer.key[2], key[3]) and torch.equal(layer.value[2], value[3])
        assert not layer.key[1].any() and not layer.key[3].any()     # nothing else written
    assert (cache.num_saved_blocks, cache.num_loaded_blocks) == (2, 2)


def test_a_step_without_transfers_copies_nothing():
    layers = _layers()
    before = [layer.key.clone() for layer in layers]
    cache = HostKVCache(layers, num_slots=2)
    cache.start_transfers(None)
    cache.start_transfers(KVTransfers())
    assert all(torch.equal(b, layer.key) for b, layer in zip(before, layers))
    assert not cache._buffer.any()
    assert (cache.num_saved_blocks, cache.num_loaded_blocks) == (0, 0)


def test_a_slot_saved_again_holds_the_newer_block():
    layers = _layers(num_layers=1)
    cache = HostKVCache(layers, num_slots=1)
    cache.start_transfers(KVTransfers(saves=[(0, 0)]))
    cache.start_transfers(KVTransfers(saves=[(3, 0)], loads=[(0, 1)]))     # saves run first
    assert torch.equal(layers[0].key[1], layers[0].key[3])
    assert torch.equal(layers[0].value[1], layers[0].value[3])
