"""LongPPL (Fang et al. 2025, "What is Wrong with Perplexity for Long-context Language Modeling?",
ICLR 2025; code: the ``longppl`` package, ``find_key_token``): perplexity over the *key tokens* of a
text, those whose prediction the long context helps.

For each token ``t`` of a window, the long-context loss ``L_long(t)`` is its NLL given every token
before it in the window, and the short-context loss ``L_short(t)`` its NLL given only a truncated
context: as ``find_key_token`` does, the tokens past the first ``trunc`` are scored in blocks of
``stride``, each block run with the ``trunc`` tokens before it (so a token sees between ``trunc`` and
``trunc + stride - 1`` tokens). A token is a key token when

* the long-short difference ``L_short(t) - L_long(t) > 2`` (:data:`KEY_GAP`, the paper's ``α``), and
* the long-context loss ``L_long(t) < 2`` (:data:`KEY_LOSS`, ``-β``: the evaluator predicts it well);

LongPPL is ``exp`` of the mean long-context loss over the key tokens. Here the model scored is its
own evaluator (the paper's evaluator is a separate strong model): the key tokens are those the model
itself reads from far back, so LongPPL is below ``e^2`` by the second rule, and the number of key
tokens says how much of the text the model's long context serves.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from .text import position_nll

__all__ = ["KEY_GAP", "KEY_LOSS", "key_tokens", "long_ppl", "short_context_nll"]

#: ``α``: the long-short loss difference above which a token is a key token.
KEY_GAP = 2.0
#: ``-β``: the long-context loss below which a token can be a key token.
KEY_LOSS = 2.0


def short_context_nll(model: nn.Module, ids: Tensor, trunc: int, stride: int) -> Tensor:
    """The short-context NLL ``[B, T - 1]`` of ``ids [B, T]`` (entry ``i``: token ``i + 1``, as
    :func:`~.text.position_nll`): tokens ``t >= trunc`` scored in blocks ``[s + trunc, s + trunc +
    stride)`` run from ``s``; NaN for ``t < trunc`` (its context is short already)."""
    if trunc < 1 or stride < 1:
        raise ValueError(f"short_context_nll: trunc and stride must be >= 1, got {trunc} and {stride}")
    length = ids.shape[1]
    out = torch.full((ids.shape[0], length - 1), math.nan, dtype=torch.float64)
    for start in range(0, max(length - trunc, 0), stride):
        block = ids[:, start : min(start + trunc + stride, length)]
        nll = position_nll(model, block).double().cpu()
        out[:, start + trunc - 1 : start + block.shape[1] - 1] = nll[:, trunc - 1 :]
    return out


def key_tokens(long_nll: Tensor, short_nll: Tensor, gap: float = KEY_GAP, loss: float = KEY_LOSS) -> Tensor:
    """``find_key_token``'s rule: ``(short - long > gap) & (long < loss)`` (False where the short
    loss is NaN)."""
    return ((short_nll - long_nll) > gap) & (long_nll < loss)


def long_ppl(long_nll: Tensor, keys: Tensor) -> float:
    """``exp`` of the mean long-context NLL over the key tokens (NaN without any)."""
    chosen = long_nll[keys]
    return math.exp(float(chosen.double().mean())) if chosen.numel() else math.nan
