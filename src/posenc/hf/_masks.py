"""posenc's entry in HF's ``AttentionMaskInterface``: HF's ``sdpa_mask``, except that a plain sliding
window is passed on as None (the window itself reaches the attention function as ``sliding_window``).

HF builds each layer type's mask once per forward through the mask interface of the model's
``attn_implementation``. For a sliding-window layer, HF's ``sdpa_mask`` materialises a dense bool
``[B, 1, L, L]`` (1 GiB at 32k tokens) even when it is nothing but causal-with-a-window, and the
bridge then had to compare it whole with posenc's structured window before the window backends could
serve it (:func:`posenc.hf._attention._window_mask`). :func:`posenc_mask` skips both: when the
call is a plain prefill window (below), it returns None, and :func:`~posenc.hf.attention_forward`
reads None with a ``sliding_window`` as causal with that window, the rule HF's flash-attention
path applies to the same arguments. Anything else (padding, packed documents, block overlays, a
model's own ``or``/``and`` mask functions, a cache offset, a traced graph) is ``sdpa_mask``'s,
unchanged.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


def posenc_mask(*args: Any, **kwargs: Any) -> Tensor | None:
    """HF's ``sdpa_mask(**kwargs)``, or None for a plain sliding window (:func:`plain_window`)."""
    from transformers.masking_utils import sdpa_mask

    if not args and plain_window(kwargs) is not None:
        return None
    return sdpa_mask(*args, **kwargs)


def plain_window(kwargs: dict[str, Any]) -> int | None:
    """The window ``W`` when the mask HF asks for is exactly causal with the last ``W`` keys over a
    fresh, unpadded sequence (query ``i`` sees keys ``i - W < j <= i``); else None.

    Read off the mask interface's own arguments (transformers 5.21 and 5.24 pass them by keyword; a
    release that passes other ones gets ``sdpa_mask``, as any argument missing here means None):

    * ``local_size`` set: a sliding-window or chunked layer (the two factories that pass it);
    * ``allow_is_causal_skip`` true and ``use_vmap`` false: HF clears them when the model adds an
      ``or``/``and`` mask function, packed documents (``position_ids`` restarting) or block ids, so
      the mask function is the factory's own rule;
    * ``q_offset == kv_offset == 0`` and ``q_length == kv_length``: no cache before these tokens;
    * the 2-D ``attention_mask`` absent or all True: no padding;
    * the mask function equals the window rule on the first ``W + 1`` positions, which tells the
      sliding rule from the chunked one (chunk ``W``: query ``W`` and key ``W - 1`` differ).
    """
    window = kwargs.get("local_size")
    if not isinstance(window, int) or window < 1 or torch.compiler.is_compiling():
        return None
    if kwargs.get("allow_is_causal_skip") is not True or kwargs.get("use_vmap") is not False:
        return None
    q_len, k_len = kwargs.get("q_length"), kwargs.get("kv_length")
    offsets = (kwargs.get("q_offset"), kwargs.get("kv_offset"))
    if not (
        isinstance(q_len, int) and q_len == k_len and all(isinstance(o, int) and o == 0 for o in offsets)
    ):
        return None
    padding = kwargs.get("attention_mask")
    if padding is not None and not (isinstance(padding, Tensor) and bool(padding.all())):
        return None
    rule = kwargs.get("mask_function")
    if rule is None or not _is_window_rule(rule, window, min(q_len, window + 1)):
        return None
    return window


def _is_window_rule(rule: Any, window: int, n: int) -> bool:
    """Whether HF's index-based mask function ``rule`` keeps exactly ``i - window < j <= i`` on the
    first ``n`` queries and keys (called on broadcast indices, as ``sdpa_mask`` calls it)."""
    index = torch.arange(n)
    i, j = index[:, None], index[None, :]
    want = (j <= i) & (j > i - window)
    zero = torch.zeros(1, 1, 1, 1, dtype=torch.long)
    try:
        kept = rule(zero, zero, index[None, None, :, None], index[None, None, None, :])
        return isinstance(kept, Tensor) and bool((kept.expand(1, 1, n, n) == want).all())
    except (TypeError, RuntimeError, IndexError):  # a rule that needs other arguments or devices: not ours
        return False
