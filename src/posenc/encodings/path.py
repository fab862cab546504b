"""PaTH: position encoding via accumulating Householder transformations (Yang et al., NeurIPS 2025).

Each token ``t`` carries a Householder-like transform ``H_t = I − β_t w_t w_tᵀ``, computed from the
layer input ``x_t`` (before the projections): ``w_t = normalize(W_w x_t)`` per key head, and
``β_t = 2·sigmoid(W_β x_t + b)`` in ``(0, 2)`` (``β > 1`` gives negative eigenvalues). The
logit of query ``i`` on key ``j <= i`` is

``s_ij = q_iᵀ H_i H_{i−1} ⋯ H_{j+1} k_j · scale``

(the product of the transforms of the tokens after the key, up to and including the query; empty,
so ``q_i·k_j``, for ``j = i``). With every ``β_t = 0`` it is NoPE. Conventions follow
flash-linear-attention ``fla/ops/path_attn/naive.py`` and ``fla/layers/path_attn.py``: ``w``
l2-normalised with ``rsqrt(Σw² + 1e-6)``, one ``(w, β)`` per key head (grouped query heads share
them), the logit scale ``1/sqrt(D)``. Differences, documented choices: ``W_w`` is one full-rank
linear map (fla: low rank 32 by default, then a short causal convolution of size 3 with SiLU,
which posenc leaves out), the transforms are computed in float32 (or wider) whatever the model
dtype, and padding tokens (``key_padding_mask``) get ``β = 0`` (the identity), so where padding
sits never changes the real tokens.

The cache invariant (as fla's decoding): a KV cache holds every key *carried* to the frame of the
last token it has seen, ``k̃_j = H_t ⋯ H_{j+1} k_j`` for ``t`` the newest cached token. A step with
new tokens ``t+1..t+n`` then needs only their transforms: ``s_ij = q_iᵀ H_i ⋯ H_{t+1} k̃_j`` for a
cached key, the formula above for a new one; afterwards the layer stores every key carried through
the new tokens' transforms (:func:`path_carry_keys`). So the attention functions here take the
query tokens' ``(w, β)`` only, and treat the ``Tk − Tq`` keys before the queries as carried ones.
A preallocated cache (``max_length``) has its buffer rewritten with the carried keys after each
step's append (the step attends to a copy); a streaming cache is refused. Under grouped-query
attention with fewer layer key heads than ``num_kv_heads`` (default ``num_heads``), the layer
repeats its keys and values to ``num_kv_heads`` before attending and caching (build PaTH with the
layer's ``num_kv_heads`` to share one transform per key head, as fla does, and keep the cache small).

Kind CONTENT, input-dependent (:meth:`PaTH.input_transform`), causal self-attention only; positions
never enter (shift invariant). Backends: ``eager`` (:func:`path_logits`: the keys carried one
query token at a time, ``O(Tq·Tk·D)`` work, dense logits) and ``householder``
(:mod:`posenc.backends.householder`: :func:`path_attention_blocked`, the chunkwise form: within a
chunk of ``C`` tokens the product of transforms is ``I − Wᵀ diag(β) A W`` with
``A = (I + tril(W Wᵀ, −1) diag(β))⁻¹`` (:func:`path_ut`, the UT transform), queries are carried
back chunk by chunk, with an online softmax; memory linear in the length, under autograd too, where
the queries run in checkpointed groups).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from .base import ContentEncoding, InputTransform, TokenStates
from .registry import at_least, register

__functional__ = [
    "path_attention_blocked",
    "path_carry_keys",
    "path_householders",
    "path_logits",
    "path_ut",
]

#: fla's ``l2_norm`` epsilon: ``w / sqrt(Σw² + eps)``.
L2_EPS = 1e-6


def _wide(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def path_householders(states: Tensor, kv_heads: int, head_dim: int) -> tuple[Tensor, Tensor]:
    """Unpack token states ``[B, S, T]`` (``S = kv_heads·(head_dim + 1)``: every head's ``w``, then
    every head's ``β``) into ``w [B, kv_heads, T, head_dim]`` and ``β [B, kv_heads, T]``.

    Raises:
        ValueError: ``states`` has another number of channels.
    """
    batch, channels, length = states.shape
    if channels != kv_heads * (head_dim + 1):
        raise ValueError(
            f"path: token states have {channels} channels, expected kv_heads·(head_dim + 1) = "
            f"{kv_heads}·{head_dim + 1}"
        )
    split = kv_heads * head_dim
    w = states[:, :split].reshape(batch, kv_heads, head_dim, length).transpose(-1, -2)
    return w, states[:, split:]


def _per_query_head(t: Tensor, heads: int) -> Tensor:
    groups = heads // t.shape[1]
    return t if groups == 1 else t.repeat_interleave(groups, dim=1)


def path_logits(q: Tensor, k: Tensor, w: Tensor, beta: Tensor) -> Tensor:
    """Unscaled PaTH logits ``[B, H, Tq, Tk]``: ``q_iᵀ H_i ⋯ H_{j+1} k_j`` for keys ``j <= i``.

    ``q [B, H, Tq, D]``, ``k [B, H|Hkv, Tk, D]``, ``w [B, H|Hkv, Tq, D]``, ``β [B, H|Hkv, Tq]``: the
    transforms of the query tokens, which are the last ``Tq`` keys; the ``Tk − Tq`` keys before them
    are carried ones (a cache's). Computed as decoding does: the keys carried one query token at a
    time (``O(Tq·Tk·D)``), in float32 or wider. Future keys (``j > i``) get ``q_i·k_j``, for the
    causal mask to hide. Returns float32 or wider.
    """
    heads, q_len, k_len = q.shape[1], q.shape[2], k.shape[2]
    dtype = _wide(q.dtype)
    keys = _per_query_head(k, heads).to(dtype)
    w, beta = _per_query_head(w, heads).to(dtype), _per_query_head(beta, heads).to(dtype)
    q, past = q.to(dtype), k_len - q_len
    index = torch.arange(k_len, device=q.device)[:, None]
    rows = []
    for a in range(q_len):
        keys = _apply_householder(keys, w[:, :, a], beta[:, :, a], index < past + a)
        rows.append(keys @ q[:, :, a, :, None])
    return torch.cat(rows, dim=-1).transpose(-1, -2) if rows else q.new_zeros(*q.shape[:3], k_len)


def _apply_householder(keys: Tensor, w: Tensor, beta: Tensor, before: Tensor) -> Tensor:
    """``H keys`` for the rows where ``before [Tk, 1]`` holds (``w [B, H, D]``, ``β [B, H]``)."""
    moved = keys - (beta[..., None, None] * (keys @ w[..., :, None])) * w[:, :, None, :]
    return torch.where(before, moved, keys)


def path_ut(w: Tensor, beta: Tensor) -> Tensor:
    """The UT transform of one chunk: ``A = (I + tril(W Wᵀ, −1) diag(β))⁻¹ [..., C, C]`` for
    ``w [..., C, D]``, ``β [..., C]``. Then ``H_C ⋯ H_1 = I − Wᵀ diag(β) A W`` (``H_1`` applied first),
    and every prefix product is the same with the leading rows and columns of ``A``."""
    size = w.shape[-2]
    lower = torch.tril(w @ w.transpose(-1, -2), diagonal=-1) * beta[..., None, :]
    eye = torch.eye(size, dtype=w.dtype, device=w.device)
    return torch.linalg.solve_triangular(eye + lower, eye.expand_as(lower), upper=False, unitriangular=True)


def _carry_rows(rows: Tensor, w: Tensor, beta: Tensor, ut: Tensor) -> Tensor:
    """Rows ``r`` (keys) carried through a whole chunk: ``(H_C ⋯ H_1) r`` for every row."""
    return rows - (((rows @ w.transpose(-1, -2)) @ ut.transpose(-1, -2)) * beta[..., None, :]) @ w


def path_carry_keys(k: Tensor, w: Tensor, beta: Tensor, chunk: int = 64) -> Tensor:
    """The keys a KV cache keeps after a step: every key ``j`` of ``k [B, Hkv, Tk, D]`` carried through
    the transforms of the later query tokens (the last ``Tq``, ``w [B, Hkv, Tq, D]``, ``β [B, Hkv, Tq]``):
    ``H_last ⋯ H_{j+1} k_j``. Chunkwise (``chunk`` tokens at a time), in float32 or wider; returns ``k``'s dtype."""
    q_len, k_len = w.shape[2], k.shape[2]
    dtype = _wide(k.dtype)
    keys, w, beta = k.to(dtype), w.to(dtype), beta.to(dtype)
    past = k_len - q_len
    done = keys[:, :, :past]
    for c0 in range(0, q_len, chunk):
        c1 = min(c0 + chunk, q_len)
        wc, bc = w[:, :, c0:c1], beta[:, :, c0:c1]
        ut = path_ut(wc, bc)
        own = keys[:, :, past + c0 : past + c1]
        inside = torch.tril(wc @ own.transpose(-1, -2), diagonal=-1)  # [s, j]: w_s·k_j for s > j
        carried = own - ((ut @ inside).transpose(-1, -2) * bc[..., None, :]) @ wc
        done = torch.cat([_carry_rows(done, wc, bc, ut), carried], dim=2)
    return done.to(k.dtype)


#: Under autograd the blocked form runs this many query tokens at a time, each group checkpointed.
GROUP_TOKENS = 1024


def path_attention_blocked(
    q: Tensor, k: Tensor, v: Tensor, w: Tensor, beta: Tensor, scale: float, chunk: int = 64
) -> Tensor:
    """Causal PaTH attention ``[B, H, Tq, Dv]`` by chunks, without any ``[Tq, Tk]`` tensor.

    ``q [B, H, Tq, D]``; ``k, v [B, H|Hkv, Tk, ·]`` whose first ``Tk − Tq`` keys are carried ones;
    ``w, β`` the query tokens' transforms (as :func:`path_logits`). Within a chunk the scores, the
    keys carried to the chunk's end and the queries carried back to its start come from the UT
    transform (:func:`path_ut`); then, for each distance ``d`` in chunks, every query chunk meets
    the key chunk ``d`` before it and is carried back through that chunk's product, all chunks at
    once; an online softmax accumulates the output. The carried keys before the queries are met
    last, by the queries carried back through every chunk. Memory ``O(Tq·(C + D))`` in inference;
    under autograd the queries run in groups of :data:`GROUP_TOKENS`, each checkpointed (recomputed
    in the backward pass), so what is kept stays linear in the length too. Computed in float32 or
    wider, returned in ``q``'s dtype.
    """
    batch, heads, q_len, _ = q.shape
    k_len, dtype = k.shape[2], _wide(q.dtype)
    past = k_len - q_len
    chunk = max(1, min(chunk, q_len))
    pad = (-q_len) % chunk
    n = (q_len + pad) // chunk

    def blocks(t: Tensor) -> Tensor:  # [B, H, T, ·] (the new tokens) -> [B, H, N, C, ·], zero-padded
        t = _per_query_head(t, heads).to(dtype)
        t = F.pad(t, (0, 0, 0, pad)) if t.dim() == 4 else F.pad(t, (0, pad))
        return t.reshape(batch, heads, n, chunk, *t.shape[3:])

    qb, kb, vb = blocks(q), blocks(k[:, :, past:]), blocks(v[:, :, past:])
    wb, bb = blocks(w), blocks(beta)
    ut = path_ut(wb, bb)  # [B, H, N, C, C]
    qw = torch.tril(qb @ wb.transpose(-1, -2)) * bb[..., None, :]  # (q_i·w_s) β_s for s <= i
    inside = ut @ torch.tril(wb @ kb.transpose(-1, -2), diagonal=-1)  # U = A R
    future = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    diagonal = ((qb @ kb.transpose(-1, -2) - qw @ inside) * scale).masked_fill(future, float("-inf"))
    keys = kb - (inside.transpose(-1, -2) * bb[..., None, :]) @ wb  # carried to the chunk's end
    z = qb - (qw @ ut) @ wb  # queries carried back to the chunk's start
    old_k = _per_query_head(k[:, :, :past], heads).to(dtype)
    old_v = _per_query_head(v[:, :, :past], heads).to(dtype)
    shared = (keys, vb, wb, bb, ut, old_k, old_v, scale)
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (z, diagonal, *shared[:-1]))
    group = max(1, GROUP_TOKENS // chunk) if grad else n
    outs = []
    for g0 in range(0, n, group):
        g1 = min(g0 + group, n)
        args = (g0, g1, z[:, :, g0:g1], diagonal[:, :, g0:g1], *shared)
        outs.append(
            checkpoint(_query_group, *args, use_reentrant=False) if g1 - g0 < n else _query_group(*args)
        )
    out = torch.cat(outs, dim=2).reshape(batch, heads, n * chunk, -1)[:, :, :q_len]
    return out.to(q.dtype)


def _query_group(
    g0: int,
    g1: int,
    z: Tensor,
    diagonal: Tensor,
    keys: Tensor,
    vb: Tensor,
    wb: Tensor,
    bb: Tensor,
    ut: Tensor,
    old_k: Tensor,
    old_v: Tensor,
    scale: float,
) -> Tensor:
    """The output ``[B, H, g1 − g0, C, Dv]`` of query chunks ``g0..g1-1`` (``z``: carried back to their
    chunk's start; ``diagonal``: their in-chunk scores) over every key before them."""
    top = diagonal.amax(dim=-1)
    probs = torch.exp(diagonal - top[..., None])
    total, acc = probs.sum(dim=-1), probs @ vb[:, :, g0:g1]
    past = old_k.shape[2]
    ends = []  # with carried keys: each chunk's queries carried back to the first token (a copy, not
    # a view that would keep the whole step's z alive)
    if g0 == 0:
        if past:
            ends.append(z[:, :, :1].clone())
        z = z[:, :, 1:]
    for d in range(1, g1):
        lo = max(g0, d)  # z holds chunks lo..g1-1, carried back to the end of chunks lo-d..g1-1-d
        keys_at = slice(lo - d, g1 - d)
        s = (z @ keys[:, :, keys_at].transpose(-1, -2)) * scale
        top, total, acc = _merge(top, total, acc, s, vb[:, :, keys_at], lo - g0)
        wk, bk, uk = wb[:, :, keys_at], bb[:, :, keys_at], ut[:, :, keys_at]
        z = z - (((z @ wk.transpose(-1, -2)) * bk[..., None, :]) @ uk) @ wk
        if d >= g0:  # chunk d has met chunk 0
            if past:
                ends.append(z[:, :, :1].clone())
            z = z[:, :, 1:]
    if past:
        batch, heads, count, chunk = diagonal.shape[:4]
        dim = old_k.shape[-1]
        flat = torch.cat(ends, dim=2).reshape(batch, heads, count * chunk, dim)
        s = ((flat @ old_k.transpose(-1, -2)) * scale).reshape(batch, heads, count, chunk, past)
        top, total, acc = _merge(top, total, acc, s, old_v[:, :, None], 0)
    return acc / total[..., None]


def _merge(top: Tensor, total: Tensor, acc: Tensor, s: Tensor, values: Tensor, first: int):
    """Online softmax: fold scores ``s`` of query chunks ``first..`` (values ``values``) into the running
    maximum ``top``, denominator ``total`` and numerator ``acc`` (out of place, for autograd)."""
    old_top, old_total, old_acc = top[:, :, first:], total[:, :, first:], acc[:, :, first:]
    new_top = torch.maximum(old_top, s.amax(dim=-1))
    p = torch.exp(s - new_top[..., None])
    fade = torch.exp(old_top - new_top)
    new_total = old_total * fade + p.sum(dim=-1)
    new_acc = old_acc * fade[..., None] + p @ values
    return (
        torch.cat([top[:, :, :first], new_top], dim=2),
        torch.cat([total[:, :, :first], new_total], dim=2),
        torch.cat([acc[:, :, :first], new_acc], dim=2),
    )


@register("path")
class PaTH(ContentEncoding):
    """PaTH (Yang et al. 2025): data-dependent Householder transforms accumulated between key and query."""

    layer_sizes = ("num_heads", "head_dim", "dim")
    option_ranges = {"num_heads": at_least(1), "head_dim": at_least(1), "dim": at_least(1)}
    shift_invariant = True
    causal_only = True
    self_attention_only = True

    def __init__(self, num_heads: int, head_dim: int, dim: int, num_kv_heads: int | None = None) -> None:
        """Args: ``num_heads``, ``head_dim`` and ``dim`` (the layer's, filled in by the layer);
        ``num_kv_heads``: the layer's key heads under grouped-query attention (default
        ``num_heads``); one ``(w, β)`` per key head, shared by its query heads."""
        super().__init__()
        for option, value in (("num_heads", num_heads), ("head_dim", head_dim), ("dim", dim)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"path: {option} must be a positive integer, got {option}={value!r}")
        kv = num_heads if num_kv_heads is None else num_kv_heads
        if isinstance(kv, bool) or not isinstance(kv, int) or kv < 1 or num_heads % kv:
            raise ValueError(
                f"path: num_kv_heads must be a positive integer dividing num_heads={num_heads}, "
                f"got num_kv_heads={num_kv_heads!r}"
            )
        self.num_heads, self.head_dim, self.num_kv_heads = num_heads, head_dim, kv
        self.to_w = nn.Linear(dim, kv * head_dim, bias=False)
        self.to_beta = nn.Linear(dim, kv)

    def _state_dtype(self) -> torch.dtype:
        return _wide(self.to_w.weight.dtype)

    def input_transform(self) -> InputTransform:
        """The transforms from the layer input (:meth:`token_states`); the cache carries its keys."""
        return InputTransform(self.token_states, self.carry_keys, key_heads=self.num_kv_heads)

    def token_states(
        self, x: Tensor, previous: Tensor | None = None, padding: Tensor | None = None
    ) -> Tensor:
        """``[B, S, T]`` (``S = Hkv·(D + 1)``: the unit ``w`` of every key head, then every ``β``) of
        ``x [B, T, dim]``; each token's own (``previous`` is not read). ``padding [B, T]`` (True =
        padding): those tokens get ``β = 0``, the identity."""
        dtype = self._state_dtype()
        w = self.to_w(x).to(dtype).unflatten(-1, (self.num_kv_heads, self.head_dim))
        w = w * torch.rsqrt(w.pow(2).sum(dim=-1, keepdim=True) + L2_EPS)
        beta = 2 * torch.sigmoid(self.to_beta(x).to(dtype))
        if padding is not None:
            beta = beta.masked_fill(padding[..., None], 0.0)
        return torch.cat([w.flatten(-2), beta], dim=-1).transpose(1, 2)

    def householders(self, states: TokenStates, k_heads: int) -> tuple[Tensor, Tensor]:
        """The query tokens' ``w [B, Hkv, Tq, D]`` and ``β [B, Hkv, Tq]``, after checking the key heads.

        Raises:
            ValueError: the keys have another number of heads than ``num_kv_heads``.
        """
        if k_heads != self.num_kv_heads:
            raise ValueError(
                f"path: built with num_kv_heads={self.num_kv_heads} but the keys have {k_heads} heads; "
                f"build it with num_kv_heads={k_heads} (path:num_kv_heads={k_heads})"
            )
        return path_householders(states.q, self.num_kv_heads, self.head_dim)

    def carry_keys(self, k: Tensor, states: TokenStates) -> Tensor:
        """The keys ``k [B, Hkv, Tk, D]`` carried through the new tokens' transforms (what the cache keeps)."""
        w, beta = self.householders(states, k.shape[1])
        return path_carry_keys(k, w, beta)

    def logits(
        self,
        q: Tensor,
        k: Tensor,
        q_pos: Tensor,
        k_pos: Tensor,
        *,
        scale: float,
        layer: nn.Module | None = None,
        token_states: TokenStates | None = None,
    ) -> Tensor:
        """The scaled logits ``[B, H, Tq, Tk]`` (:func:`path_logits`) from the query tokens' states."""
        if token_states is None:
            raise ValueError(
                "token_states: path computes its transforms from the layer input; pass token_states "
                "(TokenStates of encoding.token_states(x)), or call the layer"
            )
        # eager hands keys repeated per query head: w and β are repeated alike
        w, beta = path_householders(token_states.q, self.num_kv_heads, self.head_dim)
        return (path_logits(q, k, w, beta) * scale).to(q.dtype)

    def preview(self) -> str:
        return (
            f"{self.num_kv_heads} key heads of size {self.head_dim}: s_ij = q_i^T H_i ... H_(j+1) k_j, "
            "H_t = I - beta_t w_t w_t^T, w_t and beta_t in (0, 2) from the input; beta = 0 is NoPE"
        )
