"""The decode plan of ``posenc.layers.step``: one token through ``MultiheadAttention`` with a
``KVCache`` under ``torch.no_grad``, no mask, whose signature the full path served on sdpa, runs
without building a request; the HF bridge runs the same nan test and kernel.

It must give the full path's outputs and cache bit for bit for every registered encoding it serves
(and serve none it cannot), send a nan in the new token to a backend that propagates it without
writing anything first, keep every cache check (another layer's entry, a switched channel layout,
an open fixed_shapes() block), and follow a changed setting (scale, backend, priority, dtype, mode)
on the next call. The expected values come from the same layer with the plain step switched off.
"""

from __future__ import annotations

import ast
import copy
import pathlib

import pytest
import torch

import posenc
from _contract import EMBED, HEADS, NAMES, _x, make_layer, nan_hook
from posenc.backends import dispatch_state, register_backend
from posenc.backends.dispatch import PRIORITY, set_priority
from posenc.backends.parts import query_blocks as _query_blocks
from posenc.encodings.base import Kind
from posenc.encodings.rope_pairing import switch_rope_pairing_
from posenc.layers import step as plain_step

PLAIN_KINDS = (Kind.ABSOLUTE, Kind.ROTARY)


def _full_path(monkeypatch) -> None:
    """Switch the plain step off: every call builds its request (the reference)."""
    monkeypatch.setattr(plain_step, "decode_key", lambda *a: None)


def _served(monkeypatch) -> list[bool]:
    """One entry per call the plain step served (returned an output for)."""
    served: list[bool] = []
    real = plain_step._decode_step

    def counting(*args):
        out = real(*args)
        if out is not None:
            served.append(True)
        return out

    monkeypatch.setattr(plain_step, "_decode_step", counting)
    return served


def _decode(layer, xs, max_length: int | None) -> tuple[list[torch.Tensor], posenc.KVCache]:
    """A prompt ``xs[0]``, then one token per further input, under no_grad."""
    cache = posenc.KVCache(max_length=max_length)
    with torch.no_grad():
        return [layer(x, cache=cache) for x in xs], cache


def _inputs(batch: int = 2, steps: int = 6, dtype=torch.float32) -> list[torch.Tensor]:
    torch.manual_seed(7)
    return [_x(batch, 5, dtype)] + [_x(batch, 1, dtype) for _ in range(steps)]


def _plain_kind(layer) -> bool:
    return layer.encoding.kind in PLAIN_KINDS and not layer.encoding.input_dependent


@pytest.mark.parametrize("max_length", [None, 16])
@pytest.mark.parametrize("name", NAMES)
def test_every_encoding_decodes_bit_for_bit_as_the_full_path(name, max_length, monkeypatch):
    """Every registered encoding: the same outputs and cached keys, values and positions, bit for
    bit; the plain step serves every step after the first of an ABSOLUTE or ROTARY encoding that the
    full path ran on sdpa, and no step of any other."""
    layer, xs = make_layer(name, causal=True), _inputs()
    served = _served(monkeypatch)
    got, cache = _decode(layer, xs, max_length)
    backend = layer.last_backend
    with monkeypatch.context() as full:
        _full_path(full)
        want, want_cache = _decode(layer, xs, max_length)
    for out, expected in zip(got, want, strict=True):
        assert torch.equal(out, expected)
    entry, expected_entry = cache.get(layer.layer_idx), want_cache.get(layer.layer_idx)
    for field in ("k", "v", "k_pos"):
        assert torch.equal(getattr(entry, field), getattr(expected_entry, field)), field
    steps = len(xs) - 1
    if _plain_kind(layer) and backend == "sdpa":
        assert len(served) == steps - 1  # the first step's full path remembers the signature
    else:
        assert served == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_kv_heads", [1, 2])
@pytest.mark.parametrize("encoding", ["rope", "rope:pairing=interleaved", "sinusoidal", "nope", "learned"])
def test_grouped_heads_and_dtypes(encoding, num_kv_heads, dtype, monkeypatch):
    torch.manual_seed(0)
    layer = posenc.MultiheadAttention(EMBED, HEADS, encoding, causal=True, num_kv_heads=num_kv_heads)
    layer = layer.to(dtype).eval()
    xs = _inputs(batch=3, dtype=dtype)
    served = _served(monkeypatch)
    got, _ = _decode(layer, xs, 20)
    assert len(served) == len(xs) - 2
    with monkeypatch.context() as full:
        _full_path(full)
        want, _ = _decode(layer, xs, 20)
    for out, expected in zip(got, want, strict=True):
        assert torch.equal(out, expected)


