"""What an encoding offers the backends beyond its kind's hook, as plain records: the token states
an input-dependent term is computed from (:class:`TokenStates`), the forms a bias takes far from the
diagonal (:class:`NearFar`, :class:`SeparableBias`), an input-dependent bias or transform
(:class:`InputBias`, :class:`InputTransform`), a CONTENT encoding's clipped rows
(:class:`ClippedRelative`), and a cache entry's finite mark (:class:`FiniteMark`). Encodings return
them from their ``near_far()``, ``input_bias()``, ``clipped_relative()`` and ``input_transform()``
(:mod:`posenc.encodings.base`); backends read them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = [
    "ClippedRelative",
    "FiniteMark",
    "InputBias",
    "InputTransform",
    "NearFar",
    "SeparableBias",
    "TokenStates",
]


@dataclass
class FiniteMark:
    """Set when every stored key and value of a cache entry has been checked finite (one attention
    request's ``has_nonfinite`` sets it); the next step's request need not read them again."""

    finite: bool = False


@dataclass(frozen=True)
class TokenStates:
    """What an input-dependent bias is computed from (FoX's cumulative log forget gates).

    ``q [B, S, Tq]`` and ``k [B, S, Tk]``: per-token states of the queries and the keys (``S`` is the
    encoding's number of state channels, float32 or wider); ``q_index [Tq]`` and ``k_index [Tk]``
    (int64): each token's index in its sequence, counting every token the layer has seen (cached
    and evicted ones included), so an encoding can tell earlier keys from later ones.
    """

    q: Tensor
    k: Tensor
    q_index: Tensor
    k_index: Tensor

    @classmethod
    def same_sequence(cls, states: Tensor) -> TokenStates:
        """Self-attention over one fresh sequence: queries and keys are the same tokens ``0..T-1``."""
        index = torch.arange(states.shape[-1], device=states.device)
        return cls(q=states, k=states, q_index=index, k_index=index)

    def tensors(self) -> tuple[Tensor, Tensor]:
        return self.q, self.k


@dataclass(frozen=True)
class SeparableBias:
    """A bias that is a row term plus a key term on one side of the diagonal.

    ``bias_at(h, q_pos[b, i], k_pos[b, j]) == row[b, h, i] + col[b, h, j]`` for every pair on ``side``:
    ``"before"`` (``k_pos <= q_pos``), ``"after"`` (``k_pos >= q_pos``) or ``"all"``. ``row [B|1, H, Tq]``
    and ``col [B|1, H, Tk]`` are float64 when they come from exact integer positions (the attention
    kernel re-centres them on each query block before rounding to float32), or whatever the encoding
    computes them in (an input-dependent term such as FoX's cumulative log forget gates).
    """

    side: str
    row: Tensor
    col: Tensor


@dataclass(frozen=True)
class NearFar:
    """What the near/far split (:mod:`posenc.backends.near_far`) needs of a BIAS encoding: how its bias
    is cheap far from the diagonal. One of the two is set.

    ``far_constant_beyond``: a distance ``d`` past which the bias is one constant per head and
    direction (``bias_at(h, i, j)`` takes one value for every ``j − i <= −d`` and one, maybe another,
    for every ``j − i >= d``), so the far part runs as maskless attention plus a constant (T5's last
    buckets); needs ``shift_invariant``.

    ``separable(q_pos, k_pos)``: the bias as row and key terms (:class:`SeparableBias`) for positions
    ``[B|1, Tq]``, ``[B|1, Tk]``. The sides together must cover every pair (``"all"``, or ``"before"``
    and ``"after"``); a causal layer needs only ``"before"`` (or ``"all"``). The key term then rides in
    one extra head dimension and the row term in the log-sum-exp (ALiBi: ``−m(i − j) = −m·i + m·j``).
    The terms may require grad (an input-dependent form such as ``c_i − c_j``): the split returns
    their gradients for a causal layer. An encoding that is not ``shift_invariant`` is served that
    way under a causal mask only.
    """

    far_constant_beyond: int | None = None
    separable: Callable[[Tensor, Tensor], tuple[SeparableBias, ...]] | None = None


@dataclass(frozen=True)
class InputBias:
    """What an input-dependent bias (FoX) is computed with; only the backends that declare
    ``serves_input_bias`` run it.

    ``token_states(x, previous, padding) -> [B, S, T]``: per-token states of the layer input
    ``x [B, T, E]`` (the layer calls it before the projections); ``previous [B, S, Tpast]`` holds the
    cached tokens' states, which the new ones continue, ``padding [B, T]`` (bool, True = padding) the
    new tokens that are padding. ``bias_from_states(TokenStates) -> [B, H, Tq, Tk]``: the dense bias.
    ``causal_key_term(TokenStates) -> [B, H, Tk]``, or None: for a bias that is a row term plus a key
    term for keys at or before the query (``bias_ij = row_i + key_j``, ``j <= i``), the key term; under
    a causal mask the row term cancels in the softmax, so sdpa runs the bias as plain causal attention
    over keys with one extra dimension (FoX: ``key_j = −c_j``).
    ``bias_at_index(TokenStates, b, h, q_idx, kv_idx) -> Tensor``, or None: the same bias for
    broadcastable integer tensors of batch, head, query and key indices, elementwise in them (the
    flex backend's ``score_mod`` evaluates it per score; it must equal ``bias_from_states``).
    """

    token_states: Callable[[Tensor, Tensor | None, Tensor | None], Tensor]
    bias_from_states: Callable[[TokenStates], Tensor]
    causal_key_term: Callable[[TokenStates], Tensor] | None = None
    bias_at_index: Callable[[TokenStates, Tensor, Tensor, Tensor, Tensor], Tensor] | None = None


@dataclass(frozen=True)
class ClippedRelative:
    """A CONTENT encoding whose position terms are table rows indexed by the distance, constant far away.

    For every pair at distance ``d = j − i`` (key position minus query position), with
    ``r = index(d)``: the logit gains ``scale · (q_i · key_rows[h, r] + k_j · query_rows[h, r])`` and
    the value gains ``value_rows[h, r]``. Rows are ``[H|1, R, D]`` (1: shared over heads); a term
    the encoding lacks is None. ``index`` maps an int64 tensor of distances to rows, and is constant
    for ``d <= −far_before`` and for ``d >= far_after`` (Shaw: ``clip(d, −k, k) + k``, both ``k``;
    DeBERTa: its log buckets, saturated past its maximum distance). The ``clipped`` backend
    uses this (:mod:`posenc.backends.clipped`).
    """

    index: Callable[[Tensor], Tensor]
    far_before: int
    far_after: int
    key_rows: Tensor | None = None
    query_rows: Tensor | None = None
    value_rows: Tensor | None = None


@dataclass(frozen=True)
class InputTransform:
    """What a CONTENT encoding whose transform between query and key depends on the layer input
    (PaTH) is computed with; only the backends that declare ``serves_input_bias`` run it.

    ``token_states(x, previous, padding) -> [B, S, T]``: per-token states of the layer input, as
    :class:`InputBias` has them; the logits then take ``token_states=`` (:class:`TokenStates`).
    ``carry_keys(k, TokenStates) -> k``, or None: the keys a KV cache keeps after a step, when they
    differ from those the step attends to (PaTH carries every key through the new tokens'
    transforms); the layer stores them after appending. ``key_heads``: the key heads the transform
    acts on, or None (the layer's): a grouped-query layer that projects fewer key heads repeats its
    keys and values to them (a multiple of its own) before they are attended to and cached.
    """

    token_states: Callable[[Tensor, Tensor | None, Tensor | None], Tensor]
    carry_keys: Callable[[Tensor, TokenStates], Tensor] | None = None
    key_heads: int | None = None
