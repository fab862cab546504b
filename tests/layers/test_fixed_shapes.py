"""Fixed-shape decoding (``KVCache.fixed_shapes()``, the slots plan of ``posenc.layers.step``): one-token
steps written at their slots of a preallocated cache equal the layer's own decoding.

Expected values come from the layer itself through a growing ``KVCache()`` (the eager reference
path, which the contract tests hold equal to a full forward). Every registered encoding is either
served and equal, or refused with a reason.
"""

from __future__ import annotations

import pytest
import torch

import posenc
from _contract import EMBED, HEADS, _randomize, make_encoding
from posenc.layers.step import PATTERN_READS, SERVES

NAMES = posenc.available()


def _layer(name: str, **kwargs) -> posenc.MultiheadAttention:
    layer = posenc.MultiheadAttention(EMBED, HEADS, encoding=make_encoding(name), causal=True, **kwargs)
    _randomize(layer)
    return layer.eval()


def _served(name: str) -> bool:
    enc = make_encoding(name)
    return enc.kind is not posenc.Kind.CONTENT and not enc.input_dependent


def _prefilled(layer, prompt, max_length):
    cache = posenc.KVCache(max_length=max_length)
    with torch.no_grad():
        layer(prompt, cache=cache)
    return cache


@pytest.mark.parametrize("name", NAMES)
def test_every_encoding_is_served_exactly_or_refused(name):
    torch.manual_seed(0)
    layer = _layer(name, num_kv_heads=1)
    prompt, xs = torch.randn(2, 7, EMBED), torch.randn(6, 2, 1, EMBED)
    cache = _prefilled(layer, prompt, 16)
    if not _served(name):
        refused = r"fixed_shapes\(\): .*(computes logits|token states)"
        with torch.no_grad(), pytest.raises(ValueError, match=refused), cache.fixed_shapes():
            layer(xs[0], cache=cache)  # (the block refuses an entry with token states as it opens)
        return
    reference = posenc.KVCache()
    with torch.no_grad():
        layer(prompt, cache=reference)
        with cache.fixed_shapes():
            for x in xs:
                want = layer(x, cache=reference)
                torch.testing.assert_close(layer(x, cache=cache), want, rtol=1e-5, atol=1e-5)
        # the layer goes on eagerly after the block, from the same cache
        assert cache.length(0) == reference.length(0) == 13
        x = torch.randn(2, 2, EMBED)
        torch.testing.assert_close(layer(x, cache=cache), layer(x, cache=reference), rtol=1e-5, atol=1e-5)


def test_nan_propagates_and_the_written_slot_holds_it():
    torch.manual_seed(1)
    layer = _layer("rope")
    cache = _prefilled(layer, torch.randn(1, 5, EMBED), 12)
    with torch.no_grad(), cache.fixed_shapes():
        bad = torch.randn(1, 1, EMBED)
        bad[0, 0, 3] = float("nan")
        assert torch.isnan(layer(bad, cache=cache)).all()
        # the nan key and value are now cached: the next token's attention reads them
        assert torch.isnan(layer(torch.randn(1, 1, EMBED), cache=cache)).all()
        cache.rewind(5)  # forget both: finite again
        assert torch.isfinite(layer(torch.randn(1, 1, EMBED), cache=cache)).all()


def test_rewind_replays_the_same_outputs_and_a_full_cache_is_refused():
    torch.manual_seed(2)
    layer = _layer("alibi")
    cache = _prefilled(layer, torch.randn(1, 4, EMBED), 7)
    xs = torch.randn(4, 1, 1, EMBED)
    with torch.no_grad(), cache.fixed_shapes():
        first = [layer(x, cache=cache) for x in xs[:3]]
        cache.rewind(4)
        again = [layer(x, cache=cache) for x in xs[:3]]
        assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
        with pytest.raises(posenc.cache.CacheFullError, match="max_length=7\\) is full"):
            layer(xs[3], cache=cache)
        for bad in (-1, 8, 2.0, True):
            with pytest.raises(ValueError, match="rewind: length must be an int in"):
                cache.rewind(bad)
    with pytest.raises(ValueError, match=r"rewind\(\) works inside fixed_shapes\(\) only"):
        cache.rewind(4)


