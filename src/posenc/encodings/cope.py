"""CoPE: contextual position encoding (Golovneva et al. 2024, arXiv 2405.18719, Appendix B).

Positions are counted by the content: each key gets a gate ``g_ij = σ(logit_ij)`` from the scaled
logit ``q_i·k_j/√d``, and the position of key ``j`` seen from query ``i`` is the number of gated
keys from ``j`` up to ``i``:

``p_ij = Σ_{t=j..i} g_it`` (a reverse cumulative sum along keys), clamped to ``npos_max - 1``.

Note ``p_ii = g_ii``: with every gate 1, ``p_ij = i - j + 1``, not ``i - j`` (docs/conventions.md §10.4);
this is the canonical definition and is kept. Future keys (``j > i``) have gate 0. The position
embedding ``e[p]`` (``[npos_max, head_dim]``, shared across heads, initialised to zeros) is
interpolated linearly between ``e[⌊p⌋]`` and ``e[⌈p⌉]``, computed cheaply as ``q·e[k]`` for every
integer ``k`` and interpolating those logits. The final logit is ``logit_ij + q_i·e[p_ij]``, where
the CoPE term uses the unscaled ``q`` as x-transformers ``CoPE`` does.

Conventions and limits:

* Causal self-attention only. Future keys are recognised by index exactly as the causal mask does
  (query ``i`` of a step sits at key index ``i + Tk - Tq``, so KV-cached steps see the full pass's
  gates).
* The gates see only the causal mask: a key padding mask or ``attn_mask`` still removes keys from
  the softmax but not from the position count (x-transformers gates the fully masked logits). With
  right padding under a causal mask this changes nothing; with left padding the pads are counted.
* Kind CONTENT: runs on the eager backend and on the relative backend (query blocks; a block
  of queries sees its keys at the same indices as in the full pass, so the gates are the same).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .base import ContentEncoding
from .registry import at_least, register

__functional__ = ["cope_positions", "cope_interpolate"]


def cope_positions(gates: Tensor, npos_max: int) -> Tensor:
    """``p_ij = Σ_{t ≥ j} g_it`` along the last (key) axis, clamped to ``npos_max - 1``."""
    return gates.flip(-1).cumsum(-1).flip(-1).clamp(max=npos_max - 1)


def cope_interpolate(position_logits: Tensor, positions: Tensor) -> Tensor:
    """Interpolate ``position_logits [..., Tq, npos]`` (``q·e[k]``) at fractional ``positions [..., Tq, Tk]``."""
    floor, ceil = positions.floor().long(), positions.ceil().long()
    weight = positions - floor
    return position_logits.gather(-1, ceil) * weight + position_logits.gather(-1, floor) * (1 - weight)


@register("cope")
class CoPE(ContentEncoding):
    """CoPE (Golovneva et al. 2024): positions counted by sigmoid gates of the logits; causal only."""

    layer_sizes = ("head_dim",)
    option_ranges = {"head_dim": at_least(1), "npos_max": at_least(2)}
    shift_invariant = True
    causal_only = True

    def __init__(self, head_dim: int, npos_max: int = 16) -> None:
        """Args: ``head_dim`` (filled in by the layer); ``npos_max`` (rows of the position embedding,
        x-transformers' ``cope_max_pos``; counted positions are clamped to ``npos_max - 1``)."""
        super().__init__()
        self.head_dim, self.npos_max = head_dim, npos_max
        self.pos_emb = nn.Parameter(torch.zeros(npos_max, head_dim))

    def logits(
        self,
        q: Tensor,
        k: Tensor,
        q_pos: Tensor,
        k_pos: Tensor,
        *,
        scale: float,
        layer: nn.Module | None = None,
    ) -> Tensor:
        content = (q @ k.transpose(-1, -2)) * scale
        # Future keys by index, exactly as the causal mask: query i sits at key index i + (Tk - Tq).
        q_len, k_len = q.shape[-2], k.shape[-2]
        q_index = torch.arange(q_len, device=q.device)[:, None] + (k_len - q_len)
        future = torch.arange(k_len, device=q.device)[None, :] > q_index
        gates = torch.sigmoid(content).masked_fill(future, 0.0)
        positions = cope_positions(gates, self.npos_max)
        position_logits = q @ self.pos_emb.to(q.dtype).T  # [B, H, Tq, npos]
        return content + cope_interpolate(position_logits, positions)

    def preview(self) -> str:
        return (
            f"npos_max={self.npos_max}: p_ij = sum of sigmoid gates g_it for t = j..i (all gates 1: i-j+1), "
            "logit += q_i · interp(e, p_ij)"
        )
