"""``torch.nn.functional.scaled_dot_product_attention`` backend.

Serves ABSOLUTE and ROTARY encodings (and NoPE), whose logits are plain ``q·k``, and BIAS
encodings by passing the dense bias as a float mask (correct everywhere; on CPU under autograd
PyTorch then uses its math kernel, so the blocked and flex backends come first for BIAS kinds).
A pure causal mask with ``Tq == Tk`` and no cache offset is passed as ``is_causal`` (no mask tensor).

Attention sinks need the kernel's log-sum-exp (:mod:`posenc.backends.parts.sinks`), which only the CPU
flash kernel (``aten::_scaled_dot_product_flash_attention_for_cpu``) returns: on CPU the layer runs
that kernel and its backward directly; elsewhere a request with sinks goes to another backend.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable

from ..encodings.base import Kind
from . import AttentionRequest, register_backend
from .parts.denormals import flushed_denormals
from .parts.flash import (
    NONFINITE_REASON,
    cpu_flash_limit,
    flash_backward,
    flash_forward,
    kernel_layout,
)
from .parts.sinks import merge_sinks, sink_grad


class _FlashWithSinks(torch.autograd.Function):
    """The CPU flash kernel with sink logits merged through its log-sum-exp (exact forward and backward)."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, mask, is_causal: bool, scale: float):
        out, lse = flash_forward(q, k, v, 0.0, is_causal, attn_mask=mask, scale=scale)
        out, lse = merge_sinks(out, lse, sinks)
        ctx.is_causal, ctx.scale = is_causal, scale
        ctx.save_for_backward(q, k, v, sinks, mask, out, lse)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        q, k, v, sinks, mask, out, lse = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        dq, dk, dv = flash_backward(
            grad_out, q, k, v, out, lse, 0.0, ctx.is_causal, attn_mask=mask, scale=ctx.scale
        )
        d_sinks = sink_grad(grad_out, out, lse, sinks) if ctx.needs_input_grad[3] else None
        return dq, dk, dv, d_sinks, None, None, None


class SdpaBackend:
    name = "sdpa"
    serves_dropout = True
    kinds = frozenset({Kind.ABSOLUTE, Kind.ROTARY, Kind.BIAS})
    # what reasons and declines read (posenc.backends.memo.READS): the memo's key
    reads = frozenset(
        {"tensors", "kind", "encoding", "mask", "dropout", "nonfinite", "sinks", "token_states", "grad"}
    )
    serves_input_bias = True

    def reasons(self, request: AttentionRequest) -> list[str]:
        if request.kind is Kind.CONTENT:
            return [f"kind {request.kind.value} ({request.encoding.name}) adds q/k-dependent logit terms"]
        reasons = []
        if request.q.device.type == "cpu" and request.has_nonfinite:
            reasons.append(NONFINITE_REASON)
        if request.sinks is None:
            return reasons
        flash = cpu_flash_limit(request.q)
        if flash is not None:
            reasons.append(f"attention sinks need the kernel's log-sum-exp: {flash}")
        if request.dropout_p > 0:
            reasons.append("attention sinks with dropout are not implemented in the sdpa backend")
        trainable = _trainable_bias(request)
        if trainable:
            reasons.append(
                f"with sinks the bias goes into the flash kernel as a float mask, which gets no gradient, "
                f"and {request.encoding.name}'s bias depends on {trainable} that require grad: use the "
                "blocked backend (or freeze them, or run under torch.no_grad())"
            )
        additive = request.mask.additive
        if additive is not None and additive.requires_grad and torch.is_grad_enabled():
            reasons.append("with sinks a float attn_mask that requires grad gets no gradient")
        return reasons

    def declines(self, request: AttentionRequest) -> list[str]:
        return []

    def run(self, request: AttentionRequest) -> tuple[Tensor, Tensor | None]:
        key_term = _causal_key_term(request)
        if key_term is not None:
            return request.mask.zero_empty_rows(_key_term_attention(request, key_term)), None
        q, k, v = request.q, request.k, request.v
        plain_causal = request.mask.is_plain_causal and request.kind is not Kind.BIAS
        mask = None if plain_causal else request.mask.dense_additive(q.dtype)
        if request.kind is Kind.BIAS:
            bias = request.dense_bias().to(q.dtype)
            mask = bias if mask is None else mask + bias
        if request.sinks is not None:
            q, k, v = (kernel_layout(t) for t in (q, *request.kv_per_query_head()))
            if mask is not None:
                mask = mask.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
            out = _FlashWithSinks.apply(q, k, v, request.sinks, mask, plain_causal, request.scale)
            return request.mask.zero_empty_rows(out), None
        # A float mask far below the row maximum (ALiBi's) sends the kernel into denormals: flushed in
        # the forward; the backward autograd runs later, outside posenc's call (the split backends
        # run theirs through the flash kernel, flushed too).
        work = (
            0
            if mask is None or torch.compiler.is_compiling()
            else q.shape[0] * q.shape[1] * q.shape[2] * k.shape[2]
        )
        with flushed_denormals(work, q.device):
            out = F.scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=mask,
                dropout_p=request.dropout_p,
                is_causal=plain_causal,
                scale=request.scale,
                enable_gqa=q.shape[1] != k.shape[1],
            )
        return request.mask.zero_empty_rows(out), None


def _trainable_bias(request: AttentionRequest) -> str:
    """What a BIAS request's bias depends on that requires grad, in words ("" when nothing does):
    the encoding's parameters (named) and, for an input-dependent bias, its token states. The
    flash kernel gives its float mask no gradient; a bias without such inputs (ALiBi) loses none."""
    if request.kind is not Kind.BIAS or not torch.is_grad_enabled():
        return ""
    found = [name for name, p in request.encoding.named_parameters() if p.requires_grad]
    if request.token_states is not None and any(t.requires_grad for t in request.token_states.tensors()):
        found.append("token_states")
    return ", ".join(found[:3]) + (f" and {len(found) - 3} more" if len(found) > 3 else "")


def _causal_key_term(request: AttentionRequest) -> Tensor | None:
    """The key term of an input-dependent bias under a plain causal mask (FoX), when the fused path fits."""
    if request.token_states is None or request.sinks is not None or not request.mask.is_plain_causal:
        return None
    if request.q.dtype not in (torch.float32, torch.float64):  # a half-precision extra column loses the bias
        return None
    if request.q_len == 0:
        return None
    key_term = request.input_bias().causal_key_term
    return None if key_term is None else key_term(request.token_states)


def _key_term_attention(request: AttentionRequest, key_term: Tensor) -> Tensor:
    """Causal attention with ``bias_ij = row_i + key_j``: the row term cancels, the key term rides in
    one extra head dimension (``q' = [q, 1/scale]``, ``k' = [k, key_j − centre]``, ``v' = [v, 0]``)."""
    q, (k, v) = request.q, request.kv_per_query_head()
    centre = (key_term.amax(-1, keepdim=True) + key_term.amin(-1, keepdim=True)).detach() / 2
    column = (key_term - centre).to(q.dtype).unsqueeze(-1)
    q = torch.cat([q, q.new_full((*q.shape[:-1], 1), 1.0 / request.scale)], dim=-1)
    k = torch.cat([k, column.expand(*k.shape[:-1], 1)], dim=-1)
    v = torch.cat([v, v.new_zeros((*v.shape[:-1], 1))], dim=-1)
    out = F.scaled_dot_product_attention(
        q, k, v, dropout_p=request.dropout_p, is_causal=True, scale=request.scale
    )
    return out[..., :-1]


register_backend(SdpaBackend())
