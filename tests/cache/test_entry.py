"""One layer's cache entry (posenc.cache.entry): a write at a slot sets its length."""

from __future__ import annotations

import pytest
import torch

import posenc
from _contract import EMBED, HEADS, _randomize, make_encoding


def _layer(name: str, **kwargs) -> posenc.MultiheadAttention:
    layer = posenc.MultiheadAttention(EMBED, HEADS, encoding=make_encoding(name), causal=True, **kwargs)
    _randomize(layer)
    return layer.eval()


def _prefilled(layer, prompt, max_length):
    cache = posenc.KVCache(max_length=max_length)
    with torch.no_grad():
        layer(prompt, cache=cache)
    return cache


def test_a_cache_entry_writes_at_a_slot_and_sets_its_length():
    layer = _layer("rope")
    cache = _prefilled(layer, torch.randn(2, 3, EMBED), 8)
    entry = cache.get(0)
    k_buffer, v_buffer, pos_buffer = entry.buffers()
    assert k_buffer.shape[2] == v_buffer.shape[2] == pos_buffer.shape[1] == 8 and entry.first_slot == 0
    k, v = torch.randn(2, 2, HEADS, 1, EMBED // HEADS).unbind(0)
    k, v = k.expand(2, -1, -1, -1), v.expand(2, -1, -1, -1)
    with torch.no_grad():
        entry.write_at(torch.tensor(3), k, v, torch.full((2, 1), 3))
    assert entry.k.shape[2] == 3  # written, not yet live
    torch.testing.assert_close(k_buffer[:, :, 3:4], k)
    entry.finite.finite = True
    entry.set_length(4)
    assert entry.k.shape[2] == cache.length(0) == 4 and not entry.finite.finite
    torch.testing.assert_close((entry.k[:, :, 3:], entry.v[:, :, 3:]), (k, v))
    assert entry.k_pos[:, 3].tolist() == [3, 3]
    with pytest.raises(ValueError, match=r"set_length: length must be an int in \[0, 8\]"):
        entry.set_length(9)
    grown = posenc.KVCache()
    with torch.no_grad():
        layer(torch.randn(1, 3, EMBED), cache=grown)
    assert grown.get(0).buffers() is None
    with pytest.raises(ValueError, match=r"write_at: the entry has no preallocated buffers"):
        grown.get(0).write_at(torch.tensor(3), k[:1], v[:1], torch.full((1, 1), 3))
