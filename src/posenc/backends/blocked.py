"""``blocked`` backend: query-blocked attention for BIAS encodings, training included.

Why: SDPA with a float bias needs the dense ``[B, H, Tq, Tk]`` bias, and on CPU under autograd it
falls back to its math kernel (several times slower than plain SDPA). This backend never builds the
dense bias. It walks over blocks of queries; for each block it builds the bias rows from the
encoding (with every mask folded in as ``finfo.min``) and runs one fused attention kernel on them:
on CPU the FlashAttention kernel behind SDPA (``aten::_scaled_dot_product_flash_attention_for_cpu``,
which takes a float mask), elsewhere an explicit softmax. The backward pass (a custom
:class:`torch.autograd.Function`) rebuilds the bias rows per block: when no gradient is needed for the
bias (ALiBi; frozen tables) the fused CPU backward kernel runs; otherwise the block's logits are
recomputed from the saved log-sum-exp, FlashAttention-2 style, and the logit gradient is reduced into
the encoding's parameters. Memory is ``O(H · block · Tk)`` instead of ``O(H · Tq · Tk)``; causal
attention skips the keys after each block (half the work, like SDPA's causal kernel).

The bias comes from the encoding's single definition, ``bias_at(head, q_pos, k_pos)``:

* **distance table** (``encoding.shift_invariant``): the bias depends on ``k_pos - q_pos`` only, so
  ``bias_at`` is evaluated once on the ``[H, n_distances]`` table of the distances that occur.
  When both position rows are consecutive integers (the usual case, a cache offset included) every
  block's rows are a window of one ``[H, block, Tq + Tk - 1]`` Toeplitz strip built once, and the
  causal mask is folded into the strip; otherwise each block gathers from the table. The table's
  gradient is the sum of the logit gradients along each diagonal (per distance), and autograd carries
  it from the table into the encoding's parameters.
* **per block** (anything else, e.g. a bias normalised by the query position): ``bias_at`` is
  evaluated on each block; in the backward pass it is re-evaluated under autograd and
  ``torch.autograd.grad`` carries the block's logit gradients into the encoding's parameters.

The exact splits that beat masked blocks on some requests are backends of their own, tried before
this one: ``near_far`` (long square self-attention with a far constant or separable terms) and
``segments`` (kinds without a bias under windows, documents and chunks).

**Soft-capping** (``request.softcap``, Gemma 2) needs each ``q·kᵀ·scale`` before the bias is added,
which the fused kernel never exposes: a capped request runs the explicit blocks forward and backward
(``c·tanh(s / c)``, then the bias rows; the backward multiplies the logit gradient by ``1 − tanh²``
for q and k, while the bias still gets the gradient of the capped, biased logits). This is the
backend ``auto`` picks for soft-capped ABSOLUTE, ROTARY and BIAS requests on CPU (sdpa takes no logits).

Masks come from the request's :class:`~posenc.masks.attention_mask.AttentionMask`: ``key_range`` tells a block
which keys it can skip, ``rows`` gives its boolean rows (hidden logits become ``finfo(dtype).min``
and so get probability 0 and no gradient), and rows that see no key are zeroed after the kernel.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from ..encodings.base import Kind
from ..masks.attention_mask import AttentionMask, CausalMask
from . import AttentionRequest, register_backend
from .parts.exact import at_least_float32, consecutive, distance_table
from .parts.flash import accumulation_dtype, cpu_flash_limit, flash_backward, flash_forward, kernel_layout
from .parts.query_blocks import (  # shared with the splits; re-exported under their old names here
    DEFAULT_BLOCK,
    MAX_DENSE_MASK_BYTES,
    MIN_AUTO_LOGITS,
    query_block_declines,
    query_block_reasons,
)
from .parts.sinks import merge_sinks, sink_grad
from .parts.softcap import soft_cap, soft_cap_backward

__all__ = [
    "DEFAULT_BLOCK",
    "MAX_DENSE_MASK_BYTES",
    "MIN_AUTO_LOGITS",
    "BlockedBackend",
    "blocked_bias_attention",
    "query_block_declines",
    "query_block_reasons",
]

#: Use the distance table only while it stays small relative to the sequence (sparse explicit
#: positions such as 0 and 10**6 would make it huge); otherwise evaluate ``bias_at`` per block.
_MAX_TABLE_FACTOR = 4


@dataclass
class _Plan:
    """What the forward and backward passes share (everything but the differentiable tensors)."""

    encoding: object
    heads: int
    scale: float
    q_pos: Tensor  # [Bp, Tq] int64
    k_pos: Tensor  # [Bk, Tk] int64
    mask: AttentionMask
    block: int
    mode: str  # "toeplitz" | "gather" | "function" (BIAS kinds) | "none" (no bias: masks only)
    d_min: int  # smallest distance k_pos - q_pos (table modes)
    use_flash: bool
    q_len: int
    softcap: float | None = None  # c in c·tanh(s / c) on the q/k logits (explicit blocks only)
    strip: Tensor | None = field(default=None, repr=False)  # toeplitz: [H, block, Tq + Tk - 1]
    param_names: list[str] = field(default_factory=list)  # function mode: "encoding.<name>" of params
    state: dict[str, Tensor] = field(default_factory=dict, repr=False)  # every tensor of the encoding

    @property
    def strip_mask(self) -> AttentionMask:
        """What the bias rows still need on top of the Toeplitz strip (which holds the causal mask)."""
        return self.mask.without(CausalMask)


# ---------------------------------------------------------------------------- bias per block


def _toeplitz_strip(plan: _Plan, table: Tensor, q_len: int, dtype: torch.dtype) -> Tensor:
    """``strip[h, r, c] = table[h, c - r]`` (``[H, block, Tq + Tk - 1]``), causal mask folded in.

    With consecutive positions, block ``i0``'s bias rows for keys ``k0:k1`` are
    ``strip[:, :rows, s + k0 : s + k1]`` with
    ``s = Tq - 1 - i0``: a view with positive strides, so blocks need no copy of their own.
    """
    heads, width = table.shape
    rows = min(plan.block, q_len)
    values = table.to(dtype)
    offset = plan.mask.causal_offset
    if offset is not None:
        # Index c - r = (j - i) + (Tq - 1): key j is in the future of query i when j - i > offset.
        values = values.clone()
        values[:, max(0, offset + q_len) :] = torch.finfo(dtype).min
    # padded[h, e] = values[h, e - (rows - 1)]; strip row r, column c reads padded[c - r + rows - 1],
    # i.e. in reversed row order r' = rows - 1 - r it reads padded[c + r']: positive strides.
    padded = torch.cat((values.new_zeros(heads, rows - 1), values), dim=1)
    reversed_rows = padded.as_strided((heads, rows, width), (padded.stride(0), 1, 1))
    return reversed_rows.flip(1)


def _block_rows_float32(
    plan: _Plan,
    table: Tensor | None,
    i0: int,
    i1: int,
    k0: int,
    k1: int,
    state: dict[str, Tensor] | None = None,
) -> Tensor:
    """Bias rows ``[Bp, H, rows, k1 - k0]`` (float32 or float64) for the gather and function modes.

    ``state`` (function mode, backward pass): the encoding's tensors to evaluate ``bias_at`` with.
    """
    if plan.mode == "gather":
        dist = plan.k_pos[:, None, k0:k1] - plan.q_pos[:, i0:i1, None] - plan.d_min  # [Bp, rows, keys]
        return table[:, dist].transpose(0, 1)
    device = plan.q_pos.device
    head = torch.arange(plan.heads, device=device)[None, :, None, None]
    args = (head, plan.q_pos[:, None, i0:i1, None], plan.k_pos[:, None, None, k0:k1])
    if state is None:
        return at_least_float32(plan.encoding.bias_at(*args))
    return at_least_float32(torch.func.functional_call(_BiasAt(plan.encoding), state, args))


def _block_bias(
    plan: _Plan,
    table: Tensor | None,
    i0: int,
    i1: int,
    k0: int,
    k1: int,
    dtype: torch.dtype,
    state: dict | None = None,
) -> Tensor | None:
    """The block's additive mask ``[B|1, H|1, rows, k1 - k0]`` in ``dtype``: the bias, hidden keys at
    ``finfo(dtype).min`` and the user's float mask; None when there is nothing to add (no bias, and
    every key of the range is visible to every row)."""
    if plan.mode == "none":
        return _mask_rows(plan.mask, i0, i1, k0, k1, dtype)
    if plan.mode == "toeplitz":
        start = plan.q_len - 1 - i0
        bias = plan.strip[None, :, : i1 - i0, start + k0 : start + k1]
        mask = plan.strip_mask
        if mask.is_trivial:
            return bias
    else:
        bias = _block_rows_float32(plan, table, i0, i1, k0, k1, state).to(dtype)
        mask = plan.mask
    additive = mask.additive_rows(i0, i1, k0, k1)
    if additive is not None:
        bias = bias + additive.to(dtype)
    allowed = mask.rows(i0, i1, k0, k1)
    if allowed is not None:
        bias = bias.masked_fill(~allowed, torch.finfo(dtype).min)
    return bias


def _mask_rows(mask: AttentionMask, i0: int, i1: int, k0: int, k1: int, dtype: torch.dtype) -> Tensor | None:
    """The mask alone as additive rows ``[B|1, H|1, rows, keys]`` (kinds without a bias), or None."""
    allowed = mask.rows(i0, i1, k0, k1)
    additive = mask.additive_rows(i0, i1, k0, k1)
    if allowed is not None and bool(allowed.all()):
        allowed = None  # a block inside the visible band runs the kernel's maskless path
    if allowed is None and additive is None:
        return None
    rows = additive.to(dtype) if additive is not None else torch.zeros(1, 1, i1 - i0, k1 - k0, dtype=dtype)
    rows = rows.to(mask.device)
    return rows if allowed is None else rows.masked_fill(~allowed, torch.finfo(dtype).min)


def _blocks(plan: _Plan, q_len: int):
    """``(i0, i1, k0, k1)``: each block of query rows and the keys its rows can see."""
    for i0 in range(0, q_len, plan.block):
        i1 = min(q_len, i0 + plan.block)
        yield i0, i1, *plan.mask.key_range(i0, i1)


# ---------------------------------------------------------------------------- autograd


def _sum_to(grad: Tensor, shape: torch.Size) -> Tensor:
    """Sum the broadcast dimensions of ``grad`` so that it has ``shape`` (same rank)."""
    dims = [i for i, (g, s) in enumerate(zip(grad.shape, shape)) if s == 1 and g != 1]
    return grad.sum(dim=dims, keepdim=True) if dims else grad


def _explicit_block(
    q_blk: Tensor, k_blk: Tensor, bias: Tensor | None, scale: float, softcap: float | None = None
) -> Tensor:
    """Scaled (and soft-capped) logits plus bias ``[B, H, rows, keys]``."""
    logits = soft_cap(torch.matmul(q_blk, k_blk.transpose(-1, -2)).mul_(scale), softcap)
    return logits if bias is None else logits.add_(bias)


class _BlockedBiasAttention(torch.autograd.Function):
    """``softmax(q kᵀ·scale + bias + mask) v`` block by block (with optional sink logits ``[H]``);
    inputs ``plan, q, k, v, table, sinks, *params``."""

    @staticmethod
    def forward(
        ctx,
        plan: _Plan,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        table: Tensor | None,
        sinks: Tensor | None,
        *params: Tensor,
    ) -> Tensor:
        batch, heads, q_len, _ = q.shape
        out = torch.empty_like(q)
        lse = torch.empty(
            batch, heads, q_len, dtype=torch.float32 if q.dtype != torch.float64 else q.dtype, device=q.device
        )
        if plan.mode == "toeplitz":
            plan.strip = _toeplitz_strip(plan, table, q_len, q.dtype)
        for i0, i1, k0, k1 in _blocks(plan, q_len):
            bias = _block_bias(plan, table, i0, i1, k0, k1, q.dtype)
            q_blk, k_blk, v_blk = q[:, :, i0:i1], k[:, :, k0:k1], v[:, :, k0:k1]
            if plan.use_flash:
                o_blk, l_blk = flash_forward(
                    q_blk,
                    k_blk,
                    v_blk,
                    0.0,
                    False,
                    attn_mask=None if bias is None else bias.expand(batch, -1, -1, -1),
                    scale=plan.scale,
                )
            else:
                logits = _explicit_block(q_blk, k_blk, bias, plan.scale, plan.softcap).to(lse.dtype)
                l_blk = torch.logsumexp(logits, dim=-1)
                # softmax, not exp(logits - lse): a fully masked row's lse rounds to finfo.min.
                o_blk = torch.matmul(torch.softmax(logits, dim=-1).to(q.dtype), v_blk)
            out[:, :, i0:i1] = o_blk
            lse[:, :, i0:i1] = l_blk
        if sinks is not None:
            out, lse = merge_sinks(out, lse, sinks)
        ctx.plan = plan
        ctx.save_for_backward(q, k, v, out, lse, table, sinks, *params)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: Tensor):
        plan: _Plan = ctx.plan
        q, k, v, out, lse, table, sinks, *params = ctx.saved_tensors
        needs = ctx.needs_input_grad  # (plan, q, k, v, table, sinks, *params)
        want_table = table is not None and needs[4]
        want_bias = want_table or any(needs[6:])
        grad_out = grad_out.contiguous()
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        acc = accumulation_dtype(q.dtype)
        d_table = torch.zeros(table.shape, dtype=acc, device=q.device) if want_table else None
        d_params: list[Tensor | None] = [None] * len(params)
        delta = (grad_out.to(acc) * out.to(acc)).sum(-1, keepdim=True)  # rowsum(dO ∘ O) = rowsum(P ∘ dP)
        # Function mode: evaluate bias_at with the tensors of the forward pass (under
        # torch.func.functional_call the module's own attributes are restored before backward).
        state = {**plan.state, **dict(zip(plan.param_names, params))} if plan.mode == "function" else None
        bias_grads = _BiasGrads(plan, d_table, state, params, d_params, needs[6:]) if want_bias else None
        for i0, i1, k0, k1 in _blocks(plan, q.shape[2]):
            q_blk, k_blk, v_blk, g_blk = q[:, :, i0:i1], k[:, :, k0:k1], v[:, :, k0:k1], grad_out[:, :, i0:i1]
            bias = _block_bias(plan, table, i0, i1, k0, k1, q.dtype, state)
            if plan.use_flash and not want_bias:
                dq_blk, dk_blk, dv_blk = flash_backward(
                    g_blk,
                    q_blk,
                    k_blk,
                    v_blk,
                    out[:, :, i0:i1],
                    lse[:, :, i0:i1],
                    0.0,
                    False,
                    attn_mask=None if bias is None else bias.expand(q.shape[0], -1, -1, -1),
                    scale=plan.scale,
                )
            else:
                blocks = (q_blk, k_blk, v_blk, g_blk, lse[:, :, i0:i1], delta[:, :, i0:i1])
                dq_blk, dk_blk, dv_blk = _explicit_block_backward(
                    plan, *blocks, bias, bias_grads, (i0, i1, k0)
                )
            dq[:, :, i0:i1] = dq_blk
            dk[:, :, k0:k1] += dk_blk
            dv[:, :, k0:k1] += dv_blk
        d_table = None if d_table is None else d_table.to(table.dtype)
        d_sinks = sink_grad(grad_out, out, lse, sinks) if sinks is not None and needs[5] else None
        return (None, dq, dk, dv, d_table, d_sinks, *d_params)


def _explicit_block_backward(
    plan: _Plan,
    q_blk: Tensor,
    k_blk: Tensor,
    v_blk: Tensor,
    g_blk: Tensor,
    lse_blk: Tensor,
    delta_blk: Tensor,
    bias: Tensor | None,
    bias_grads: _BiasGrads | None,
    where: tuple[int, int, int],
) -> tuple[Tensor, Tensor, Tensor]:
    """One block's ``(dq, dk, dv)`` by FlashAttention-2's backward written out on ``[B*H, rows,
    keys]`` matrices (baddbmm folds the bias, -delta and the accumulations into the matrix
    products); the block's logit gradient goes to ``bias_grads`` (rows ``i0:i1``, keys from ``k0``:
    ``where``) when the bias is trained."""
    batch, heads, rows, _ = q_blk.shape
    q3 = (q_blk * plan.scale).reshape(batch * heads, rows, -1)
    keys = k_blk.shape[2]
    k3, v3 = k_blk.reshape(batch * heads, keys, -1), v_blk.reshape(batch * heads, keys, -1)
    g3 = g_blk.reshape(batch * heads, rows, -1)
    bias3 = None if bias is None else bias.expand(batch, heads, -1, -1).reshape(batch * heads, rows, keys)
    capped = None
    if plan.softcap is not None:
        capped = soft_cap(torch.bmm(q3, k3.transpose(1, 2)), plan.softcap)
        logits = capped.clone() if bias3 is None else capped + bias3
    elif bias3 is None:
        logits = torch.bmm(q3, k3.transpose(1, 2))
    else:
        logits = torch.baddbmm(bias3, q3, k3.transpose(1, 2))
    # Rows that see no key get a zero output gradient (their output is zeroed after this
    # function), so whatever finite values their probabilities take here cancel.
    l_blk = lse_blk.reshape(batch * heads, rows, 1).to(logits.dtype)
    probs = logits.sub_(l_blk).exp_()
    del logits
    dv_blk = torch.bmm(probs.transpose(1, 2), g3)
    d_logits = torch.baddbmm(
        -delta_blk.reshape(batch * heads, rows, 1).to(q_blk.dtype), g3, v3.transpose(1, 2)
    ).mul_(probs)  # gradient of the biased, masked logits: P ∘ (dP - delta)
    del probs
    if bias_grads is not None:  # zero where hidden: P is 0 there
        bias_grads.add(d_logits.view(batch, heads, rows, keys), *where)
    if capped is not None:  # q and k reach the logits through the cap
        d_logits = soft_cap_backward(d_logits, capped, plan.softcap)
    dq_blk = torch.bmm(d_logits, k3).mul_(plan.scale).view(batch, heads, rows, -1)
    dk_blk = torch.bmm(d_logits.transpose(1, 2), q3).view(batch, heads, keys, -1)
    return dq_blk, dk_blk, dv_blk.view(batch, heads, keys, -1)


@dataclass(frozen=True)
class _BiasGrads:
    """Where a backward pass sums its blocks' logit gradients: the distance table's gradient
    ``d_table``, or the encoding parameters' ``d_params`` (those ``needs_params`` asks for)."""

    plan: _Plan
    d_table: Tensor | None
    state: dict | None
    params: list[Tensor]
    d_params: list[Tensor | None]
    needs_params: tuple

    def add(self, d_logits: Tensor, i0: int, i1: int, k0: int) -> None:
        _bias_grad(
            self.plan,
            d_logits,
            self.d_table,
            self.state,
            self.params,
            self.d_params,
            self.needs_params,
            i0,
            i1,
            k0,
        )


