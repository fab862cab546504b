"""The mask module and the dispatcher: one mask object per request, one priority list per device.

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
from posenc.backends import (
    AttentionRequest,
    NoBackendError,
    available_backends,
    dispatch,
    get_backend,
    select_backend,
)
from posenc.masks.attention_mask import AttentionMask, WrittenSlotsMask, and_masks, or_masks


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


def _request(encoding="alibi", device="cpu", causal=True, **kw):
    enc = posenc.build(encoding, num_heads=2) if encoding != "rope" else posenc.build("rope", head_dim=8)
    q = torch.zeros(1, 2, 5, 8, device=device)
    pos = torch.arange(5, device=device)[None]
    return AttentionRequest.from_keywords(
        q=q, k=q, v=q, encoding=enc, q_pos=pos, k_pos=pos, scale=1.0, causal=causal, **kw
    )


def test_priority_lists_per_device():
    assert available_backends("cpu")[:3] == ["near_far", "segments", "blocked"]  # the splits first
    assert available_backends("cuda")[0] == "flex"
    assert available_backends("cpu")[-1] == "eager"


def test_set_priority_changes_auto_order(monkeypatch):
    monkeypatch.setitem(dispatch.PRIORITY, "cpu", ("eager",))
    assert available_backends("cpu")[0] == "eager"  # listed first; the unlisted ones follow
    assert select_backend(_request()).name == "eager"
    with pytest.raises(ValueError, match="twice"):
        dispatch.set_priority("cpu", ["eager", "eager"])


def test_a_preference_is_not_a_limit(monkeypatch):
    """blocked's reasons are hard limits only: off CPU it does not refuse because flex could serve
    (forcing backend="blocked" on a GPU used to raise NoBackendError)."""
    monkeypatch.setattr(type(get_backend("flex")), "reasons", lambda self, request: [])
    request = _request(device="meta")
    assert get_backend("blocked").reasons(request) == []


def test_no_backend_error_names_the_request():
    request = _request("rope", key_padding_mask=torch.zeros(1, 5, dtype=torch.bool))
    with pytest.raises(NoBackendError) as err:
        select_backend(request, "relative")
    message = str(err.value)
    for part in ("rope", "[1, 2, 5, 8]", "torch.float32", "cpu", "causal(offset=0)", "key_padding[1, 5]"):
        assert part in message, part


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