@pytest.mark.parametrize(
    ("build", "reason"),
    [
        (lambda: _layer("rope", window=4), "layers with window=4 are not served"),
        (lambda: _layer("rope", sinks=True), "layers with sinks=True are not served"),
    ],
)
def test_layers_it_cannot_serve_are_refused_with_the_reason(build, reason):
    layer = build()
    cache = _prefilled(layer, torch.randn(1, 3, EMBED), 9)
    with torch.no_grad(), cache.fixed_shapes(), pytest.raises(ValueError, match=reason):
        layer(torch.randn(1, 1, EMBED), cache=cache)


@pytest.mark.parametrize(
    ("cache", "reason"),
    [
        (lambda: posenc.KVCache(), r"KVCache\(max_length=N\)"),
        (lambda: posenc.KVCache(recent_tokens=4, max_length=9), "non-streaming"),
    ],
)
def test_caches_it_cannot_serve_are_refused_with_the_reason(cache, reason):
    layer, kv = _layer("rope"), cache()
    with torch.no_grad():
        layer(torch.randn(1, 3, EMBED), cache=kv)
    with pytest.raises(ValueError, match=reason), kv.fixed_shapes():
        pass


def test_padding_an_empty_cache_and_a_nested_block_are_refused():
    layer = _layer("rope")
    empty = posenc.KVCache(max_length=8)
    with pytest.raises(ValueError, match="holds no self-attention entry"), empty.fixed_shapes():
        pass
    padded = posenc.KVCache(max_length=8)
    with torch.no_grad():
        layer(torch.randn(1, 3, EMBED), cache=padded, key_padding_mask=torch.tensor([[True, False, False]]))
    with (
        pytest.raises(ValueError, match=r"layer_idx=0 cannot be decoded .*padding or document ids"),
        padded.fixed_shapes(),
    ):
        pass
    cache = _prefilled(layer, torch.randn(1, 3, EMBED), 8)
    with cache.fixed_shapes(), pytest.raises(ValueError, match="already inside"), cache.fixed_shapes():
        pass


def test_a_layer_the_cache_did_not_hold_when_the_block_opened_is_refused():
    layer, other = _layer("rope"), _layer("rope", layer_idx=1)
    cache = _prefilled(layer, torch.randn(1, 3, EMBED), 8)
    with torch.no_grad(), cache.fixed_shapes(), pytest.raises(ValueError, match="run the prompt through it"):
        other(torch.randn(1, 1, EMBED), cache=cache)
    twin = _layer("rope")  # the same layer_idx, another layer: it must not write the entry
    with torch.no_grad(), cache.fixed_shapes(), pytest.raises(ValueError, match="was written by"):
        twin(torch.randn(1, 1, EMBED), cache=cache)


def test_one_graph_serves_every_position():
    """The layer itself, traced by dynamo with fullgraph=True once: no recompilation as the slot moves."""
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    torch.manual_seed(3)
    layer = _layer("rope", num_kv_heads=1)
    prompt, xs = torch.randn(1, 6, EMBED), torch.randn(5, 1, 1, EMBED)
    cache, reference = _prefilled(layer, prompt, 16), posenc.KVCache()
    counter = CompileCounter()
    compiled = torch.compile(layer, backend=counter, fullgraph=True)
    with torch.no_grad():
        layer(prompt, cache=reference)
        with cache.fixed_shapes():
            for x in xs:
                want = layer(x, cache=reference)
                torch.testing.assert_close(compiled(x, cache=cache), want, rtol=1e-5, atol=1e-5)
    assert counter.frame_count == 1


