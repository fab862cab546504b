"""The KV cache (posenc.cache.kv_cache): ``KVCache(max_length=N)`` and ``LatentCache(max_length=N)``
preallocated and equal to the growing cache for every registered encoding; a windowed layer's cache keeps
only what the window sees; a streaming cache keeps sinks and a window."""

from __future__ import annotations

import pytest
import torch

import posenc
from _contract import EMBED, HEADS, _randomize, _x, make_encoding
from _patterns import EMBED as PATTERN_EMBED
from _patterns import _layer
from posenc.cache.kv_cache import CacheFullError, TimeAxis
from posenc.layers.mla import LatentCache, MultiLatentAttention


@pytest.mark.parametrize("name", ["rope", "alibi", "t5", "shaw", "learned", "fire"])
def test_windowed_layer_cache_keeps_only_what_the_window_sees(name):
    layer = _layer(name, window=4)
    x = torch.randn(2, 19, PATTERN_EMBED, dtype=torch.float64)
    full = layer(x)
    cache, pieces = posenc.KVCache(), []
    for a, b in ((0, 6), (6, 7), (7, 8), (8, 13), (13, 19)):
        pieces.append(layer(x[:, a:b], cache=cache))
        assert cache.length(0) <= 3  # window - 1: all the next query can see
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, rtol=1e-7, atol=1e-9)


@pytest.mark.parametrize("name", ["rope", "alibi", "t5", "shaw", "nope"])
def test_streaming_cache_keeps_sinks_and_a_window_with_positions_inside_the_cache(name):
    """StreamingLLM: once tokens are evicted, each step equals a full pass over the kept tokens
    (sinks, then the window, then the new token) at positions 0, 1, ... of the cache."""
    sinks, window = 2, 5
    layer = _layer(name)
    x = torch.randn(1, 30, PATTERN_EMBED, dtype=torch.float64)
    cache = posenc.KVCache(recent_tokens=window, sink_tokens=sinks)
    prompt = 4
    out = layer(x[:, :prompt], cache=cache)
    torch.testing.assert_close(out, layer(x[:, :prompt]))  # nothing evicted yet: the plain pass
    for t in range(prompt, 30):
        step = layer(x[:, t : t + 1], cache=cache)
        kept = torch.cat([x[:, : min(sinks, t)], x[:, max(sinks, t - window) : t + 1]], dim=1)
        torch.testing.assert_close(step, layer(kept)[:, -1:], rtol=1e-7, atol=1e-9)
        assert cache.length(0) <= sinks + window  # memory O(sinks + window)


def test_streaming_cache_refuses_what_it_cannot_honour():
    cache = posenc.KVCache(recent_tokens=4, sink_tokens=1)
    with pytest.raises(ValueError, match="positions: a streaming KVCache"):
        _layer("rope")(
            torch.randn(1, 2, PATTERN_EMBED, dtype=torch.float64), positions=torch.arange(2), cache=cache
        )
    with pytest.raises(ValueError, match="'learned' adds absolute positions"):
        _layer("learned")(torch.randn(1, 2, PATTERN_EMBED, dtype=torch.float64), cache=cache)
    with pytest.raises(ValueError, match="recent_tokens must be a positive int"):
        posenc.KVCache(recent_tokens=0)
    with pytest.raises(ValueError, match="sink_tokens needs recent_tokens"):
        posenc.KVCache(sink_tokens=2)


def test_kvcache_window_is_refused_naming_recent_tokens():
    """``window`` is a layer's sliding-window mask only; the cache's StreamingLLM retention is
    ``recent_tokens``, and the old name is refused with the new one."""
    with pytest.raises(TypeError, match=r"recent_tokens=.*window= is a layer's sliding-window mask"):
        posenc.KVCache(window=4, sink_tokens=1)
    with pytest.raises(TypeError, match="unexpected keyword argument 'windows'"):
        posenc.KVCache(windows=4)
    assert posenc.KVCache(recent_tokens=4, sink_tokens=1).streaming


