"""Reading a RoPE scaling config (:mod:`posenc.encodings.rope_scaling`'s dicts): the rotary width, the
base, the frequencies of a base, the factor and the lengths, each checked with a ``ValueError`` that
names the key at fault.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import torch
from torch import Tensor

__all__ = ["rotary_width"]


def rotary_width(config: dict[str, Any]) -> int:
    """``d_r = int(head_dim * partial_rotary_factor)``; ValueError if it is not a positive even number."""
    head_dim = config.get("head_dim")
    if not isinstance(head_dim, int) or isinstance(head_dim, bool) or head_dim <= 0:
        raise ValueError(f"RoPE scaling: head_dim must be a positive int, got {head_dim!r}")
    factor = config.get("partial_rotary_factor")
    if config.get("rotary_dim") is not None:  # posenc's exact spelling; avoids float round-off of the factor
        width = int(config["rotary_dim"])
    else:
        width = head_dim if factor is None else int(head_dim * factor)
    if width <= 0 or width % 2:
        raise ValueError(
            f"RoPE: rotary dimension {width} (head_dim={head_dim}, partial_rotary_factor={factor}) must be a "
            "positive even number: pass rotary_dim (or partial_rotary_factor) for at least one pair; only "
            "scaling='proportional' (p-RoPE) may rotate no pair"
        )
    return width


def _base(config: dict[str, Any]) -> float:
    base = config.get("rope_theta")
    base = 10000.0 if base is None else float(base)
    if not base > 1.0:
        raise ValueError(f"RoPE: base (rope_theta) must be > 1, got {base}")
    return base


def _exponents(width: int) -> Tensor:
    """``2k / d_r`` for ``k < d_r/2`` in float32 (integer arange first, as HF does)."""
    return torch.arange(0, width, 2, dtype=torch.int64).float() / width


def _inv_freq(base: float, width: int) -> Tensor:
    return 1.0 / (base ** _exponents(width))


def _factor(config: dict[str, Any], rope_type: str, *, minimum: float = 0.0) -> float:
    factor = config.get("factor")
    if factor is None:
        raise ValueError(f"RoPE scaling {rope_type!r} needs 'factor'")
    if isinstance(factor, bool) or not isinstance(factor, numbers.Real):
        raise ValueError(f"RoPE scaling {rope_type!r}: factor must be a number, got factor={factor!r}")
    factor = float(factor)
    # inf passed '> 0' and gave zero (linear), nan (dynamic) or infinite-scale (yarn) frequencies
    if not (math.isfinite(factor) and factor > minimum):
        raise ValueError(f"RoPE scaling {rope_type!r}: factor must be finite and > {minimum:g}, got {factor}")
    return factor


def _length(config: dict[str, Any], key: str, rope_type: str) -> int:
    """``config[key]`` (a length: ``original_max_position_embeddings`` or ``max_position_embeddings``)
    as an int ``>= 1``; ValueError naming the key for anything else.

    A whole float (``4096.0``, as some saved configs hold) is that int; a fraction, nan, inf, a bool
    or a string is refused instead of truncated (1.5 read as 1), failing in ``int()`` without the
    key's name, or reaching the formulas (a negative length made dynamic NTK's base complex).
    """
    value = config[key]
    whole = isinstance(value, numbers.Integral) or (
        isinstance(value, numbers.Real) and math.isfinite(value) and float(value).is_integer()
    )
    if isinstance(value, bool) or not whole or value < 1:
        raise ValueError(
            f"RoPE scaling {rope_type!r}: {key} must be a positive int (a length), got {value!r}"
        )
    return int(value)


def _original_length(config: dict[str, Any], rope_type: str) -> int:
    """``original_max_position_embeddings``, required: no fallback to ``max_position_embeddings``.

    HF's compute functions index it (a KeyError without it); only HF's config standardisation
    copies the model's length in, which puts the extended length where the pretraining length
    belongs (yarn's ramp and derived factor ``max / max = 1``, llama3's bands): the pretraining
    length is stated, not guessed.
    """
    length = config.get("original_max_position_embeddings")
    if length is None:
        # Without the pretraining length no factor can be derived either: name every missing key.
        missing = ("factor", "original_max_position_embeddings") if config.get("factor") is None else ()
        needed = " and ".join(map(repr, missing or ("original_max_position_embeddings",)))
        raise ValueError(
            f"RoPE scaling {rope_type!r} needs {needed} (the pretraining length); "
            "max_position_embeddings (the extended length) is not used in its place"
        )
    return _length(config, "original_max_position_embeddings", rope_type)


def _factor_or_ratio(config: dict[str, Any], rope_type: str, original: int) -> float:
    """``factor``, or ``max_position_embeddings / original`` when ``factor`` is None (HF yarn/longrope)."""
    if config.get("factor") is not None:
        return _factor(config, rope_type)
    longest = config.get("max_position_embeddings")
    if longest is None:
        raise ValueError(
            f"RoPE scaling {rope_type!r} needs 'factor' (or 'max_position_embeddings' to derive it)"
        )
    return _length(config, "max_position_embeddings", rope_type) / original