def _bias_grad(plan, d_logits, d_table, state, params, d_params, needs_params, i0, i1, k0) -> None:
    """Add one block's logit gradient (rows ``i0:i1``, keys from ``k0``) to the distance table's or
    the encoding parameters' gradient."""
    rows, keys = i1 - i0, d_logits.shape[-1]
    heads = d_logits.shape[1]
    if plan.mode == "toeplitz":
        # Entry (r, j) of the block has table index (Tq - 1 - i0) + (k0 + j) - r: sum along diagonals
        # by writing row r shifted right by (rows - 1 - r) into a zero strip and summing the rows.
        grad = d_logits[0] if d_logits.shape[0] == 1 else d_logits.sum(0)
        grad = grad.to(d_table.dtype)  # [H, rows, keys]
        width = keys + rows - 1
        strip = grad.new_empty(heads, rows, width)
        # Only the two triangles outside the copied band need zeros: clear their column bands.
        strip[:, :, : rows - 1] = 0
        strip[:, :, keys:] = 0
        strip.as_strided((heads, rows, keys), (rows * width, width - 1, 1), rows - 1).copy_(grad)
        first = plan.q_len - 1 - i0 + k0 - (rows - 1)
        d_table[:, first : first + width] += strip.sum(1)
        return
    k1 = k0 + keys
    if plan.mode == "gather":
        dist = plan.k_pos[:, None, k0:k1] - plan.q_pos[:, i0:i1, None] - plan.d_min  # [Bp, rows, keys]
        grad = _sum_to(d_logits.to(d_table.dtype), (dist.shape[0], heads, rows, keys))
        dist = dist.expand(grad.shape[0], -1, -1)
        d_table.index_add_(1, dist.reshape(-1), grad.transpose(0, 1).reshape(heads, -1))
        return
    with torch.enable_grad():
        bias = _block_rows_float32(plan, None, i0, i1, k0, k1, state)
        wanted = [p for p, need in zip(params, needs_params) if need]
        grads = torch.autograd.grad(
            bias, wanted, _sum_to(d_logits.to(bias.dtype), bias.shape), allow_unused=True
        )
    found = iter(grads)
    for index, need in enumerate(needs_params):
        if need:
            g = next(found)
            if g is not None:
                d_params[index] = g if d_params[index] is None else d_params[index] + g