# ----------------------------------------------------------------------------
# ``KVCache(max_length=N)`` and ``LatentCache(max_length=N)``: preallocated, written in place, and equal to
# the growing cache.


NAMES = posenc.available()


def _cache_layer(name: str, **kwargs) -> posenc.MultiheadAttention:
    layer = posenc.MultiheadAttention(EMBED, HEADS, encoding=make_encoding(name), causal=True, **kwargs)
    _randomize(layer)
    return layer.eval()


def _decode(layer, x, cache, chunks, **kw) -> list[torch.Tensor]:
    outs, start = [], 0
    with torch.no_grad():
        for size in chunks:
            outs.append(layer(x[:, start : start + size], cache=cache, **kw))
            start += size
    return outs


def _assert_same_steps(static: list[torch.Tensor], growing: list[torch.Tensor], exact: bool = True) -> None:
    """Bit for bit; ``exact=False``: to 1e-6, for backends whose matmuls read the strided views of
    the buffers through another BLAS path than contiguous keys (a different summation order)."""
    assert len(static) == len(growing)
    for step, (a, b) in enumerate(zip(static, growing, strict=True)):
        if exact:
            assert torch.equal(a, b), f"step {step}: max |diff| {(a - b).abs().max().item():.3g}"
        else:
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=lambda m, step=step: f"step {step}: {m}")


def _views_of_buffers(cache: posenc.KVCache, layer_idx: int = 0) -> bool:
    entry = cache.get(layer_idx)
    return entry.axes is not None and entry.k.untyped_storage().data_ptr() == (
        entry.axes["k"].buffer.untyped_storage().data_ptr()
    )


@pytest.mark.parametrize("name", NAMES)
def test_every_encoding_decodes_the_same_through_a_preallocated_cache(name):
    torch.manual_seed(0)
    layer = _cache_layer(name)
    x = _x(2, 12)
    chunks = [5, 1, 1, 3, 1, 1]
    growing = _decode(layer, x, posenc.KVCache(), chunks)
    cache = posenc.KVCache(max_length=16)
    exact = posenc.get_class(name).kind is not posenc.Kind.CONTENT
    _assert_same_steps(_decode(layer, x, cache, chunks), growing, exact)
    assert cache.length(0) == 12
    assert _views_of_buffers(cache), "the entry's keys are not views of the preallocated buffer"


@pytest.mark.parametrize("name", ["rope", "alibi", "t5", "nope", "fire"])
@pytest.mark.parametrize("window", [1, 3, 6])
def test_windowed_layer_slides_and_compacts_like_the_growing_cache(name, window):
    """A window of W keeps W - 1 keys: the view slides along the buffer and is copied back to the
    front when it reaches the end; a prompt longer than the buffer keeps its tail."""
    torch.manual_seed(1)
    layer = _cache_layer(name, window=window)
    x = _x(2, 40)
    chunks = [9] + [1] * 25 + [2, 4]  # the 9-token prompt exceeds max_length = 8
    growing_cache = posenc.KVCache()
    growing = _decode(layer, x, growing_cache, chunks)
    cache = posenc.KVCache(max_length=8)
    _assert_same_steps(_decode(layer, x, cache, chunks), growing)
    assert cache.length(0) == growing_cache.length(0) == window - 1
    assert cache.get(0).evicted == growing_cache.get(0).evicted
    assert cache.get(0).axes["k"].buffer.shape[2] == 8  # never reallocated


