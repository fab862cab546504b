"""FoX, the Forgetting Transformer (Lin, Nikishin, He and Courville 2025): a data-dependent decay bias.

Each head ``h`` has a forget gate per token, ``f_t = sigmoid(w_h · x_t + b_h)``, computed from the
layer input ``x_t`` (before the projections). The bias of query ``i`` on key ``j <= i`` is the log
of the product of the gates in between:

``b_ij = Σ_{t=j+1..i} log f_t = c_i − c_j``,  ``c_t = s · Σ_{u<=t} log f_u`` (``s = post_log_scale``)

so a head forgets at a rate the content chooses; with every gate at ``sigmoid(b)`` it is ALiBi with
slope ``−s·log sigmoid(b)``. ``bias_init = 5`` (the reference's default) starts every gate at
``sigmoid(5) ≈ 0.9933``, a slope of about 0.0067 per token.

Modes:

* ``mode="causal"`` (the paper): ``c_i − c_j`` for every pair. Future keys get a positive bias,
  harmless only under the causal mask, so this mode refuses non-causal layers (as ALiBi's causal
  mode does).
* ``mode="bidirectional"`` (x-transformers ``DataDependentAlibi(causal=False)``): a second set of
  ``H`` gates ``g`` with their own cumulative sum ``r``; keys after the query (``j > i``) get
  ``r_j − r_i = Σ_{t=i+1..j} log g_t``, keys at or before it ``c_i − c_j``.

Equal to x-transformers ``DataDependentAlibi`` (``to_forget_gates``: one ``Linear(dim, H or 2H)``
with its bias initialised to ``bias_init``, then log-sigmoid, times ``post_log_scale``, cumulative
sum along the sequence; the bias added to the scaled logits), tested with copied weights, and
against the formula written as the explicit sum. Differences, both documented choices: the gates' log-sigmoid and cumulative
sum run in float32 (or the parameters' dtype when wider) whatever the model dtype, and padding
tokens (``key_padding_mask``) get gate 1 (no decay), so where padding sits never changes the real
tokens.

Fast path: under a plain causal mask the row term ``c_i`` cancels in the softmax, so the sdpa
backend runs FoX as causal attention over keys carrying ``−c_j`` in one extra head dimension (the
fused kernel, no ``L x L`` bias), re-centred on the middle of its range; float32 then rounds each
logit to about ``eps · |c_j − centre|``, as the dense bias rounds ``c_i − c_j`` to ``eps · |c|``.

Input-dependent: the layer calls :meth:`FoX.token_states` on its input (``[B, S, T]`` with
``S = H`` causal, ``2H`` bidirectional, continuing the cached tokens' states in decoding) and the
eager and sdpa backends evaluate :meth:`FoX.bias_from_states`, the flex backend's ``score_mod``
the same bias per score (:meth:`FoX.bias_at_index`). Queries and keys must come from one
sequence, so FoX serves self-attention only. ``bias_at`` is the bias at zero input (every gate
``sigmoid(b_h)``), for plots; attention never uses it. Positions do not enter, so FoX is shift
invariant.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .base import BiasEncoding, InputBias, TokenStates
from .registry import Range, at_least, greater_than, register

__functional__ = ["fox_bias", "fox_bias_at", "fox_states"]

Mode = Literal["causal", "bidirectional"]
_MODES = ("causal", "bidirectional")


def fox_states(log_gates: Tensor, previous: Tensor | None = None) -> Tensor:
    """Cumulative log forget gates ``[B, S, T]`` from per-token log gates ``[B, S, T]``.

    ``previous [B, S, Tpast]``: the states of earlier tokens; the new ones continue from the last.
    """
    states = log_gates.cumsum(dim=-1)
    if previous is not None and previous.shape[-1] > 0:
        states = states + previous[..., -1:].to(states.dtype)
    return states


def fox_bias(states: TokenStates, num_heads: int, bidirectional: bool) -> Tensor:
    """The FoX bias ``[B, H, Tq, Tk]``: ``c_i − c_j`` (keys at or before the query), and with
    ``bidirectional`` ``r_j − r_i`` for keys after it (``r`` = the state channels ``H..2H-1``)."""
    backward = states.q[:, :num_heads, :, None] - states.k[:, :num_heads, None, :]
    if not bidirectional:
        return backward
    forward = states.k[:, num_heads:, None, :] - states.q[:, num_heads:, :, None]
    later = states.k_index[None, :] > states.q_index[:, None]
    return torch.where(later, forward, backward)


def fox_bias_at(
    states: TokenStates, num_heads: int, bidirectional: bool, b: Tensor, h: Tensor, q: Tensor, k: Tensor
) -> Tensor:
    """:func:`fox_bias` at batch ``b``, head ``h``, query ``q`` and key ``k`` (broadcastable integer
    tensors), elementwise: what FlexAttention's ``score_mod`` evaluates per score."""
    backward = states.q[b, h, q] - states.k[b, h, k]
    if not bidirectional:
        return backward
    forward = states.k[b, h + num_heads, k] - states.q[b, h + num_heads, q]
    return torch.where(states.k_index[k] > states.q_index[q], forward, backward)