def test_steps_of_layers_with_other_scales_and_caps_compile_in_one_process():
    """Dynamo makes a float dynamic once it compiled a second value of it: the request's check of the
    scale (and of the cap) then met a symbolic float and broke the graph (math.isfinite); the docs'
    decoding example failed after any other compiled step had run in the process."""
    torch._dynamo.reset()
    torch.manual_seed(4)
    for head_dim, cap in ((8, None), (16, 30.0), (32, 50.0)):
        layer = posenc.MultiheadAttention(head_dim * 2, 2, "rope", causal=True, softcap=cap).eval()
        prompt, xs = torch.randn(1, 5, head_dim * 2), torch.randn(3, 1, 1, head_dim * 2)
        cache, reference = _prefilled(layer, prompt, 16), posenc.KVCache()
        compiled = torch.compile(layer, backend="eager", fullgraph=True)
        with torch.no_grad():
            layer(prompt, cache=reference)
            with cache.fixed_shapes():
                for x in xs:
                    want = layer(x, cache=reference)
                    torch.testing.assert_close(compiled(x, cache=cache), want, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["rope", "alibi", "t5", "sinusoidal"])
def test_inductor_compiled_step_equals_the_layer(name):
    torch._dynamo.reset()
    torch.manual_seed(4)
    layer = _layer(name)
    prompt, xs = torch.randn(1, 6, EMBED), torch.randn(4, 1, 1, EMBED)
    cache, reference = _prefilled(layer, prompt, 12), posenc.KVCache()
    compiled = torch.compile(layer, fullgraph=True)
    with torch.no_grad():
        layer(prompt, cache=reference)
        with cache.fixed_shapes():
            for x in xs:
                want = layer(x, cache=reference)
                torch.testing.assert_close(compiled(x, cache=cache), want, rtol=1e-5, atol=1e-5)


def test_a_layer_whose_dtype_changed_is_refused_not_cast():
    layer = _layer("rope")
    cache = _prefilled(layer, torch.randn(1, 3, EMBED), 8)
    layer.double()
    with (
        torch.no_grad(),
        cache.fixed_shapes(),
        pytest.raises(ValueError, match=r"holds torch.float32 keys but the layer now makes torch.float64"),
    ):
        layer(torch.randn(1, 1, EMBED, dtype=torch.float64), cache=cache)


# A prompt at explicit positions: one row shifted, one spaced out (row 0: 100..104, row 1: 0, 3, ..., 12)
PROMPT_POSITIONS = torch.stack([torch.arange(100, 105), torch.arange(0, 15, 3)])


def _continued(positions: torch.Tensor, new: int) -> torch.Tensor:
    """``positions [B, T]`` then ``new`` more per row, each one after the row's last."""
    after = positions[:, -1:] + torch.arange(1, new + 1)
    return torch.cat([positions, after], dim=1)


@pytest.mark.parametrize("name", ["rope", "xpos", "sinusoidal", "alibi", "t5"])
def test_a_prompt_at_explicit_positions_is_continued_from_them(name):
    """Steps after ``layer(prompt, positions=..., cache=c)`` equal the full pass at the true
    positions (the prompt's, continued), not at their slots; so does the layer after the block."""
    torch.manual_seed(5)
    layer = _layer(name)
    prompt, xs = torch.randn(2, 5, EMBED), torch.randn(2, 4, EMBED)
    positions = _continued(PROMPT_POSITIONS, 4)
    with torch.no_grad():
        full = layer(torch.cat([prompt, xs], dim=1), positions=positions)
        cache = posenc.KVCache(max_length=12)
        layer(prompt, positions=PROMPT_POSITIONS, cache=cache)
        with cache.fixed_shapes():
            for t in range(3):
                got = layer(xs[:, t : t + 1], cache=cache)
                torch.testing.assert_close(got, full[:, 5 + t : 6 + t], rtol=1e-5, atol=1e-5)
        # the cache holds the steps' true positions: the layer's bias reads them
        got = layer(xs[:, 3:], positions=positions[:, 8:], cache=cache)
    torch.testing.assert_close(got, full[:, 8:], rtol=1e-5, atol=1e-5)


def test_given_positions_are_used_and_a_bad_shape_is_refused():
    torch.manual_seed(5)
    layer = _layer("rope")
    prompt, x = torch.randn(2, 5, EMBED), torch.randn(2, 1, EMBED)
    with torch.no_grad():
        want = layer(torch.cat([prompt, x], dim=1), positions=torch.tensor([0, 1, 2, 3, 4, 40]))[:, 5:]
        cache = _prefilled(layer, prompt, 8)
        with cache.fixed_shapes():
            torch.testing.assert_close(layer(x, positions=torch.tensor([[40]]), cache=cache), want)
            with pytest.raises(ValueError, match=r"positions of a fixed-shape step must be .* got \(2,\)"):
                layer(x, positions=torch.tensor([40, 41]), cache=cache)


