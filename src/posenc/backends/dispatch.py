"""The order in which ``auto`` tries the backends: one list per device type.

Like xformers' ``_dispatch_fw_priority_list``, the preference lives in one place. A backend's
``reasons()`` are hard limits only and ``declines()`` are costs that ``auto`` weighs; the order
between backends that both could serve a request is decided here, never by one backend asking
another whether it could run.

* **cpu**: ``blocked`` first (BIAS kinds through the fused CPU flash kernel, training included),
  ``flex`` (declines on CPU: a compile per shape), ``relative`` (CONTENT kinds), ``sdpa``
  (ABSOLUTE, ROTARY, small BIAS problems), ``eager`` (serves everything).
* **cuda / xpu**: ``flex`` first (FlexAttention fuses the bias into the kernel, forward and
  backward), then as on CPU.

A backend that is registered but named in no list is tried after the listed ones, in
registration order; :func:`set_priority` replaces a device type's list.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

__all__ = ["DEFAULT_PRIORITY", "PRIORITY", "priority_list", "set_priority"]

DEFAULT_PRIORITY: tuple[str, ...] = ("blocked", "flex", "relative", "sdpa", "eager")

PRIORITY: dict[str, tuple[str, ...]] = {
    "cpu": DEFAULT_PRIORITY,
    "cuda": ("flex", "blocked", "relative", "sdpa", "eager"),
    "xpu": ("flex", "blocked", "relative", "sdpa", "eager"),
}


def _device_type(device: torch.device | str) -> str:
    return torch.device(device).type if not isinstance(device, torch.device) else device.type


def priority_list(device: torch.device | str, registered: Mapping[str, object] | Iterable[str]) -> list[str]:
    """The registered backend names in ``auto``'s order for ``device``."""
    names = list(registered)
    listed = PRIORITY.get(_device_type(device), DEFAULT_PRIORITY)
    return [n for n in listed if n in names] + [n for n in names if n not in listed]


def set_priority(device_type: str, order: Iterable[str]) -> None:
    """Replace the order ``auto`` tries backends in on ``device_type`` (``"cpu"``, ``"cuda"``, ...)."""
    order = tuple(order)
    if len(set(order)) != len(order):
        raise ValueError(f"set_priority: a backend is named twice in {order}")
    PRIORITY[device_type] = order