@register("fox")
class FoX(BiasEncoding):
    """Forgetting Transformer (Lin et al. 2025): per-head forget gates from the input, bias c_i - c_j."""

    layer_sizes = ("num_heads", "dim")
    option_ranges = {
        "num_heads": at_least(1),
        "dim": at_least(1),
        "post_log_scale": greater_than(0),
        "bias_init": Range(
            low=-1e4, high=1e4
        ),  # a gate logit: sigmoid saturates long before, float32 overflows past
    }
    shift_invariant = True
    self_attention_only = True
    noncausal_options = {"mode": "bidirectional"}

    def __init__(
        self,
        num_heads: int,
        dim: int,
        mode: Mode = "causal",
        bias_init: float = 5.0,
        post_log_scale: float = 1.0,
    ) -> None:
        """Args: ``num_heads`` and ``dim`` (the layer's heads and width, filled in by the layer);
        ``mode`` ``"causal"`` or ``"bidirectional"``; ``bias_init`` (initial gate logit, so every gate
        starts at ``sigmoid(bias_init)``); ``post_log_scale`` (> 0, multiplies the log gates)."""
        super().__init__()
        for option, value in (("num_heads", num_heads), ("dim", dim)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"fox: {option} must be a positive integer, got {option}={value!r}")
        if mode not in _MODES:
            raise ValueError(f"fox: mode must be one of {_MODES}, got mode={mode!r}")
        self.num_heads, self.mode, self.post_log_scale = num_heads, mode, float(post_log_scale)
        self.causal_only = mode == "causal"
        gates = num_heads * (1 if mode == "causal" else 2)
        self.to_gates = nn.Linear(dim, gates)
        with torch.no_grad():
            self.to_gates.bias.fill_(bias_init)

    @property
    def bidirectional(self) -> bool:
        return self.mode == "bidirectional"

    def _state_dtype(self) -> torch.dtype:
        return torch.promote_types(self.to_gates.weight.dtype, torch.float32)

    def log_gates(self, x: Tensor, padding: Tensor | None = None) -> Tensor:
        """``post_log_scale · log f_t`` per gate ``[B, S, T]`` for ``x [B, T, dim]``; 0 at padding."""
        logits = self.to_gates(x).to(self._state_dtype())
        log_gates = F.logsigmoid(logits) * self.post_log_scale
        if padding is not None:
            log_gates = log_gates.masked_fill(padding[..., None], 0.0)
        return log_gates.transpose(1, 2)

    def input_bias(self) -> InputBias:
        """The bias from the tokens' cumulative log gates (:meth:`token_states`)."""
        return InputBias(
            self.token_states, self.bias_from_states, self.causal_key_term, bias_at_index=self.bias_at_index
        )

    def token_states(
        self, x: Tensor, previous: Tensor | None = None, padding: Tensor | None = None
    ) -> Tensor:
        """Cumulative log gates ``[B, S, T]`` of ``x [B, T, dim]``, after ``previous [B, S, Tpast]``.

        ``padding [B, T]`` (True = padding): those tokens do not decay.
        """
        return fox_states(self.log_gates(x, padding), previous)

    def bias_from_states(self, states: TokenStates) -> Tensor:
        """The bias ``[B, H, Tq, Tk]`` (float32 or wider) from the tokens' cumulative log gates."""
        return fox_bias(states, self.num_heads, self.bidirectional)

    def bias_at_index(self, states: TokenStates, b: Tensor, h: Tensor, q: Tensor, k: Tensor) -> Tensor:
        """The bias at batch, head, query and key indices, elementwise (the flex backend's score_mod)."""
        return fox_bias_at(states, self.num_heads, self.bidirectional, b, h, q, k)

    def causal_key_term(self, states: TokenStates) -> Tensor:
        """``−c_j`` ``[B, H, Tk]``: for keys at or before the query the bias is ``c_i − c_j`` (both modes)."""
        return -states.k[:, : self.num_heads]

    def _zero_input_slopes(self) -> Tensor:
        """``s · log sigmoid(b)`` per gate ``[S]``: the log gate of every token at zero input."""
        bias = self.to_gates.bias.to(self._state_dtype())
        return F.logsigmoid(bias) * self.post_log_scale

    def bias_at(self, head: Tensor, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        """The bias at zero input (every gate ``sigmoid(b)``): ALiBi-like, for plots only."""
        slopes = self._zero_input_slopes()
        dtype = slopes.dtype
        behind = slopes[head] * (q_pos - k_pos).to(dtype)
        if not self.bidirectional:
            return behind
        ahead = slopes[head + self.num_heads] * (k_pos - q_pos).to(dtype)
        return torch.where(k_pos > q_pos, ahead, behind)

    def preview(self) -> str:
        slopes = self._zero_input_slopes().tolist()
        lines = [f"mode={self.mode}; per-token log gate at zero input (slope of the decay), per head:"]
        for h in range(self.num_heads):
            gate = math.exp(slopes[h] / self.post_log_scale)
            line = f"  head {h}: gate {gate:.6f}, log gate {slopes[h]:+.6f}"
            if self.bidirectional:
                line += f"; later keys: {slopes[h + self.num_heads]:+.6f}"
            lines.append(line)
        lines.append("  the gates depend on the input: the bias of a real sequence varies per token")
        return "\n".join(lines)
