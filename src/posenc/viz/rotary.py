"""Figures of ROTARY encodings: long-range decay of the expected q·k with distance, and for RoPE
the wavelength of each dimension pair and the decay under every scaling type, side by side.

Expected q·k: for ``q = k ~ N(0, I_D)`` (a query and key with the same content),
``E[(R_m q)·(R_n k)] = tr(R_mᵀ R_n)``; for RoPE that is ``a²·Σ_k 2·cos((n − m)·θ_k) + (D − d_r)``
with ``a`` the attention scale and ``d_r`` the rotary width. We divide by ``D`` so the curve starts
at ``a²`` (1 without scaling) at distance 0.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import numpy as np
import torch
from matplotlib.figure import Figure

from .. import functional as F
from ..encodings.base import Kind, PositionalEncoding
from ..encodings.rope_scaling import rope_scaling_example
from .registry import PlotOptions, describe, figure, new_figure, set_title

#: The pre-training length the scaling examples extend (``--length`` overrides it).
ORIGINAL_LENGTH = 2048
#: Extension factor of every scaling example.
FACTOR = 4.0


def log_bins(values: np.ndarray, count: int = 60) -> tuple[np.ndarray, np.ndarray]:
    """Mean of ``values[d]`` over log-spaced bins of distance ``d >= 1``: ``(bin centres, means)``.

    The expected dot product oscillates at every integer distance; the bin means show the trend.
    """
    edges = np.unique(np.round(np.geomspace(1, len(values), count + 1)).astype(np.int64))
    centres = np.sqrt(edges[:-1] * np.maximum(edges[1:] - 1, edges[:-1]))
    means = np.array([values[lo:hi].mean() for lo, hi in itertools.pairwise(edges)])
    return centres, means


def rotary_expected_dot(enc: PositionalEncoding, longest: int) -> np.ndarray:
    """``tr(R_dᵀ R_0) / D`` for every distance ``d`` in ``0..longest``, measured through ``enc.rotate``.

    Works for any ROTARY encoding: each basis vector ``e_b`` is rotated as a query at positions
    ``d`` and as a key at position 0, and ``Σ_b (R_d e_b)·(R_0 e_b)`` is the trace.
    """
    head_dim = int(enc.config().get("head_dim") or 0)
    if head_dim <= 0:
        raise ValueError(f"{enc.name}: the decay figure needs the encoding's head_dim")
    q_pos = torch.arange(longest + 1)[None]
    k_pos = torch.zeros(1, 1, dtype=torch.long)
    total = torch.zeros(longest + 1, dtype=torch.float64)
    with torch.no_grad():
        for basis in torch.eye(head_dim):
            q = basis.expand(1, 1, longest + 1, head_dim)
            q_rot, k_rot = enc.rotate(q, basis.view(1, 1, 1, head_dim), q_pos, k_pos)
            total += (q_rot[0, 0] * k_rot[0, 0]).sum(-1).double()
    return total.numpy() / head_dim


def rope_expected_dot(
    inv_freq: torch.Tensor, attention_scale: float, head_dim: int, longest: int
) -> np.ndarray:
    """The closed form ``(a²·Σ_k 2 cos(d·θ_k) + D − d_r) / D`` for ``d = 0..longest``, float64."""
    theta = inv_freq.double().numpy()
    rotary = 2 * len(theta)
    distances = np.arange(longest + 1, dtype=np.float64)
    waves = np.cos(distances[:, None] * theta[None, :]).sum(1)
    return (attention_scale**2 * 2 * waves + (head_dim - rotary)) / head_dim


def _decay_axes(ax, values: np.ndarray, original: int | None) -> None:
    """Every integer distance (thin) and the log-binned mean (bold), log distance axis."""
    distances = np.arange(len(values))
    ax.plot(distances[1:], values[1:], linewidth=0.4, alpha=0.35, color="tab:blue")
    centres, means = log_bins(values[1:])
    ax.plot(centres, means, linewidth=2, color="tab:blue")
    ax.set_xscale("log")
    if original is not None:
        ax.axvline(original, color="gray", linestyle="--", linewidth=0.8)
        ax.axvline(FACTOR * original, color="gray", linestyle=":", linewidth=0.8)
    ax.axhline(0, color="black", linewidth=0.5)
    ax.grid(alpha=0.3)


@figure(Kind.ROTARY, "decay")
def rotary_decay(enc: PositionalEncoding, options: PlotOptions) -> Figure:
    """Expected q·k (q = k) against distance, measured through the encoding's rotate()."""
    longest = options.length_or(4 * ORIGINAL_LENGTH)
    fig = new_figure(8, 5)
    ax = fig.subplots()
    _decay_axes(ax, rotary_expected_dot(enc, longest), None)
    ax.set_xlabel("distance between query and key (log scale)")
    ax.set_ylabel("E[q·R(d)k] / D for q = k ~ N(0, I)")
    set_title(fig, f"{describe(enc)}: long-range decay")
    return fig


