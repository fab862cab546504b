"""Issue 36's mask tests' shared pieces (tests/masks/, tests/hf/test_masks.py): HF's masking_utils called
directly (tiny shapes, no downloads), a mask compared whole, as mask_mod and block by block, a left-padded
batch, and a layer stepped through a cache."""

from __future__ import annotations

import torch
from transformers import masking_utils as mu

import posenc
from _patterns import HEADS
from posenc.masks.attention_mask import (
    AttentionMask,
)


def _no_cache(create):
    """HF's mask builder ``create`` called without a cache, under the keyword its release names it
    (``cache`` from transformers 5.22, ``past_key_values`` before): bound by name, not version."""
    import inspect

    name = "cache" if "cache" in inspect.signature(create).parameters else "past_key_values"
    return lambda **kwargs: create(**kwargs, **{name: None})


def _hf_sdpa(mask_function, batch, q_len, k_len, past=0, keep=None):
    """HF's bool mask ``[B, 1, Tq, Tk]`` of ``mask_function`` (queries at ``past + i``), with HF's 2-D
    ``attention_mask`` ``keep [B, Tk]`` (1 = real token)."""
    return mu.sdpa_mask(
        batch, q_len, k_len, q_offset=past, mask_function=mask_function, attention_mask=keep,
        allow_is_causal_skip=False,
    )  # fmt: skip


def _assert_mask_equals(mask: AttentionMask, want: torch.Tensor) -> None:
    """``mask`` equals HF's ``want [B, 1, Tq, Tk]`` whole, as a mask_mod, and block by block."""
    batch, _, q_len, k_len = want.shape
    want = want.expand(batch, mask.heads, q_len, k_len)
    dense = mask.dense()
    assert torch.equal(torch.ones_like(want) if dense is None else dense.expand_as(want), want)
    b, h, i, j = torch.meshgrid(*(torch.arange(n) for n in want.shape), indexing="ij")
    assert torch.equal(mask.mask_mod()(b, h, i, j).expand_as(want), want)
    for size in (1, 4, q_len):
        for i0 in range(0, q_len, size):
            i1 = min(q_len, i0 + size)
            lo, hi = mask.key_range(i0, i1)
            assert not want[..., i0:i1, :lo].any() and not want[..., i0:i1, hi:].any(), (i0, i1, lo, hi)
            rows = mask.rows(i0, i1, lo, hi)
            expected = want[..., i0:i1, lo:hi]
            assert torch.equal(
                torch.ones_like(expected) if rows is None else rows.expand_as(expected), expected
            )
    empty = mask.empty_rows()
    want_empty = ~want.any(dim=-1, keepdim=True)
    assert torch.equal(
        torch.zeros_like(want_empty) if empty is None else empty.expand_as(want_empty), want_empty
    )


def _left_padded(batch: int, length: int, pads=(0, 5)) -> torch.Tensor:
    """Bool ``[B, T]``, True = padding: row ``b`` starts with ``pads[b]`` padding tokens."""
    padding = torch.zeros(batch, length, dtype=torch.bool)
    for b, pad in enumerate(pads[:batch]):
        padding[b, :pad] = True
    return padding


def _build(q_len, k_len, batch=2, **options) -> AttentionMask:
    return AttentionMask.build(q_len=q_len, k_len=k_len, batch=batch, heads=HEADS, **options)


def _emb(batch: int, length: int) -> torch.Tensor:
    return torch.zeros(batch, length, 8)


# ---------------------------------------------------------------------------- cached decoding


def _stepwise(layer, x, steps, **call):
    """``layer`` over ``x`` in calls of ``steps`` tokens each, through one cache."""
    cache, outs, start = posenc.KVCache(), [], 0
    for size in steps:
        part = {k: (v[:, start : start + size] if k == "group_ids" else v) for k, v in call.items()}
        if "key_padding_mask" in part:
            part["key_padding_mask"] = call["key_padding_mask"][:, : start + size]
        outs.append(layer(x[:, start : start + size], cache=cache, **part))
        start += size
    return torch.cat(outs, dim=1)
