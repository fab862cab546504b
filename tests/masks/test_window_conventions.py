"""Sliding windows counted three ways (posenc.masks.window_conventions): each convention describes posenc's
mask, and convert_window maps between them (known values, round trips, bad input named)."""

from __future__ import annotations

import pytest
import torch
from transformers import masking_utils as mu

from _mask_rows import (
    _build,
    _hf_sdpa,
)
from posenc.masks.attention_mask import (
    WINDOW_CONVENTIONS,
    convert_window,
)

# ---------------------------------------------------------------------------- window conventions


def _band_of_posenc(window: int, causal: bool, length: int = 40) -> torch.Tensor:
    mask = _build(length, length, batch=1, causal=causal, window=window).dense()
    return mask[0, 0]


def _band_formula(left: int, right: int, length: int = 40) -> torch.Tensor:
    """FlashAttention's ``window_size=(left, right)``: ``i - left <= j <= i + right``, written out."""
    i, j = torch.arange(length)[:, None], torch.arange(length)[None, :]
    return (j >= i - left) & (j <= i + right)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("window", [1, 2, 5, 16])
def test_each_convention_describes_posenc_s_mask(window, causal):
    """posenc's ``window`` converted to each convention gives back the mask posenc builds: the flash
    band written out, HF's own mask function with the hf value, and the number of keys of a row away
    from the ends."""
    want = _band_of_posenc(window, causal)
    left, right = convert_window(window, "posenc", "flash", causal=causal)
    assert torch.equal(_band_formula(left, right), want)
    hf = convert_window(window, "posenc", "hf", causal=causal)
    function = (
        mu.sliding_window_causal_mask_function(hf)
        if causal
        else mu.sliding_window_bidirectional_mask_function(hf)
    )
    assert torch.equal(_hf_sdpa(function, 1, 40, 40)[0, 0], want)
    assert convert_window(window, "posenc", "keys", causal=causal) == int(want[20].sum())
    wider = _band_formula(left + 1, right + (0 if causal else 1))
    assert not torch.equal(wider, want)  # a convention off by one would fail


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("source", sorted(WINDOW_CONVENTIONS))
@pytest.mark.parametrize("target", sorted(WINDOW_CONVENTIONS))
def test_convert_window_round_trips(source, target, causal):
    """Every direction: posenc's windows 1..9 through ``source`` and ``target`` and back."""
    for window in range(1, 10):
        value = convert_window(window, "posenc", source, causal=causal)
        there = convert_window(value, source, target, causal=causal)
        assert convert_window(there, target, source, causal=causal) == value
        assert convert_window(there, target, "posenc", causal=causal) == window


def test_convert_window_known_values():
    """HF's flash path passes ``window_size=(sliding_window - 1, sliding_window - 1)``; Mistral's 4096 is
    4096 keys; ModernBERT's ``local_attention=128`` (HF's 64) keeps 129 keys."""
    assert convert_window(4096, "hf", "flash", causal=True) == (4095, 0)
    assert convert_window(4096, "hf", "keys", causal=True) == 4096
    assert convert_window(4096, "hf", "posenc", causal=True) == 4096
    assert convert_window(64, "hf", "posenc", causal=False) == 65
    assert convert_window(64, "hf", "flash", causal=False) == (64, 64)
    assert convert_window(64, "hf", "keys", causal=False) == 129
    assert convert_window((64, 64), "flash", "hf", causal=False) == 64
    assert convert_window(129, "keys", "posenc", causal=False) == 65


@pytest.mark.parametrize(
    "value,source,target,causal,match",
    [
        (0, "posenc", "hf", True, "value must be an int >= 1"),
        (-1, "hf", "posenc", False, "value must be an int >= 0"),
        ((3, 2), "flash", "posenc", False, r"bidirectional posenc window is a band \(left, left\)"),
        ((3, 1), "flash", "posenc", True, r"causal posenc window is a band \(left, 0\)"),
        ((-1, -1), "flash", "posenc", False, "no window"),
        (4, "flash", "posenc", False, "window_size, a tuple"),
        (4, "keys", "posenc", False, "odd number of keys"),
        (4, "mistral", "posenc", True, "source must be one of"),
        (4, "hf", "fa2", True, "target must be one of"),
        (2.5, "posenc", "hf", True, "value must be an int"),
    ],
)
def test_convert_window_bad_input_names_the_argument(value, source, target, causal, match):
    with pytest.raises(ValueError, match=match):
        convert_window(value, source, target, causal=causal)