@pytest.mark.parametrize("name", ["rope", "alibi", "nope"])
def test_gqa_padding_and_odd_sizes(name):
    torch.manual_seed(2)
    layer = _cache_layer(name, num_kv_heads=1)
    x = _x(3, 13)
    padding = torch.zeros(3, 13, dtype=torch.bool)
    padding[1, :4] = True  # left padding of one row
    padding[2, :1] = True
    chunks = [7, 1, 1, 1, 1, 2]

    def run(cache):
        outs, start = [], 0
        with torch.no_grad():
            for size in chunks:
                mask = padding[:, : start + size]
                outs.append(layer(x[:, start : start + size], cache=cache, key_padding_mask=mask))
                start += size
        return outs

    cache = posenc.KVCache(max_length=13)
    _assert_same_steps(run(cache), run(posenc.KVCache()))
    assert cache.get(0).k.shape == (3, 1, 13, EMBED // HEADS)


@pytest.mark.parametrize("name", ["rope", "alibi", "t5", "sinusoidal", "nope"])
@pytest.mark.parametrize("window", [1, 3, 6])
@pytest.mark.parametrize("max_length", [None, 8])
@pytest.mark.parametrize("mask_form", ["every token", "new tokens"])
def test_windowed_layer_with_left_padding_keeps_only_its_window(name, window, max_length, mask_form):
    """A padding mask no longer makes a windowed cache keep every key: padded keys leave with their
    window, their real tokens are counted, and each step equals the full forward (no cache) at the
    real positions, whether the mask covers every token so far or only the new ones."""
    torch.manual_seed(5)
    layer = _cache_layer(name, window=window)
    x = _x(3, 30)
    padding = torch.zeros(3, 30, dtype=torch.bool)
    padding[1, :3] = True  # left padding, longer than some windows
    padding[2, :7] = True
    with torch.no_grad():
        full = layer(x, key_padding_mask=padding)
    cache = posenc.KVCache(max_length=max_length)
    outs, start = [], 0
    with torch.no_grad():
        for size in [9] + [1] * 19 + [2]:
            mask = (
                padding[:, : start + size] if mask_form == "every token" else padding[:, start : start + size]
            )
            outs.append(layer(x[:, start : start + size], cache=cache, key_padding_mask=mask))
            assert cache.length(0) <= max(window - 1, 0) or start == 0
            start += size
    cached = torch.cat(outs, dim=1)
    real = ~padding
    torch.testing.assert_close(cached[real], full[real], rtol=1e-5, atol=1e-5)
    assert cache.length(0) == window - 1
    # The next token's position counts every real token so far, evicted ones included.
    seen = real.sum(dim=1)
    assert layer.default_positions(3, 1, torch.zeros(3, 1, dtype=torch.bool), cache).flatten().tolist() == (
        seen.tolist()
    )


@pytest.mark.parametrize("name", ["rope", "alibi", "t5"])
@pytest.mark.parametrize("sinks", [0, 2])
def test_streaming_sinks_and_recent_tokens(name, sinks):
    torch.manual_seed(3)
    layer = _cache_layer(name)
    x = _x(2, 30)
    chunks = [6] + [1] * 20 + [3, 1]
    growing = _decode(layer, x, posenc.KVCache(recent_tokens=4, sink_tokens=sinks), chunks)
    cache = posenc.KVCache(recent_tokens=4, sink_tokens=sinks, max_length=sinks + 5)
    _assert_same_steps(_decode(layer, x, cache, chunks), growing)
    assert cache.length(0) == sinks + 4


def test_cross_attention_through_a_preallocated_cache():
    torch.manual_seed(4)
    layer = _cache_layer("rope")
    layer.causal = False
    x, context = _x(2, 5), _x(2, 9)
    with torch.no_grad():
        expected = [layer(x[:, i : i + 1], context, cache=posenc.KVCache()) for i in range(5)]
        cache = posenc.KVCache(max_length=4)  # cross-attention entries are written once, whole
        got = [layer(x[:, i : i + 1], context, cache=cache) for i in range(5)]
    _assert_same_steps(got, expected)


def test_mla_latent_cache_preallocated():
    torch.manual_seed(5)
    mla = MultiLatentAttention(
        64, 4, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, causal=True
    ).eval()
    x = torch.randn(2, 11, 64)
    chunks = [4, 1, 1, 2, 3]
    growing = _decode(mla, x, LatentCache(), chunks)
    cache = LatentCache(max_length=11)
    _assert_same_steps(_decode(mla, x, cache, chunks), growing)
    entry = cache.get(0)
    assert (
        entry.latent.untyped_storage().data_ptr() == entry.axes["latent"].buffer.untyped_storage().data_ptr()
    )
    with pytest.raises(CacheFullError, match=r"max_length=11\) is full"), torch.no_grad():
        mla(x[:, :1], cache=cache)
    # in-place writes refuse gradients and another dtype, as KVCache(max_length) does
    with pytest.raises(ValueError, match=r"LatentCache\(max_length=4\) writes in place.*torch.no_grad"):
        mla(x[:, :2], cache=LatentCache(max_length=4))
    half = LatentCache(max_length=4)
    with torch.no_grad():
        mla(x[:, :2], cache=half)
        with pytest.raises(
            ValueError, match=r"holds torch.float32 latents but this call writes torch.float64"
        ):
            mla.double()(x[:, 2:3].double(), cache=half)


def test_full_cache_grad_dtype_and_window_errors_name_the_fix():
    torch.manual_seed(6)
    layer = _cache_layer("rope")
    x = _x(1, 6)
    cache = posenc.KVCache(max_length=5)
    with torch.no_grad():
        layer(x[:, :5], cache=cache)
        with pytest.raises(CacheFullError, match=r"max_length=5\) is full.*adds 1"):
            layer(x[:, 5:], cache=cache)
    with pytest.raises(ValueError, match=r"in place.*torch.no_grad"):
        layer(x, cache=posenc.KVCache(max_length=8))
    with torch.no_grad():
        cache = posenc.KVCache(max_length=8)
        layer(x[:, :2], cache=cache)
        with pytest.raises(ValueError, match=r"float32 keys.*float64"):
            layer.double()(x[:, 2:3].double(), cache=cache)
        layer.float()
        windowed = _cache_layer("rope", window=6)
        short = posenc.KVCache(max_length=5)
        windowed(x[:, :5], cache=short)  # fits: no window trimmed yet
        with pytest.raises(ValueError, match=r"window=6.*max_length >= the window"):
            windowed(x[:, 5:6], cache=short)
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="max_length must be a positive int"):
            posenc.KVCache(max_length=bad)
    with pytest.raises(ValueError, match="must exceed sink_tokens \\+ recent_tokens"):
        posenc.KVCache(recent_tokens=4, sink_tokens=1, max_length=5)