def test_the_model_s_generate_is_served_and_gives_the_same_tokens(monkeypatch):
    """TransformerLM hands every layer its positions: the plain step takes them, checked."""
    torch.manual_seed(1)
    lm = posenc.TransformerLM(40, 32, 2, 4, "rope", d_ff=64, num_kv_heads=2).eval()
    prompt = torch.randint(0, 40, (2, 7))
    served = _served(monkeypatch)
    tokens = lm.generate(prompt, 9)
    assert len(served) >= 2 * 7
    with monkeypatch.context() as full:
        _full_path(full)
        assert torch.equal(lm.generate(prompt, 9), tokens)


@pytest.mark.parametrize("which", ["q", "k", "v"])
@pytest.mark.parametrize("max_length", [None, 16])
def test_a_nan_goes_to_eager_writes_nothing_first_and_stays_while_cached(which, max_length, monkeypatch):
    layer = make_layer("rope", causal=True)
    xs = _inputs()
    eager = copy.deepcopy(layer)
    eager.backend = "eager"
    at = 3  # steps 1 and 2 are clean: step 2 is served plainly
    step = [0]
    nan_at = nan_hook(step, at)

    def decode(model) -> tuple[list[torch.Tensor], list[int], list[str]]:
        handle = getattr(model, f"{which}_proj").register_forward_hook(nan_at)
        cache, outs, lengths, backends = posenc.KVCache(max_length=max_length), [], [], []
        try:
            with torch.no_grad():
                for i, x in enumerate(xs):
                    step[0] = i
                    outs.append(model(x, cache=cache))
                    lengths.append(cache.length(model.layer_idx))
                    backends.append(model.last_backend)
        finally:
            handle.remove()
        return outs, lengths, backends

    served = _served(monkeypatch)
    got, lengths, backends = decode(layer)
    assert served, "the clean steps before the nan were served plainly"
    want, _, _ = decode(eager)
    assert lengths == [5 + i for i in range(len(xs))]  # the refused plain step wrote nothing
    assert backends[at] == "eager" and not torch.isfinite(got[at]).all()
    if which != "q":  # the nan is cached: every later step keeps to a backend that propagates it
        assert all(b == "eager" for b in backends[at:])
        assert all(not torch.isfinite(out).all() for out in got[at:])
    else:
        assert backends[-1] == "sdpa"
    for out, expected in zip(got, want, strict=True):
        assert torch.equal(out.isnan(), expected.isnan())
        fine = torch.isfinite(expected)
        torch.testing.assert_close(out[fine], expected[fine], rtol=1e-5, atol=1e-5)


def _prefilled(max_length: int | None = 32):
    torch.manual_seed(3)
    layer = make_layer("rope", causal=True)
    cache = posenc.KVCache(max_length=max_length)
    with torch.no_grad():
        layer(_x(1, 5), cache=cache)
        layer(_x(1, 1), cache=cache)  # the full path remembers the signature
    return layer, cache


def test_changed_settings_take_effect_on_the_next_step(monkeypatch):
    layer, cache = _prefilled()
    served = _served(monkeypatch)
    x = _x(1, 1)
    before = PRIORITY["cpu"]
    with torch.no_grad():
        layer(x, cache=cache)
        assert served and layer.last_backend == "sdpa"
        with posenc.use_backend("eager"):
            layer(x, cache=cache)
            assert layer.last_backend == "eager"
        layer.backend = "eager"
        layer(x, cache=cache)
        assert layer.last_backend == "eager"
        layer.backend = "auto"
        layer(x, cache=cache)  # the full path remembers the signature again
        count = len(served)
        layer(x, cache=cache)
        assert len(served) == count + 1 and layer.last_backend == "sdpa"
        try:
            set_priority("cpu", ("eager", *(n for n in before if n != "eager")))
            layer(x, cache=cache)
            assert layer.last_backend == "eager"
        finally:
            set_priority("cpu", before)
        count = len(served)
        layer(x, cache=cache)  # full path again: remembers the order restored
        layer(x, cache=cache)
        assert len(served) == count + 1 and layer.last_backend == "sdpa"
        layer.scale = float("nan")
        with pytest.raises(ValueError, match="scale"):
            layer(x, cache=cache)


def test_a_new_scale_is_used_from_the_next_step(monkeypatch):
    def decode() -> list[torch.Tensor]:
        layer, cache = _prefilled()
        outs = []
        with torch.no_grad():
            for i in range(5):
                if i == 2:
                    layer.scale = 0.5
                outs.append(layer(_x(1, 1), cache=cache))
        return outs

    served = _served(monkeypatch)
    got = decode()
    assert len(served) == 4  # all but step 2: the new scale's first step is a full one
    with monkeypatch.context() as full:
        _full_path(full)
        want = decode()
    for out, expected in zip(got, want, strict=True):
        assert torch.equal(out, expected)


