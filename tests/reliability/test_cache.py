"""Nothing silent in the caches: ``KVCache``, ``LatentCache``, windows and streaming.

* One entry, one writer: another layer at the same ``layer_idx`` (another encoding, sinks, another
  ``kv_lora_rank``) is refused by name, for ``KVCache`` and ``LatentCache`` alike; self- and
  cross-attention at one ``layer_idx`` keep separate entries; a cross-attention entry refuses
  another (or an edited) context; a batch change is refused; a cache of another type is named.
* Windows: a windowed layer's cache after eviction, with a ``key_padding_mask`` passed every step
  (the HF habit): cached decoding equals the full uncached forward, for ``MultiheadAttention`` and a
  ``TransformerLM`` with the ``gemma3`` window pattern; default positions count evicted tokens.
* ``rope:drop_rotation=eval``: an entry written in training mode is refused in eval mode
  (``KVCache`` and ``LatentCache``); a streaming cache keeps keys unrotated, so a mode change is
  served.

Expected values come from a fresh cache, a separate layer, or the full uncached forward.
"""

from __future__ import annotations

import pytest
import torch

import posenc

from ._helpers import E, _layer

# ---------------------------------------------------------------------------- one entry, one writer


def test_self_and_cross_attention_with_one_layer_idx_keep_separate_entries():
    """A decoder block's self- and cross-attention both at layer_idx=0 share one cache."""
    self_attn = _layer(causal=True)
    cross_attn = _layer("nope")
    x, ctx = torch.randn(1, 4, E), torch.randn(1, 6, E)
    shared = posenc.KVCache()
    self_attn(x, cache=shared)
    got = cross_attn(x, ctx, cache=shared)
    want = cross_attn(x, ctx, cache=posenc.KVCache())
    torch.testing.assert_close(got, want)
    assert shared.length(0, cross=False) == 4 and shared.length(0, cross=True) == 6


def test_a_cache_entry_serves_only_the_layer_that_wrote_it():
    rope, alibi = _layer("rope", causal=True), _layer("alibi", causal=True)
    cache = posenc.KVCache()
    rope(torch.randn(1, 3, E), cache=cache)
    with pytest.raises(
        ValueError, match=r"layer_idx=0 was written by MultiheadAttention\(.*'rope:.*own layer_idx"
    ):
        alibi(torch.randn(1, 1, E), cache=cache)
    sinks = _layer("rope", causal=True, sinks=True)
    with pytest.raises(ValueError, match="was written by"):
        sinks(torch.randn(1, 1, E), cache=cache)


def test_a_batch_change_mid_cache_is_refused():
    layer = _layer(causal=True)
    cache = posenc.KVCache()
    layer(torch.randn(2, 3, E), cache=cache)
    with pytest.raises(ValueError, match="holds a batch of 2, this call has 3"):
        layer(torch.randn(3, 1, E), cache=cache)


def test_cross_attention_cache_refuses_another_context():
    layer = _layer("nope")
    cache = posenc.KVCache()
    q, ctx = torch.randn(1, 2, E), torch.randn(1, 5, E)
    first = layer(q, ctx, cache=cache)
    torch.testing.assert_close(layer(q, ctx, cache=cache), first)  # the same context: served
    with pytest.raises(ValueError, match="keys of another context"):
        layer(q, torch.randn(1, 5, E), cache=cache)
    ctx.add_(1.0)  # edited in place: its keys in the cache are stale
    with pytest.raises(ValueError, match="keys of another context"):
        layer(q, ctx, cache=cache)


def test_cache_must_be_a_kv_cache():
    with pytest.raises(ValueError, match=r"cache must be a posenc\.KVCache"):
        _layer(causal=True)(torch.randn(1, 2, E), cache={})


# ---------------------------------------------------------------------------- LatentCache


MLA = dict(kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=4)


def _mla(**overrides):
    return posenc.MultiLatentAttention(16, 2, **{**MLA, **overrides}).eval()


def test_latent_cache_refuses_another_layer_with_the_same_layer_idx():
    writer, reader = _mla(), _mla()
    x = torch.randn(2, 5, 16)
    cache = posenc.LatentCache()
    writer(x[:, :4], cache=cache)
    with pytest.raises(
        ValueError,
        match=r"layer_idx=0 was written by MultiLatentAttention\(layer_idx=0, heads=2, kv_lora_rank=8.*own layer_idx",
    ):
        reader(x[:, 4:], cache=cache)
    # The reader with its own cache equals its full forward: the entry it was refused was not its own.
    own = posenc.LatentCache()
    reader(x[:, :4], cache=own)
    torch.testing.assert_close(reader(x[:, 4:], cache=own), reader(x)[:, 4:], rtol=1e-5, atol=1e-5)


def test_latent_cache_refuses_a_layer_with_another_kv_lora_rank_and_a_batch_change():
    writer = _mla()
    cache = posenc.LatentCache()
    writer(torch.randn(2, 4, 16), cache=cache)
    with pytest.raises(
        ValueError, match=r"written by MultiLatentAttention\(.*kv_lora_rank=8.*kv_lora_rank=6"
    ):
        _mla(kv_lora_rank=6)(torch.randn(2, 1, 16), cache=cache)
    with pytest.raises(ValueError, match=r"holds a batch of 2, this call has 3; use a fresh LatentCache"):
        writer(torch.randn(3, 1, 16), cache=cache)


# ---------------------------------------------------------------------------- windows and padding


def _no_padding(batch: int, length: int) -> torch.Tensor:
    return torch.zeros(batch, length, dtype=torch.bool)


