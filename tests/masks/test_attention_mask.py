"""One mask object per request (posenc.masks.attention_mask): the materialisers against the pairwise
definition written with plain loops, and/or of masks, written slots; layers on every backend that serves a
mask, flex's mask_mod and cached decoding equal one call.

Expected masks are written here with plain Python loops over (query, key) pairs, independent of
the module's vectorised materialisers.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import posenc
from _mask_rows import (
    _build,
    _left_padded,
    _stepwise,
)
from _patterns import EMBED, HEADS
from posenc.backends import AttentionRequest, get_backend
from posenc.backends.flex import flex_bias_attention
from posenc.masks.attention_mask import (
    AttentionMask,
    WrittenSlotsMask,
    and_masks,
    or_masks,
)


def _loop_mask(batch, heads, q_len, k_len, *, causal, offset, padding, allowed):
    """The allowed pairs, one by one: causal, then padding, then the user's bool mask."""
    out = torch.zeros(batch, heads, q_len, k_len, dtype=torch.bool)
    for b, h, i, j in itertools.product(range(batch), range(heads), range(q_len), range(k_len)):
        ok = True
        if causal and j > i + offset:
            ok = False
        if padding is not None and bool(padding[b, j]):
            ok = False
        if allowed is not None and not bool(
            allowed[b if allowed.shape[0] > 1 else 0, h if allowed.shape[1] > 1 else 0, i, j]
        ):
            ok = False
        out[b, h, i, j] = ok
    return out


@settings(max_examples=40, deadline=None)
@given(
    q_len=st.integers(1, 7),
    extra_keys=st.integers(0, 5),
    causal=st.booleans(),
    use_padding=st.booleans(),
    user=st.sampled_from([None, "bool", "bool_per_head", "float"]),
    seed=st.integers(0, 10_000),
)
def test_mask_materialisers_equal_the_pairwise_definition(q_len, extra_keys, causal, use_padding, user, seed):
    gen = torch.Generator().manual_seed(seed)
    batch, heads = 2, 3
    k_len = q_len + extra_keys
    offset = extra_keys if causal else 0
    padding = torch.rand(batch, k_len, generator=gen) > 0.6 if use_padding else None
    attn_mask, allowed = None, None
    if user in ("bool", "bool_per_head"):
        allowed = (
            torch.rand(batch, heads if user == "bool_per_head" else 1, q_len, k_len, generator=gen) > 0.3
        )
        attn_mask = allowed
    elif user == "float":
        attn_mask = torch.randn(1, heads, q_len, k_len, generator=gen)
        hidden = torch.rand(1, heads, q_len, k_len, generator=gen) > 0.7
        attn_mask[hidden] = float("-inf")
        allowed = ~hidden
    mask = AttentionMask.build(
        q_len=q_len,
        k_len=k_len,
        batch=batch,
        heads=heads,
        causal=causal,
        causal_offset=offset,
        key_padding_mask=padding,
        attn_mask=attn_mask,
    )
    want = _loop_mask(
        batch, heads, q_len, k_len, causal=causal, offset=offset, padding=padding, allowed=allowed
    )
    dense = mask.dense()
    got = torch.ones_like(want) if dense is None else dense.expand_as(want)
    assert torch.equal(got, want)
    # mask_mod on index grids (FlexAttention's view) says the same.
    mod = mask.mask_mod()
    if mod is not None:
        b, h, i, j = torch.meshgrid(*(torch.arange(n) for n in want.shape), indexing="ij")
        assert torch.equal(mod(b, h, i, j).expand_as(want), want)
    # Float masks keep only finite values; -inf moved to the boolean part.
    if mask.additive is not None:
        assert torch.isfinite(mask.additive).all()
    # key_range never cuts off a visible key, and rows() equals the dense rows.
    for i0 in range(q_len):
        for i1 in range(i0 + 1, q_len + 1):
            lo, hi = mask.key_range(i0, i1)
            assert not want[..., i0:i1, :lo].any() and not want[..., i0:i1, hi:].any()
            rows = mask.rows(i0, i1, lo, hi)
            expected_rows = want[..., i0:i1, lo:hi]
            assert torch.equal(
                torch.ones_like(expected_rows) if rows is None else rows.expand_as(expected_rows),
                expected_rows,
            )
    # Rows that see no key: the cheap path and the definition agree.
    empty = mask.empty_rows()
    want_empty = ~want.any(dim=-1, keepdim=True)
    got_empty = torch.zeros_like(want_empty) if empty is None else empty.expand_as(want_empty)
    assert torch.equal(got_empty, want_empty)


def test_and_or_masks():
    def even_keys(b, h, q, kv):
        return kv % 2 == 0

    def causal(b, h, q, kv):
        return kv <= q

    q, kv = torch.arange(4)[:, None], torch.arange(4)[None, :]
    zero = torch.zeros(())
    assert torch.equal(and_masks(even_keys, causal)(zero, zero, q, kv), (kv % 2 == 0) & (kv <= q))
    assert torch.equal(or_masks(even_keys, causal)(zero, zero, q, kv), (kv % 2 == 0) | (kv <= q))
    with pytest.raises(ValueError, match="at least one"):
        and_masks()


@pytest.mark.parametrize("last", [0, 5, 12])
def test_written_slots_mask_shows_the_slots_up_to_the_step_and_no_row_is_empty(last):
    slot = torch.tensor(last)
    mask = AttentionMask(1, 13, 2, 3, torch.device("cpu"), (WrittenSlotsMask(slot),))
    want = (torch.arange(13) <= last)[None, None, None, :]  # the rule written out: j <= the step's slot
    assert torch.equal(mask.dense(), want)
    kv_idx = torch.arange(13)
    zero = torch.zeros((), dtype=torch.long)
    assert torch.equal(mask.mask_mod()(zero, zero, zero, kv_idx), want[0, 0, 0])
    assert mask.empty_rows() is None


