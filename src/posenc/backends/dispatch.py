"""The order in which ``auto`` tries the backends: one list per device type.

Like xformers' ``_dispatch_fw_priority_list``, the preference lives in one place. A backend's
``reasons()`` are hard limits only and ``declines()`` are costs that ``auto`` weighs; the order
between backends that both could serve a request is decided here, never by one backend asking
another whether it could run.

* **cpu**: the exact splits first, each right before the backend whose query blocks it beats on the
  requests it serves (``auto`` weighs the same costs for both): ``near_far`` (long square
  self-attention with a BIAS encoding that is simple far away), ``segments`` (ABSOLUTE and ROTARY
  under windows, documents, chunks), ``blocked`` (BIAS kinds through the fused CPU flash kernel,
  training included), ``flex`` (declines on CPU: a compile per shape), ``clipped`` (CONTENT kinds
  with clipped relative tables, long square self-attention), ``householder`` (PaTH's chunkwise form,
  causal masks only), ``piecewise`` (ReRoPE, Self-Extend, DCA: square causal self-attention by tiles of
  the CPU flash kernel), ``relative`` (CONTENT kinds), ``sdpa``
  (ABSOLUTE, ROTARY, small BIAS problems), ``eager`` (serves everything).
* **cuda / xpu**: ``flex`` first (FlexAttention fuses the bias into the kernel, forward and
  backward), then as on CPU (the splits run the CPU kernel: they state that as a reason).

A backend that is registered but named in no list is tried after the listed ones, in
registration order; :func:`set_priority` replaces a device type's list (so does editing ``PRIORITY``
directly: the dispatcher's memo is keyed on the order as it stands, see :func:`listed_order`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

__all__ = ["DEFAULT_PRIORITY", "PRIORITY", "listed_order", "priority_list", "set_priority"]

DEFAULT_PRIORITY: tuple[str, ...] = (
    "near_far",
    "segments",
    "blocked",
    "flex",
    "clipped",
    "householder",
    "piecewise",
    "relative",
    "sdpa",
    "eager",
)
_ACCELERATOR = (
    "flex",
    "near_far",
    "segments",
    "blocked",
    "clipped",
    "householder",
    "piecewise",
    "relative",
    "sdpa",
    "eager",
)

PRIORITY: dict[str, tuple[str, ...]] = {"cpu": DEFAULT_PRIORITY, "cuda": _ACCELERATOR, "xpu": _ACCELERATOR}


def _device_type(device: torch.device | str) -> str:
    return torch.device(device).type if not isinstance(device, torch.device) else device.type


def listed_order(device_type: str) -> tuple[str, ...]:
    """``PRIORITY``'s list for ``device_type`` as it stands now, as a tuple: memos key on it, so an edit
    of ``PRIORITY`` (not only :func:`set_priority`) changes what they answer."""
    listed = PRIORITY.get(device_type, DEFAULT_PRIORITY)
    return listed if type(listed) is tuple else tuple(listed)


def priority_list(device: torch.device | str, registered: Mapping[str, object] | Iterable[str]) -> list[str]:
    """The registered backend names in ``auto``'s order for ``device``."""
    names = list(registered)
    listed = listed_order(_device_type(device))
    return [n for n in listed if n in names] + [n for n in names if n not in listed]


def set_priority(device_type: str, order: Iterable[str]) -> None:
    """Replace the order ``auto`` tries backends in on ``device_type`` (``"cpu"``, ``"cuda"``, ...)."""
    order = tuple(order)
    if len(set(order)) != len(order):
        raise ValueError(f"set_priority: a backend is named twice in {order}")
    PRIORITY[device_type] = (
        order  # the dispatcher's memo keys on the order: no entry of the old one is served
    )
