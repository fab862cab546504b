"""Sliding windows counted three ways, and a converter between them.

posenc's ``window=W``: key ``j`` is visible from query ``i`` iff ``|i - j| < W`` (a causal layer
keeps ``j <= i`` of those: the last ``W`` keys, the query's own included). HF's ``sliding_window``,
FlashAttention's ``window_size=(left, right)`` and a count of "keys kept" say the same band with
other numbers; :func:`convert_window` maps between them (``docs/conventions.md §1.7``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["WINDOW_CONVENTIONS", "Band", "convert_window"]

#: A window as the band it keeps: key ``j`` is visible from query ``i`` iff ``i - left <= j <= i +
#: right`` (FlashAttention's ``window_size=(left, right)``, both ends inclusive).
Band = tuple[int, int]


@dataclass(frozen=True)
class _Convention:
    """How one convention counts a window: ``to_band(value, causal)`` and ``from_band(band, causal)``."""

    to_band: Callable[[object, bool], Band]
    from_band: Callable[[Band, bool], object]


def _side(band: Band, causal: bool) -> int:
    """The band's left reach, after checking it is a posenc band: ``(left, 0)`` when ``causal``,
    ``(left, left)`` otherwise."""
    left, right = band
    if left < 0 or right != (0 if causal else left):
        shape = "(left, 0)" if causal else "(left, left)"
        raise ValueError(
            f"value: a {'causal' if causal else 'bidirectional'} posenc window is a band {shape} with "
            f"left >= 0, got {band}"
        )
    return left


def _count(value: object, least: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"value must be an int >= {least} in this convention, got {value!r}")
    return value


def _flash_band(value: object, causal: bool) -> Band:
    if not (isinstance(value, tuple) and len(value) == 2 and all(type(v) is int for v in value)):
        raise ValueError(
            f"value must be FlashAttention's window_size, a tuple (left, right) of ints, got {value!r}"
        )
    if min(value) < 0:
        raise ValueError(
            f"value {value}: -1 is FlashAttention's 'no window'; give posenc window=None instead"
        )
    _side(value, causal)
    return value


def _kept_band(value: object, causal: bool) -> Band:
    kept = _count(value, 1)
    if causal:
        return kept - 1, 0
    if kept % 2 == 0:
        raise ValueError(
            f"value: a bidirectional window keeps an odd number of keys (2 * side + 1), got {kept}"
        )
    return (kept - 1) // 2, (kept - 1) // 2


#: The window conventions :func:`convert_window` converts between (docs/conventions.md §1.7):
#: ``"posenc"`` (the layer's ``window=W``: keys ``|i - j| < W``, with ``causal`` only
#: ``j <= i``), ``"hf"`` (the ``sliding_window`` HF's mask functions take: causal
#: ``sliding_window_overlay(W)`` keeps ``i - W < j <= i``, bidirectional
#: ``sliding_window_bidirectional_overlay(w)`` keeps ``|i - j| <= w``), ``"flash"`` (``window_size=
#: (left, right)``) and ``"keys"`` (the keys a query keeps away from the sequence ends, its own included).
WINDOW_CONVENTIONS: dict[str, _Convention] = {
    "posenc": _Convention(
        lambda w, causal: (_count(w, 1) - 1, 0 if causal else _count(w, 1) - 1),
        lambda band, causal: _side(band, causal) + 1,
    ),
    "hf": _Convention(
        lambda w, causal: (_count(w, 1) - 1, 0) if causal else (_count(w, 0), _count(w, 0)),
        lambda band, causal: _side(band, causal) + (1 if causal else 0),
    ),
    "flash": _Convention(_flash_band, lambda band, causal: (_side(band, causal), band[1])),
    "keys": _Convention(_kept_band, lambda band, causal: _side(band, causal) * (1 if causal else 2) + 1),
}


def convert_window(value: int | tuple[int, int], source: str, target: str, *, causal: bool):
    """A sliding window given in convention ``source`` as convention ``target`` (names in
    :data:`WINDOW_CONVENTIONS`), for a causal or a bidirectional layer.

    ``convert_window(4096, "hf", "flash", causal=True) == (4095, 0)``;
    ``convert_window(64, "hf", "posenc", causal=False) == 65`` (ModernBERT's ``local_attention=128``).
    A band no posenc window can express (an asymmetric bidirectional one, a causal one looking ahead)
    is a ValueError naming ``value``.
    """
    for name, convention in (("source", source), ("target", target)):
        if convention not in WINDOW_CONVENTIONS:
            raise ValueError(f"{name} must be one of {sorted(WINDOW_CONVENTIONS)}, got {convention!r}")
    if not isinstance(causal, bool):
        raise ValueError(f"causal must be True or False, got {causal!r}")
    band = WINDOW_CONVENTIONS[source].to_band(value, causal)
    return WINDOW_CONVENTIONS[target].from_band(band, causal)
