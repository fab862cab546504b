"""The checks of the keywords that describe a mask to :meth:`~posenc.masks.attention_mask.AttentionMask.build`:
``causal``, ``causal_offset``, ``key_padding_mask`` and ``attn_mask``.

They ran on :class:`~posenc.backends.AttentionRequest` when the request still carried these fields;
they run where the mask is built now, so a mistake names the keyword whoever builds the mask (the
request's :meth:`~posenc.backends.AttentionRequest.from_keywords` says ``AttentionRequest.<keyword>``).
O(1): shapes, dtypes and devices, never tensor values (this runs on every decode step).
"""

from __future__ import annotations

import numbers

import torch
from torch import Tensor

__all__ = ["MaskKeywordError", "checked_attn_mask", "described"]


class MaskKeywordError(ValueError):
    """A mask keyword that is wrong: :attr:`keyword` names it, :attr:`problem` says what and what to do."""

    def __init__(self, keyword: str, problem: str) -> None:
        super().__init__(f"{keyword}: {problem}")
        self.keyword = keyword
        self.problem = problem


def described(value: object) -> str:
    """``value`` as an error message shows it: a tensor by dtype and shape, anything else by repr."""
    if isinstance(value, Tensor):
        return f"a {value.dtype} tensor of shape {list(value.shape)}"
    return f"{value!r} ({type(value).__name__})"


def checked_attn_mask(
    *,
    q_len: int,
    k_len: int,
    batch: int,
    heads: int,
    device: torch.device,
    causal: object,
    causal_offset: object,
    key_padding_mask: object,
    attn_mask: object,
) -> Tensor | None:
    """Check the four keywords (a :class:`MaskKeywordError` names the one at fault) and return
    ``attn_mask`` with its query and key dimensions expanded to ``Tq`` and ``Tk`` (the query blocks
    slice rows and keys of it), or None."""
    if not isinstance(causal, bool):
        raise MaskKeywordError("causal", f"must be True or False, got {causal!r}")
    offset = causal_offset
    if isinstance(offset, bool) or not isinstance(offset, numbers.Integral) or offset < 0:
        raise MaskKeywordError("causal_offset", f"must be an int >= 0 (the cache length), got {offset!r}")
    if key_padding_mask is not None:
        _check_padding(key_padding_mask, batch, k_len, device)
    if attn_mask is None:
        return None
    mask = attn_mask
    want = (batch, heads, q_len, k_len)
    if not isinstance(mask, Tensor) or not (mask.dtype == torch.bool or mask.is_floating_point()):
        raise MaskKeywordError(
            "attn_mask", f"must be a bool (True = may attend) or float tensor, got {described(mask)}"
        )
    if mask.dim() != 4 or any(n not in (1, w) for n, w in zip(mask.shape, want)):
        raise MaskKeywordError(
            "attn_mask",
            f"must be 4-D and broadcastable to [B, H, Tq, Tk] = {list(want)}, got {list(mask.shape)}",
        )
    if not _same_device(mask.device, device):
        raise MaskKeywordError("attn_mask", f"is on device {mask.device} but q is on {device}")
    if mask.shape[2] != q_len or mask.shape[3] != k_len:  # the blocks slice rows and keys
        mask = mask.expand(-1, -1, q_len, k_len)
    return mask


def _check_padding(padding: object, batch: int, k_len: int, device: torch.device) -> None:
    if not isinstance(padding, Tensor) or padding.dtype != torch.bool:
        raise MaskKeywordError(
            "key_padding_mask", f"must be a bool tensor [B, Tk] (True = padding), got {described(padding)}"
        )
    if tuple(padding.shape) != (batch, k_len):
        raise MaskKeywordError(
            "key_padding_mask", f"must have shape [B, Tk] = [{batch}, {k_len}], got {list(padding.shape)}"
        )
    if not _same_device(padding.device, device):
        raise MaskKeywordError("key_padding_mask", f"is on device {padding.device} but q is on {device}")


def _same_device(have: torch.device, want: torch.device) -> bool:
    """``want`` may leave the index out (``AttentionMask.build(device="cuda")``): any index matches."""
    return have == want or (have.type == want.type and want.index is None)