class _BiasAt(torch.nn.Module):
    """``forward = encoding.bias_at``, so ``functional_call`` can evaluate it with given tensors."""

    def __init__(self, encoding) -> None:
        super().__init__()
        self.encoding = encoding

    def forward(self, head: Tensor, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        return self.encoding.bias_at(head, q_pos, k_pos)


# ---------------------------------------------------------------------------- entry points


def _make_plan(req: AttentionRequest, block: int) -> tuple[_Plan, Tensor | None]:
    enc = req.encoding
    q_pos, k_pos = req.q_pos.long(), req.k_pos.long()
    table: Tensor | None = None
    d_min, mode = 0, "function" if req.kind is Kind.BIAS else "none"
    if mode == "function" and enc.shift_invariant and req.q_len and req.k_len:
        d_min = int(k_pos.min()) - int(q_pos.max())
        d_max = int(k_pos.max()) - int(q_pos.min())
        if d_max - d_min + 1 <= _MAX_TABLE_FACTOR * (req.q_len + req.k_len):
            table = distance_table(enc, req.num_heads, d_min, d_max, req.q.device)
            mode = "gather"
            if consecutive(q_pos) and consecutive(k_pos):
                mode, q_pos, k_pos = "toeplitz", q_pos[:1], k_pos[:1]
    plan = _Plan(
        encoding=enc,
        heads=req.num_heads,
        scale=req.scale,
        q_pos=q_pos,
        k_pos=k_pos,
        mask=req.mask,
        block=block,
        mode=mode,
        d_min=d_min,
        use_flash=req.softcap is None and cpu_flash_limit(req.q) is None,
        q_len=req.q_len,
        softcap=req.softcap,
    )
    return plan, table


def blocked_bias_attention(req: AttentionRequest, block: int = DEFAULT_BLOCK) -> Tensor:
    """Attention output ``[B, H, Tq, D]`` for a BIAS request, computed ``block`` queries at a time.

    Equal to the eager reference (forward and backward, gradients into the encoding's parameters
    included) without the ``[B, H, Tq, Tk]`` bias or probabilities.
    """
    if block <= 0:
        raise ValueError(f"block must be positive, got {block}")
    if req.k_len == 0 or req.q_len == 0:
        return req.q * 0  # no keys (or no queries): zeros, like eager's empty softmax, still in the graph
    plan, table = _make_plan(req, block)
    params: list[Tensor] = []
    if plan.mode == "function":
        named = [(name, p) for name, p in req.encoding.named_parameters() if p.requires_grad]
        plan.param_names = [f"encoding.{name}" for name, _ in named]
        plan.state = {f"encoding.{name}": t for name, t in req.encoding.named_parameters()}
        plan.state.update({f"encoding.{name}": t for name, t in req.encoding.named_buffers()})
        params = [p for _, p in named]
    # One copy of an operand whose last stride is not 1 (the kernel would misread it), not one per block.
    q, k, v = (kernel_layout(t) for t in (req.q, *req.kv_per_query_head()))
    out = _BlockedBiasAttention.apply(plan, q, k, v, table, req.sinks, *params)
    return req.mask.zero_empty_rows(out)


class BlockedBackend:
    name = "blocked"
    kinds = frozenset({Kind.ABSOLUTE, Kind.ROTARY, Kind.BIAS})
    # what reasons and declines read (posenc.backends.memo.READS): the memo's key
    reads = frozenset({"tensors", "kind", "mask", "nonfinite", "softcap"})
    serves_softcap = True  # explicit blocks (see the module's docstring)

    def declines(self, request: AttentionRequest) -> list[str]:
        if request.softcap is not None:  # sdpa cannot cap: no cheaper fused call to defer to
            return []
        return query_block_declines(request)

    def reasons(self, request: AttentionRequest) -> list[str]:
        if request.kind is Kind.CONTENT:
            return [
                f"kind content ({request.encoding.name}) computes its own logits: the relative backend serves it"
            ]
        return query_block_reasons(request)

    def run(self, request: AttentionRequest) -> tuple[Tensor, Tensor | None]:
        return blocked_bias_attention(request), None


register_backend(BlockedBackend())
