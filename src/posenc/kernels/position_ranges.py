"""Position tensors that carry their range: the ``past + arange(T)`` positions posenc makes itself.

A decode step's positions are ``[[past]]``: one number that the layer already holds as a Python int.
Checking them (non-negative, inside an encoding's table) and looking up a rotary table by them
reads the tensor: a reduction and a device sync per check, an index gather per table, most of the
position work of a step. :func:`arange_positions` makes such positions and marks them with their
first value; :func:`known_start` reads the mark back, so the checks test ``start`` and the tables
slice rows ``start : start + T`` instead (the same numbers, bit for bit).

The mark is trusted only while the tensor is unchanged: it records the tensor's version counter,
which every in-place write bumps (``positions += 1`` drops the mark). A tensor made any other way
(a slice, ``.clone()``, the caller's own ``arange``) has no mark and takes the general path.
Under ``torch.compile`` nothing is marked: a traced graph does not carry Python attributes. Under
``torch.inference_mode`` the positions are still made as normal tensors (an inference tensor has no
version counter), so they keep their mark there too.

This module is the one owner of those marks and of every read of a position tensor's version
counter: :func:`counting_positions` (the HF bridge's ``0 .. N-1`` positions, views of one kept
table per device) is trusted by the same rule.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["arange_positions", "counting_positions", "known_start", "versioned_arange"]

_MARK = "_posenc_arange_start"


def arange_positions(start: int, length: int, device: torch.device | str | None = None) -> Tensor:
    """Positions ``[1, length]`` int64: ``start, start + 1, ...``, marked with ``start``."""
    if torch.compiler.is_compiling():
        return torch.arange(start, start + length, device=device)[None]
    positions = versioned_arange(start, start + length, device)[None]
    setattr(positions, _MARK, (start, positions._version))
    return positions


def versioned_arange(start: int, end: int, device: torch.device | str | None = None) -> Tensor:
    """``torch.arange(start, end)`` as a normal tensor, also under ``torch.inference_mode``: an
    inference tensor has no version counter, and a mark trusted by version needs one."""
    if not torch.is_inference_mode_enabled():
        return torch.arange(start, end, device=device)
    with torch.inference_mode(False):
        return torch.arange(start, end, device=device)


def known_start(positions: Tensor) -> int | None:
    """The first position of an unchanged :func:`arange_positions` tensor (``[1, T]``, consecutive
    from it), else None."""
    if torch.compiler.is_compiling():
        return None
    mark = getattr(positions, _MARK, None)
    if mark is None or mark[1] != positions._version:
        return None
    return mark[0]


#: Per device, ``arange(N)`` and its version: :func:`counting_positions` hands out views of it, not two
#: fresh ``arange`` per call (a tenth of an HF decode step's attention call). A write into it bumps
#: the version, and the next call makes a new one.
_COUNTING: dict[torch.device, tuple[Tensor, int]] = {}


def counting_positions(length: int, device: torch.device) -> Tensor:
    """``arange(length)[None]`` int64 on ``device``, as a view of a kept table (read-only by contract:
    a write into it is seen through its version counter, and the table is made anew). Under
    ``torch.compile`` a plain ``arange`` (a graph holds no kept tables or version counters)."""
    if torch.compiler.is_compiling():
        return torch.arange(length, device=device)[None]
    table, version = _COUNTING.get(device, (None, -1))
    if table is None or table.shape[0] < length or table._version != version:
        table = versioned_arange(0, max(length, 2 * (0 if table is None else table.shape[0]), 4096), device)
        _COUNTING[device] = (table, table._version)
    return table[None, :length]