def test_a_cast_layer_refuses_the_old_dtype_by_name():
    layer, cache = _prefilled(max_length=None)
    layer.double()
    with torch.no_grad(), pytest.raises(ValueError, match="dtype"):
        layer(_x(1, 1), cache=cache)


def test_the_cache_checks_still_run(monkeypatch):
    """Another layer's entry, a switched q/k channel order and a call of another form inside an open
    fixed_shapes() block are refused."""
    layer, cache = _prefilled()
    other = make_layer("rope", causal=True)  # layer_idx 0 too: it must not read layer's entry
    with torch.no_grad():
        with pytest.raises(ValueError, match="not by this layer"):
            other(_x(1, 1), cache=cache)
        layer(_x(1, 1), cache=cache)
        switch_rope_pairing_(layer, "interleaved")
        with pytest.raises(ValueError, match="switch_rope_pairing_"):
            layer(_x(1, 1), cache=cache)
    layer, cache = _prefilled()
    with torch.no_grad():
        with cache.fixed_shapes():
            layer(_x(1, 1), cache=cache)
            with pytest.raises(ValueError, match=r"fixed_shapes\(\): a step takes x and positions only"):
                layer(_x(1, 1), cache=cache, need_weights=True)
            with pytest.raises(ValueError, match="one token per step"):
                layer(_x(1, 2), cache=cache)
        served = _served(monkeypatch)
        # the block's tokens were never tested for nan: the next call is a full one
        layer(_x(1, 1), cache=cache)
        assert served == []
        layer(_x(1, 1), cache=cache)
        assert served == [True]


def test_calls_that_need_more_than_sdpa_over_every_key_take_the_full_path(monkeypatch):
    served = _served(monkeypatch)
    layer, cache = _prefilled(max_length=None)
    x = _x(1, 1)
    layer(x, cache=cache)  # grad enabled
    with torch.no_grad():
        layer(x, cache=cache, need_weights=True)
        layer(x, cache=cache, attn_mask=torch.ones(1, cache.length(0) + 1, dtype=torch.bool))
        layer(torch.cat([x, x], 1), cache=cache)
    assert served == []
    windowed = posenc.MultiheadAttention(EMBED, HEADS, "rope", causal=True, window=4).eval()
    padded = posenc.MultiheadAttention(EMBED, HEADS, "rope", causal=True).eval()
    with torch.no_grad():
        cache = posenc.KVCache()
        for _ in range(4):
            windowed(x if cache.length(0) else _x(1, 6), cache=cache)
        cache = posenc.KVCache()
        padding = torch.tensor([[True, False, False, False, False]])
        padded(_x(1, 5), cache=cache, key_padding_mask=padding)
        for _ in range(3):
            padded(x, cache=cache)
    assert served == []


def test_kv_sharing_layers_keep_the_full_path(monkeypatch):
    """The donor hands its keys over and the shared layer reads its donor's: steps a plain step
    would skip. Their model decodes as with the plain step switched off."""
    torch.manual_seed(2)
    lm = posenc.TransformerLM(40, 32, 4, 4, "rope", d_ff=64, kv_shared_layers=2).eval()
    prompt = torch.randint(0, 40, (1, 6))
    tokens = lm.generate(prompt, 6)
    with monkeypatch.context() as full:
        _full_path(full)
        assert torch.equal(lm.generate(prompt, 6), tokens)
    assert not plain_step._runs_own_steps(type(lm.blocks[-1].attn))


def test_the_full_path_chooses_sdpa_at_every_key_count(monkeypatch):
    """The signature leaves the number of keys out: at one unmasked query the full path's choice is
    sdpa on both sides of the dispatcher's size threshold (lowered here so that a short cache
    crosses it), so the plain step never serves a call the full path would send elsewhere."""
    monkeypatch.setattr(_query_blocks, "MIN_AUTO_LOGITS", 8)
    _full_path(monkeypatch)
    for name in ("rope", "nope", "sinusoidal"):
        layer = make_layer(name, causal=True)
        cache = posenc.KVCache()
        with torch.no_grad():
            layer(_x(1, 3), cache=cache)
            for _ in range(12):
                layer(_x(1, 1), cache=cache)
                assert layer.last_backend == "sdpa", name


def test_positions_on_another_device_or_out_of_range_are_refused_by_name():
    layer, cache = _prefilled()
    with torch.no_grad(), pytest.raises(ValueError, match="positions"):
        layer(_x(1, 1), cache=cache, positions=torch.tensor([[-3]]))
    learned = posenc.MultiheadAttention(EMBED, HEADS, "learned:max_len=8", causal=True).eval()
    cache = posenc.KVCache()
    with torch.no_grad():
        learned(_x(1, 6), cache=cache)
        learned(_x(1, 1), cache=cache)
        learned(_x(1, 1), cache=cache)  # position 7, the last row: served
        with pytest.raises(ValueError, match="max_positions=8"):
            learned(_x(1, 1), cache=cache)