def test_the_compiled_layer_continues_explicit_positions_in_one_graph():
    """The positions' offset is a tensor the graph reads: after eager tokens that jump to another
    position, a new block continues after them without recompiling."""
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    torch.manual_seed(6)
    layer = _layer("rope")
    prompt, xs = torch.randn(2, 5, EMBED), torch.randn(2, 5, EMBED)
    positions = torch.cat([_continued(PROMPT_POSITIONS, 2), torch.tensor([[200, 201, 202]] * 2)], dim=1)
    counter = CompileCounter()
    with torch.no_grad():
        full = layer(torch.cat([prompt, xs], dim=1), positions=positions)
        cache = posenc.KVCache(max_length=12)
        layer(prompt, positions=PROMPT_POSITIONS, cache=cache)
        compiled = torch.compile(layer, backend=counter, fullgraph=True)
        with cache.fixed_shapes():
            got = [compiled(xs[:, t : t + 1], cache=cache) for t in range(2)]
        got.append(layer(xs[:, 2:3], positions=positions[:, 7:8], cache=cache))  # eager, at 200
        with cache.fixed_shapes():
            got += [compiled(xs[:, t : t + 1], cache=cache) for t in range(3, 5)]  # 201, 202
    torch.testing.assert_close(torch.cat(got, dim=1), full[:, 5:], rtol=1e-5, atol=1e-5)
    assert counter.frame_count == 1


def test_other_calls_inside_the_block_are_refused_and_the_layer_continues_after_it():
    """A call of another form would write its tokens over the slots'; after the block the layer goes
    on after them, and a new block after its tokens."""
    torch.manual_seed(7)
    layer = _layer("rope")
    prompt, xs = torch.randn(2, 5, EMBED), torch.randn(2, 6, EMBED)
    with torch.no_grad():
        full = layer(torch.cat([prompt, xs], dim=1))
        cache = _prefilled(layer, prompt, 12)
        with cache.fixed_shapes():
            got = [layer(xs[:, t : t + 1], cache=cache) for t in range(2)]
            with pytest.raises(ValueError, match="one token per step"):
                layer(xs[:, 2:4], cache=cache)
            with pytest.raises(ValueError, match=r"a step takes x and positions only, got key_padding_mask"):
                layer(xs[:, 2:3], cache=cache, key_padding_mask=torch.zeros(2, 8, dtype=torch.bool))
            with pytest.raises(ValueError, match="reset"):
                cache.reset()
        got.append(layer(xs[:, 2:4], cache=cache))
        with cache.fixed_shapes():
            got += [layer(xs[:, t : t + 1], cache=cache) for t in range(4, 6)]
    torch.testing.assert_close(torch.cat(got, dim=1), full[:, 5:], rtol=1e-5, atol=1e-5)
    assert cache.length(0) == 11


def test_a_training_layer_with_dropout_and_a_grad_call_are_refused():
    layer = _layer("rope", dropout=0.5)
    cache = _prefilled(layer, torch.randn(1, 3, EMBED), 8)
    x = torch.randn(1, 1, EMBED)
    layer.train()
    with cache.fixed_shapes():
        with (
            torch.no_grad(),
            pytest.raises(ValueError, match=r"training mode with dropout=0.5.*layer.eval\(\)"),
        ):
            layer(x, cache=cache)
        layer.eval()
        with pytest.raises(ValueError, match=r"writes the cache in place.*torch.no_grad\(\)"):
            layer(x, cache=cache)
        with torch.no_grad():
            assert layer(x, cache=cache).shape == (1, 1, EMBED)