# ----------------------------------------------------------------------------
# Issue 36's masks against HF's ``masking_utils`` (called directly, tiny shapes, no downloads).


# ---------------------------------------------------------------------------- layers on every backend


#: (layer options, call options) of each new mask, on a left-padded batch of 37 tokens.
LAYER_CASES = {
    "band": ({"causal": False, "window": 5}, {}),
    "groups": (
        {"causal": True},
        {"group_ids": torch.tensor([[-1] * 3 + [0] * 9 + [-1] * 25, [-1] * 20 + [0] * 17])},
    ),
    "groups_window": (
        {"causal": True, "window": 4},
        {"group_ids": torch.tensor([[-1] * 3 + [0] * 9 + [-1] * 5 + [1] * 20, [-1] * 20 + [0] * 17])},
    ),
    "chunks": ({"causal": True, "chunk": 6}, {}),
}


def _layer_grads(backend, encoding, layer_options, call, dtype=torch.float64):
    torch.manual_seed(0)
    layer = posenc.MultiheadAttention(EMBED, HEADS, encoding, backend=backend, **layer_options).to(dtype)
    x = torch.randn(2, 37, EMBED, dtype=dtype, requires_grad=True)
    out = layer(x, key_padding_mask=_left_padded(2, 37), **call)
    weight = torch.linspace(-1, 1, out.numel(), dtype=dtype).view_as(out)
    params = [x, *layer.parameters()]
    return layer.last_backend, out.detach(), torch.autograd.grad((out * weight).sum(), params)


@pytest.mark.parametrize("case", list(LAYER_CASES))
@pytest.mark.parametrize(
    "encoding,backends",
    [("rope", ["sdpa", "blocked", "segments"]), ("alibi:mode=symmetric", ["sdpa", "blocked"])],
)
def test_layers_equal_eager_on_every_backend(case, encoding, backends):
    """Output and gradients (input and every parameter) of each backend that serves the mask equal
    eager's, in float64."""
    layer_options, call = LAYER_CASES[case]
    _, ref, ref_grads = _layer_grads("eager", encoding, layer_options, call)
    for backend in backends:
        used, out, grads = _layer_grads(backend, encoding, layer_options, call)
        assert used == backend
        torch.testing.assert_close(out, ref, rtol=1e-7, atol=1e-9)
        for got, want in zip(grads, ref_grads):
            torch.testing.assert_close(got, want, rtol=1e-7, atol=1e-9)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("case", ["band", "groups_window", "chunks"])
def test_flex_mask_mod_equals_eager(case):
    """FlexAttention takes each new component as a ``mask_mod`` (its uncompiled reference on CPU,
    forward in float32)."""
    layer_options, call = LAYER_CASES[case]
    padding = _left_padded(2, 37)
    causal = layer_options["causal"]
    mask = _build(37, 37, causal=causal, key_padding_mask=padding, window=layer_options.get("window"),
                  chunk=layer_options.get("chunk"), group_ids=call.get("group_ids"))  # fmt: skip
    enc = posenc.build("alibi:mode=symmetric", num_heads=HEADS)
    q, k, v = (torch.randn(2, HEADS, 37, 8) for _ in range(3))
    pos = torch.arange(37)[None]
    req = AttentionRequest(q=q, k=k, v=v, encoding=enc, q_pos=pos, k_pos=pos, scale=0.3, mask=mask)
    ref, _ = get_backend("eager").run(req)
    torch.testing.assert_close(flex_bias_attention(req, compiled=False), ref, rtol=1e-5, atol=1e-6)


def test_auto_takes_the_window_backend_for_a_long_band():
    """At 700 tokens a band of 64 keys a side is served by ``segments`` (it skips the keys outside the
    band), and its output equals sdpa's dense masked call."""
    torch.manual_seed(0)
    layer = posenc.MultiheadAttention(32, 2, "rope", causal=False, window=64)
    x = torch.randn(1, 700, 32)
    with torch.no_grad():
        out = layer(x)
        assert layer.last_backend == "segments"
        layer.backend = "sdpa"
        torch.testing.assert_close(layer(x), out, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("case", ["groups_window", "chunks"])
def test_cached_decoding_equals_one_call(case):
    """Prefill then one token at a time equals one call: the image groups lie inside the prefill, and
    the chunks keep counting from each row's first real token."""
    layer_options, call = LAYER_CASES[case]
    if "group_ids" in call:  # groups inside the 31 prefilled tokens, the decoded ones in none
        call = {
            "group_ids": torch.tensor(
                [[-1] * 3 + [0] * 9 + [-1] * 5 + [1] * 14 + [-1] * 6, [-1] * 20 + [0] * 11 + [-1] * 6]
            )
        }
    torch.manual_seed(0)
    layer = posenc.MultiheadAttention(EMBED, HEADS, "rope", **layer_options).double().eval()
    x = torch.randn(2, 37, EMBED, dtype=torch.float64)
    call = {**call, "key_padding_mask": _left_padded(2, 37)}
    with torch.no_grad():
        whole = layer(x, **call)
        steps = _stepwise(layer, x, [37 - 6] + [1] * 6, **call)
    real = ~_left_padded(2, 37)  # padded queries see no key in a chunk layer: compare the real ones
    torch.testing.assert_close(steps[real], whole[real], rtol=1e-9, atol=1e-11)