def test_issue_snippet_windowed_cache_then_a_padding_mask_equals_the_full_forward():
    """11 steps without a mask evict 8 keys; the 12th step, with an all-False mask, is at position 11."""
    attn = posenc.MultiheadAttention(32, 4, "rope", causal=True, window=4).eval()
    x = torch.randn(2, 12, 32)
    full = attn(x)[:, 11]
    cache = posenc.KVCache()
    for t in range(11):
        attn(x[:, t : t + 1], cache=cache)
    assert cache.get(0).evicted == 8  # the case under test: keys were evicted
    got = attn(x[:, 11:], cache=cache, key_padding_mask=_no_padding(2, 1))[:, 0]
    torch.testing.assert_close(got, full, rtol=1e-5, atol=1e-5)


def test_default_positions_after_eviction_count_the_evicted_tokens_whatever_the_mask():
    attn = posenc.MultiheadAttention(32, 4, "rope", causal=True, window=4).eval()
    cache = posenc.KVCache()
    x = torch.randn(2, 11, 32)
    for t in range(11):
        attn(x[:, t : t + 1], cache=cache)
    want = torch.tensor([[11], [11]])  # the 12th token of each sequence
    for mask in (None, _no_padding(2, 1), _no_padding(2, 4)):  # none, the new token's, every held key's
        got = attn.default_positions(2, 1, mask, cache)
        assert torch.equal(got.expand(2, 1), want), mask


@pytest.mark.parametrize("mask_from", [0, 6])
def test_windowed_layer_decoding_with_a_padding_mask_every_step_equals_the_full_forward(mask_from):
    """The mask passed at every step (with left padding from step 0; all False from step 6, after
    the cache has evicted keys): each step equals the uncached forward with the whole mask."""
    attn = posenc.MultiheadAttention(32, 4, "rope", causal=True, window=4).eval()
    length = 12
    x = torch.randn(2, length, 32)
    padding = _no_padding(2, length)
    if mask_from == 0:
        padding[1, :3] = True  # row 1 is left-padded by 3
    full = attn(x, key_padding_mask=padding)
    cache = posenc.KVCache()
    for t in range(length):
        mask = padding[:, t : t + 1] if t >= mask_from else None
        got = attn(x[:, t : t + 1], cache=cache, key_padding_mask=mask)
        real = ~padding[:, t]
        torch.testing.assert_close(got[real, 0], full[real, t], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mask_from", [0, 6])
def test_gemma3_window_pattern_decoding_with_a_padding_mask_equals_the_full_forward(mask_from):
    model = posenc.TransformerLM(50, 32, 6, 4, pattern="gemma3:window=4").eval()
    assert [block.attn.window for block in model.blocks] == [4, 4, 4, 4, 4, None]
    length = 12
    tokens = torch.randint(0, 50, (2, length))
    padding = _no_padding(2, length)
    if mask_from == 0:
        padding[1, :2] = True
    full = model(tokens, key_padding_mask=padding)
    cache = posenc.KVCache()
    for t in range(length):
        mask = padding[:, t : t + 1] if t >= mask_from else None
        got = model(tokens[:, t : t + 1], cache=cache, key_padding_mask=mask)
        real = ~padding[:, t]
        torch.testing.assert_close(got[real, 0], full[real, t], rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------- drop_rotation=eval and streaming


def test_a_cache_written_in_training_mode_is_refused_in_eval_mode_with_drop_rotation():
    layer = posenc.MultiheadAttention(16, 2, "rope:drop_rotation=eval", causal=True)
    x = torch.randn(2, 5, 16)
    cache = posenc.KVCache()
    layer.train()(x[:, :4], cache=cache)
    layer.eval()
    with pytest.raises(ValueError, match=r"written with rotation.*drop_rotation='eval'.*fresh KVCache"):
        layer(x[:, 4:], cache=cache)
    fresh = posenc.KVCache()  # written and read in eval mode: equals the full eval forward
    layer(x[:, :4], cache=fresh)
    torch.testing.assert_close(layer(x[:, 4:], cache=fresh), layer(x)[:, 4:], rtol=1e-5, atol=1e-5)
    layer.train()
    with pytest.raises(ValueError, match="written without rotation"):
        layer(x[:, 4:], cache=fresh)


def test_a_latent_cache_written_in_training_mode_is_refused_in_eval_mode_with_drop_rotation():
    layer = _mla(rope="rope:drop_rotation=eval")
    cache = posenc.LatentCache()
    layer.train()(torch.randn(1, 4, 16), cache=cache)
    with pytest.raises(ValueError, match=r"written with rotation.*fresh LatentCache"):
        layer.eval()(torch.randn(1, 1, 16), cache=cache)


def test_a_streaming_cache_keeps_keys_unrotated_so_a_mode_change_is_served():
    """StreamingLLM stores keys unrotated and rotates them at every step in the current mode."""
    layer = posenc.MultiheadAttention(16, 2, "rope:drop_rotation=eval", causal=True)
    x = torch.randn(1, 6, 16)
    mixed, evaluated = (
        posenc.KVCache(recent_tokens=3, sink_tokens=1),
        posenc.KVCache(recent_tokens=3, sink_tokens=1),
    )
    layer.train()
    for t in range(5):
        layer(x[:, t : t + 1], cache=mixed)
    layer.eval()
    for t in range(5):
        layer(x[:, t : t + 1], cache=evaluated)
    torch.testing.assert_close(layer(x[:, 5:], cache=mixed), layer(x[:, 5:], cache=evaluated), rtol=0, atol=0)