@pytest.mark.parametrize(
    ("x_shape", "message"),
    [
        ((3, 1, EMBED), r"x must be \[B=2, 1, E=32\], got \(3, 1, 32\): the cache holds a batch of 2"),
        ((2, 2, EMBED), r"x must be \[B=2, 1, E=32\], got \(2, 2, 32\): one token per step"),
    ],
)
def test_a_call_of_the_wrong_shape_is_refused_by_name(x_shape, message):
    layer = _layer("rope")
    cache = _prefilled(layer, torch.randn(2, 3, EMBED), 8)
    with (
        torch.no_grad(),
        cache.fixed_shapes(),
        pytest.raises(ValueError, match="fixed_shapes\\(\\): " + message),
    ):
        layer(torch.randn(*x_shape), cache=cache)


# ------------------------------------------------------------------ the public pieces the step uses
def test_the_layer_projects_q_k_v_into_heads_before_the_encoding_acts():
    layer = _layer("rope", num_kv_heads=1)
    x = torch.randn(2, 5, EMBED)
    q, k, v = layer.project(x)
    head_dim = EMBED // HEADS
    assert q.shape == (2, HEADS, 5, head_dim) and k.shape == v.shape == (2, 1, 5, head_dim)
    torch.testing.assert_close(q, layer.q_proj(x).view(2, 5, HEADS, head_dim).transpose(1, 2))
    torch.testing.assert_close((k, v), layer.key_values(x))


def test_the_layer_states_its_pattern_and_a_layer_built_from_it_has_the_same():
    temperature = posenc.layers.patterns.QueryTemperature()
    layer = posenc.MultiheadAttention(
        EMBED, HEADS, "rope", causal=True, window=4, sinks=True, query_temperature=temperature, softcap=30.0
    )
    pattern = layer.pattern
    assert pattern == posenc.layers.patterns.LayerSpec(
        layer.encoding.spec(), window=4, sinks=True, temperature=temperature, softcap=30.0
    )
    twin = posenc.MultiheadAttention(EMBED, HEADS, pattern.encoding, causal=True, pattern=pattern)
    assert twin.pattern == pattern


def _refused_patterns():
    """A value for every field of LayerSpec the step does not serve: each one must be refused."""
    from dataclasses import fields

    values = {
        "window": 4,
        "chunk": 4,
        "sinks": True,
        "temperature": posenc.layers.patterns.QueryTemperature(),
        "kv_shared": True,
    }
    served = SERVES["slots"]["pattern"]
    names = [f.name for f in fields(posenc.layers.patterns.LayerSpec) if f.name not in served]
    assert sorted(names) == sorted(values), "a new pattern field: say here how the step refuses it"
    return list(values.items())


def test_every_pattern_field_has_a_reader_or_is_served_by_both_plans():
    """A LayerSpec field that neither short plan reads off the layer would be served silently."""
    from dataclasses import fields

    always = set(SERVES["decode"]["pattern"]) & set(SERVES["slots"]["pattern"])
    names = {f.name for f in fields(posenc.layers.patterns.LayerSpec)}
    assert names == always | set(PATTERN_READS), names ^ (always | set(PATTERN_READS))


@pytest.mark.parametrize(("name", "value"), _refused_patterns())
def test_every_pattern_field_the_step_does_not_serve_is_refused_by_name(name, value):
    spec = posenc.layers.patterns.LayerSpec("rope", **{name: value})
    if name == "kv_shared":  # a lone layer refuses the field: one linked to its donor carries it
        from posenc.layers.kv_sharing import KVDonorAttention, KVSharedAttention, link_kv_sharing

        donor = KVDonorAttention(EMBED, HEADS, "rope", causal=True).eval()
        layer = KVSharedAttention(EMBED, HEADS, "rope", causal=True, pattern=spec, layer_idx=1).eval()
        link_kv_sharing([donor, layer], {1: 0})
        cache = _prefilled(donor, torch.randn(1, 3, EMBED), 8)
    else:
        layer = posenc.MultiheadAttention(EMBED, HEADS, "rope", causal=True, pattern=spec).eval()
        cache = _prefilled(layer, torch.randn(1, 3, EMBED), 8)
    with (
        torch.no_grad(),
        cache.fixed_shapes(),
        pytest.raises(ValueError, match=rf"fixed_shapes\(\): .*{name}"),
    ):
        layer(torch.randn(1, 1, EMBED), cache=cache)
