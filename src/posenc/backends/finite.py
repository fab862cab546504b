"""The non-finite checks of a request: whether its tensors (and the encoding's parameters) hold a
nan or an inf, at the cost of one reduction where the values allow it. A backend must never turn a
nan into finite numbers, so :class:`~posenc.backends.request.AttentionRequest` asks these once."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

__all__ = [
    "SMALL_SUM",
    "all_finite",
    "all_finite_together",
    "all_parameters",
    "block_finite",
    "new_tokens_finite",
    "sums_finite",
]


def all_finite(t: Tensor) -> bool:
    """Whether every element of the floating tensor ``t`` is finite, in one reduction.

    A finite sum means every element is finite (nan and inf propagate, and ``inf − inf`` is nan); a
    sum that is not finite may also be an overflow, so only then is each element tested. The sum
    accumulates in float64 where the device has it, so float32 inputs cannot overflow it.
    ``torch.isfinite(t).all()`` alone makes three full-size temporaries (``abs`` and two comparisons):
    15% of a long DeBERTa forward on CPU, paid by every request a CPU backend checks.
    """
    wide = torch.float64 if t.device.type in ("cpu", "cuda") else None
    return bool(torch.isfinite(t.sum(dtype=wide))) or bool(torch.isfinite(t).all())


def all_finite_together(tensors: tuple[Tensor, ...]) -> bool:
    """:func:`all_finite` of every floating tensor of ``tensors``, in as few host syncs as possible.

    A decode step's q, k and v are a few hundred numbers, so the cost is in the calls, not the
    reductions. On CPU each sum is read into a Python float and the floats are added: nan and inf
    propagate there too, and a float64 total cannot overflow. A small tensor sums in its own dtype,
    a large one in float32 at least (half types would overflow on ordinary values); an overflow only
    sends it to the exact test below. A float32 tensor summed in float64 is converted first: three
    of DeBERTa's ``[1, 8, 4096, 64]`` operands took 30-70 ms that way on one CPU thread (a tenth
    to a fifth of a plain causal SDPA call), against under 2 ms in float32.
    """
    floating = [t for t in tensors if t.is_floating_point()]
    if not floating:
        return True
    return sums_finite(floating) or all(all_finite(t) for t in floating)


def block_finite(block: Tensor) -> bool:
    """:func:`all_finite` of one small CPU block that needs no gradient (a decode step's q, new key
    and value, concatenated by the caller): its sum read as a Python float, the exact test only when
    that sum is not finite (a nan, an inf or an overflow). The plain decode steps call it instead of
    :func:`all_finite_together`, whose generic checks cost more than the sum at this size."""
    return math.isfinite(float(block.sum())) or all_finite(block)


def new_tokens_finite(q: Tensor, k: Tensor, v: Tensor) -> tuple[bool, Tensor | None]:
    """The nan test of a plain decode step's q ``[B, H, 1, D]`` and new key and value ``[B, Hkv, 1,
    D]``, on CPU without gradient: ``(finite, block)``. Where the three share their width they are
    tested as one ``[B, H + 2 Hkv, 1, D]`` block, one sum (:func:`block_finite`), and ``block`` is
    that copy, which the caller may keep; values of another width (MLA) are tested apart
    (:func:`all_finite_together`) and ``block`` is None."""
    if k.shape[-1] == q.shape[-1] == v.shape[-1]:
        block = torch.cat((q, k, v), 1)
        return block_finite(block), block
    return all_finite_together((q, k, v)), None


def sums_finite(floating: list[Tensor]) -> bool:
    """True when the sums of ``floating`` are finite (then every element is); False may be an overflow."""
    if all(t.device.type == "cpu" for t in floating):
        total = 0.0
        for t in floating:
            t = t.detach() if t.requires_grad else t  # a value read, not a graph (and no warning)
            total += float(
                t.sum(dtype=torch.promote_types(t.dtype, torch.float32)) if t.numel() > SMALL_SUM else t.sum()
            )
        return math.isfinite(total)
    if len({(t.device, t.dtype) for t in floating}) == 1 and floating[0].device.type == "cuda":
        return bool(torch.isfinite(torch.stack([t.sum(dtype=torch.float64) for t in floating]).sum()))
    return False


#: Up to this many elements a sum in the tensor's own dtype is cheaper than in float32 or float64
#: (half types are converted first).
SMALL_SUM = 1 << 14


def all_parameters(module: nn.Module) -> list[Tensor]:
    """``list(module.parameters())`` without its generator chain and duplicate set (a hot path:
    every request reads its encoding's parameters for nan); a shared parameter may appear twice."""
    found = [p for p in module._parameters.values() if p is not None]
    for child in module._modules.values():
        if child is not None:
            found += all_parameters(child)
    return found