# ----------------------------------------------------------------------------
# One plain decode step for the eager layer and the HF bridge (``posenc.layers.step``).


SRC = pathlib.Path(posenc.__file__).parent


def _count_calls(monkeypatch) -> dict[str, int]:
    """Count calls of the shared step's nan test and kernel, by whichever caller."""
    calls = {"fresh_finite": 0, "attend_plain": 0}
    for name in calls:
        real = getattr(plain_step, name)

        def counted(*args, _real=real, _name=name, **kwargs):
            calls[_name] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(plain_step, name, counted)
    return calls


def _imports(path: pathlib.Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            names.add("." * node.level + (node.module or ""))
            names.update(f"{'.' * node.level}{node.module or ''}.{a.name}" for a in node.names)
    return names


def _reads_version_counter(path: pathlib.Path) -> bool:
    return any(
        isinstance(node, ast.Attribute) and node.attr == "_version"
        for node in ast.walk(ast.parse(path.read_text()))
    )


def test_the_eager_layer_s_plain_steps_run_the_shared_nan_test_and_kernel(monkeypatch):
    torch.manual_seed(0)
    layer = posenc.MultiheadAttention(32, 4, encoding="rope", causal=True).eval()
    cache = posenc.KVCache()
    calls = _count_calls(monkeypatch)
    with torch.no_grad():
        layer(torch.randn(1, 5, 32), cache=cache)
        layer(torch.randn(1, 1, 32), cache=cache)  # the full path: remembers the signature
        assert plain_step.remembered(layer) is not None
        for _ in range(3):
            layer(torch.randn(1, 1, 32), cache=cache)
    assert calls == {"fresh_finite": 3, "attend_plain": 3}


def test_the_hf_bridge_s_plain_steps_run_the_same_nan_test_and_kernel(monkeypatch):
    transformers = pytest.importorskip("transformers")
    import posenc.hf as posenc_hf

    posenc_hf.register()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config).eval()
    model.set_attn_implementation(posenc_hf.ATTN_IMPLEMENTATION)
    calls = _count_calls(monkeypatch)
    ids = torch.randint(0, 50, (1, 9))
    cache = transformers.DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids[:, :5], past_key_values=cache, use_cache=True)
        for t in range(5, 9):  # the first step of each layer is full, the next three plain
            model(ids[:, t : t + 1], past_key_values=cache, use_cache=True)
    attention = model.model.layers[0].self_attn
    assert plain_step.remembered(attention) is not None
    assert calls == {"fresh_finite": 2 * 3, "attend_plain": 2 * 3}


def test_the_dispatcher_state_changes_with_everything_that_changes_a_choice():
    before = dispatch_state("auto")
    assert before == dispatch_state("auto")
    assert dispatch_state("eager")[0] == "eager" and dispatch_state("eager") != before
    with posenc.use_backend("eager"):
        assert dispatch_state("auto")[0] == "eager"
    order = list(PRIORITY["cpu"])
    try:
        set_priority("cpu", [*order[1:], order[0]])
        assert dispatch_state("auto") != before
    finally:
        set_priority("cpu", order)
    generation = dispatch_state("auto")[1]
    register_backend(posenc.backends.get_backend("eager"))  # a registration, even of the same backend
    assert dispatch_state("auto")[1] > generation


def test_a_layer_remembers_only_a_call_served_on_sdpa_with_finite_values():
    torch.manual_seed(0)
    layer = posenc.MultiheadAttention(32, 4, encoding="rope", causal=True, backend="eager").eval()
    cache = posenc.KVCache()
    with torch.no_grad():
        layer(torch.randn(1, 4, 32), cache=cache)
        layer(torch.randn(1, 1, 32), cache=cache)
    assert layer.last_backend == "eager"
    assert plain_step.remembered(layer) is None


@pytest.mark.parametrize("module", ["layers/step.py", "hf/_attention.py", "layers/attention.py"])
def test_no_caller_of_the_plain_step_reads_the_dispatcher_s_memo(module):
    imported = _imports(SRC / module)
    assert not any(name.endswith("memo") or ".memo." in name for name in imported), imported


def test_only_position_ranges_reads_a_position_tensor_s_version_counter():
    """The HF bridge kept its own versioned ``arange`` table; it now asks ``counting_positions``. The
    cache reads the version of a cross-attention context (its identity), not of positions."""
    readers = sorted(str(path.relative_to(SRC)) for path in SRC.rglob("*.py") if _reads_version_counter(path))
    assert readers == ["cache/entry.py", "kernels/position_ranges.py"], readers