def scaling_examples(original: int, rotary: int) -> dict[str, tuple[dict[str, Any], int | None]]:
    """The example of every registered scaling type (an HF-style ``rope_parameters`` dict) with the
    sequence length it is evaluated at, read from the scaling registry
    (:func:`~posenc.encodings.rope_scaling.rope_scaling_example`)."""
    return {
        rope_type: rope_scaling_example(rope_type, original, rotary, FACTOR)
        for rope_type in F.rope_scaling_types()
    }


def _scaling_curves(enc: PositionalEncoding, original: int) -> dict[str, tuple[torch.Tensor, float]]:
    """``{label: (inv_freq, attention_scale)}`` for every scaling type that exists, plus the encoding itself."""
    config = enc.config()
    head_dim, base = int(config["head_dim"]), float(config["base"])
    rotary = int(getattr(enc, "rotary_dim", head_dim))
    partial = {} if rotary == head_dim else {"partial_rotary_factor": rotary / head_dim}
    examples = scaling_examples(original, rotary)
    curves: dict[str, tuple[torch.Tensor, float]] = {}
    own_type = getattr(enc, "rope_type", "default")
    if own_type != "default":
        curves[f"this encoding ({own_type})"] = (enc.inv_freq.float().cpu(), float(enc.attention_scale))  # type: ignore[attr-defined]
    # "default" first, then the scaled types in alphabetical order.
    for rope_type in sorted(examples, key=lambda name: (name != "default", name)):
        scaling, seq_len = examples[rope_type]
        curves[rope_type] = F.rope_inv_freq(head_dim, base, scaling={**scaling, **partial}, seq_len=seq_len)
    return curves


@figure("rope", "scaling")
def rope_scaling(enc: PositionalEncoding, options: PlotOptions) -> Figure:
    """RoPE: wavelength per dimension pair and the decay of expected q·k for each scaling type."""
    original = options.length_or(ORIGINAL_LENGTH)
    head_dim = int(enc.config()["head_dim"])
    curves = _scaling_curves(enc, original)
    longest = int(4 * FACTOR * original)
    cols = min(4, len(curves))
    rows = math.ceil(len(curves) / cols)
    fig = new_figure(4 * cols, 4.2 + 2.8 * rows)
    top, bottom = fig.subfigures(2, 1, height_ratios=(1.4, rows * 1.0))
    wave_ax = top.subplots()
    for label, (inv_freq, _) in curves.items():
        freq = inv_freq.double().numpy()
        # Pairs that do not turn (p-RoPE's zero frequencies) have no wavelength: left out of the curve.
        wavelength = np.divide(2 * math.pi, freq, out=np.full_like(freq, np.nan), where=freq > 0)
        wave_ax.plot(np.arange(len(inv_freq)), wavelength, marker=".", label=label)
    wave_ax.axhline(original, color="gray", linestyle="--", linewidth=0.8)
    wave_ax.text(0, original, f" original length {original}", color="gray", fontsize=8, va="bottom")
    wave_ax.set_yscale("log")
    wave_ax.set_xlabel("dimension pair k")
    wave_ax.set_ylabel("wavelength 2π/θ_k (positions)")
    wave_ax.set_title(f"wavelength per pair (factor {FACTOR:g} for the scaled types)")
    wave_ax.grid(alpha=0.3)
    wave_ax.legend(fontsize=8, ncols=2)
    axes = bottom.subplots(rows, cols, squeeze=False, sharey=True)
    flat = [ax for row in axes for ax in row]
    for ax, (label, (inv_freq, scale)) in zip(flat, curves.items()):
        _decay_axes(ax, rope_expected_dot(inv_freq, scale, head_dim, longest), original)
        ax.set_title(label, fontsize=10)
        ax.set_xlabel("distance (log)")
    for ax in flat[len(curves) :]:
        ax.set_visible(False)
    flat[0].set_ylabel("E[q·R(d)k] / D")
    bottom.suptitle(
        f"expected q·k for q = k ~ N(0, I) against distance (thin: every distance, bold: log-binned mean); "
        f"dashed: {original}, dotted: {int(FACTOR * original)}",
        fontsize=10,
    )
    set_title(fig, f"{describe(enc)} (head_dim {head_dim})")
    return fig