def test_time_axis_keeps_order_through_slides_compactions_and_evictions():
    """The buffer against a plain list of steps (an independent model of the same sequence)."""
    axis = TimeAxis(torch.tensor([[0.0, 1.0]]), dim=1, capacity=5)
    model = [0.0, 1.0]
    for step in range(2, 30):
        if step % 7 == 0:
            axis.keep(1, 2)
            model = model[:1] + model[-2:]
        elif len(model) >= 4:
            axis.drop_front(2)
            model = model[2:]
        axis.append(torch.tensor([[float(step)]]))
        model.append(float(step))
        assert axis.view().flatten().tolist() == model
        assert axis.buffer.shape[1] == 5
    with pytest.raises(CacheFullError):
        axis.append(torch.zeros(1, 5))


def test_static_decode_step_reads_no_concatenated_cache(monkeypatch):
    """A decode step through KVCache(max_length=N) never calls torch.cat on the cached keys."""
    layer = _cache_layer("rope")
    x = _x(1, 40)
    cache = posenc.KVCache(max_length=64)
    with torch.no_grad():
        layer(x[:, :32], cache=cache)
        seen = []
        real_cat = torch.cat

        def spy(tensors, *args, **kwargs):
            seen.append(max(t.numel() for t in tensors))
            return real_cat(tensors, *args, **kwargs)

        monkeypatch.setattr(torch, "cat", spy)
        for i in range(32, 40):
            layer(x[:, i : i + 1], cache=cache)
    cached_numel = 32 * EMBED // HEADS
    assert not [n for n in seen if n >= cached_numel], seen
