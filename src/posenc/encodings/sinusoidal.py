"""Sinusoidal absolute positional encoding (Vaswani et al. 2017, "Attention Is All You Need", §3.5).

For position ``p`` and width ``D`` (even), with frequencies ``ω_k = base^(−2k/D)``, ``k = 0…D/2−1``:

* ``layout="interleaved"`` (the paper, HF DistilBERT ``create_sinusoidal_embeddings``, the seed):
  ``PE[p, 2k] = sin(p·ω_k)``, ``PE[p, 2k+1] = cos(p·ω_k)``;
* ``layout="concat"`` (HF Marian, MAE's 1-D helper): ``[sin(p·ω_0) … sin(p·ω_{D/2−1}) |
  cos(p·ω_0) … cos(p·ω_{D/2−1})]``, the same numbers in another channel order.

``step`` picks the spacing of the log-frequencies (docs/conventions.md §2.1):

* ``step="paper"`` (default): ``ω_k = base^(−2k/D) = exp(−k·ln(base)/(D/2))``, so the lowest frequency
  is ``base^(−(D−2)/D)``;
* ``step="whisper"`` (OpenAI Whisper's encoder table, HF ``modeling_whisper.sinusoids``; tensor2tensor's
  ``get_timing_signal_1d`` and fairseq's ``SinusoidalPositionalEmbedding`` space them so too):
  ``ω_k = exp(−k·ln(base)/(D/2 − 1))``, the lowest frequency exactly ``1/base`` (so ``D ≥ 4``).
  ``layout="concat", step="whisper"`` at positions ``0 … 1499`` is the table whisper-base's checkpoint
  stores, bit for bit at its float16 storage. HF's ``sinusoids`` computes the same formula with float32
  angles: up to ``1e-4`` away at position 1500, and rounded to float16 it differs from the trained
  table in 13,116 of its 768,000 entries.

Position 2 with ``D = 4`` gives ``(sin 2, cos 2, sin 0.02, cos 0.02)`` interleaved
(docs/conventions.md §2.1). Angles are computed in float64 (float32 on MPS, which has no float64) and the
table is returned in float32 whatever the model dtype, so a bf16 model keeps distinct positions far
beyond 256. There is no table and no maximum position. The module adds the encoding to its input
(``embed``); the paper's ``√D`` scaling of token embeddings belongs to the model, not to this file.

Kind ABSOLUTE: added to the input, so attention itself is plain (sdpa or eager).
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import Tensor

from .base import AbsoluteEncoding
from .registry import at_least, greater_than, register

__functional__ = ["sinusoidal"]

Layout = Literal["interleaved", "concat"]
_LAYOUTS = ("interleaved", "concat")
Step = Literal["paper", "whisper"]
_STEPS = ("paper", "whisper")


def _check_options(dim: int, base: float, layout: str, step: str = "paper") -> None:
    if isinstance(dim, bool) or not isinstance(dim, int) or dim <= 0 or dim % 2:
        raise ValueError(
            f"sinusoidal: dim must be a positive even integer (sin and cos pairs), got dim={dim!r}"
        )
    if not base > 0:
        raise ValueError(f"sinusoidal: base must be positive, got base={base!r}")
    if layout not in _LAYOUTS:
        raise ValueError(f"sinusoidal: layout must be one of {_LAYOUTS}, got layout={layout!r}")
    if step not in _STEPS:
        raise ValueError(f"sinusoidal: step must be one of {_STEPS}, got step={step!r}")
    if step == "whisper" and dim < 4:
        raise ValueError(
            f"sinusoidal: step='whisper' divides ln(base) by D/2 - 1, which needs dim >= 4; got dim={dim} "
            "(use step='paper' for dim=2)"
        )


def _angle_dtype(device: torch.device) -> torch.dtype:
    # MPS has no float64; everywhere else the angles are exact to float64 before the final cast.
    return torch.float32 if device.type == "mps" else torch.float64


def sinusoidal(
    positions: Tensor,
    dim: int,
    base: float = 10000.0,
    layout: Layout = "interleaved",
    step: Step = "paper",
) -> Tensor:
    """The sinusoidal encoding of ``positions [...]`` as a float32 tensor ``[..., dim]``.

    Args:
        positions: positions of any shape (integer, or real for fractional positions).
        dim: encoding width ``D``; must be even (and at least 4 for ``step="whisper"``).
        base: frequency base.
        layout: ``"interleaved"`` (``[sin ω0, cos ω0, sin ω1, …]``, the paper) or ``"concat"``
            (``[sin ω0 … sin ω_{D/2−1} | cos ω0 … cos ω_{D/2−1}]``, HF Marian, Whisper).
        step: ``"paper"`` (``ω_k = base^(−2k/D)``) or ``"whisper"`` (``ω_k = exp(−k·ln(base)/(D/2 − 1))``;
            with ``layout="concat"``, Whisper's encoder table).

    Raises:
        ValueError: ``dim`` odd or not positive (or below 4 for ``step="whisper"``), ``base`` not
            positive, unknown ``layout`` or ``step``.
    """
    _check_options(dim, base, layout, step)
    dtype = _angle_dtype(positions.device)
    if step == "whisper":
        # p · exp(−k·ln(base)/(D/2 − 1)), multiplied as Whisper's sinusoids does (in float64 here).
        k = torch.arange(dim // 2, dtype=dtype, device=positions.device)
        angles = positions.to(dtype)[..., None] * torch.exp(-k * (math.log(base) / (dim // 2 - 1)))
    else:
        exponents = torch.arange(0, dim, 2, dtype=dtype, device=positions.device) / dim  # 2k/D
        # p / base^(2k/D), divided rather than multiplied by the inverse, as the reference tables do.
        angles = positions.to(dtype)[..., None] / torch.pow(torch.as_tensor(base, dtype=dtype), exponents)
    sin, cos = torch.sin(angles), torch.cos(angles)
    if layout == "interleaved":
        table = torch.stack([sin, cos], dim=-1).flatten(-2)
    else:
        table = torch.cat([sin, cos], dim=-1)
    return table.to(torch.float32)


@register("sinusoidal")
class Sinusoidal(AbsoluteEncoding):
    """Fixed sin/cos absolute encoding added to the layer input (Vaswani et al. 2017)."""

    layer_sizes = ("dim",)
    option_ranges = {"dim": at_least(2), "base": greater_than(0)}

    def __init__(
        self, dim: int, base: float = 10000.0, layout: Layout = "interleaved", step: Step = "paper"
    ) -> None:
        """Args: ``dim`` the model width (filled in by the layer); ``base``; ``layout``; ``step``
        (``"paper"`` or ``"whisper"``: the spacing of the log-frequencies, see the module docstring)."""
        super().__init__()
        _check_options(dim, base, layout, step)
        self.dim, self.base, self.layout, self.step = dim, float(base), layout, step

    def encode(self, positions: Tensor, dtype: torch.dtype | None = None) -> Tensor:
        """The encoding ``[B, T, dim]`` of integer ``positions [B, T]`` (or ``[T]``), in ``dtype``."""
        positions = self.check_positions(positions)
        return sinusoidal(positions, self.dim, self.base, self.layout, self.step).to(dtype or torch.float32)

    def preview(self) -> str:
        positions = torch.arange(4)
        table = sinusoidal(positions, self.dim, self.base, self.layout, self.step)
        shown = min(self.dim, 6)
        lines = [
            f"layout={self.layout}, base={self.base:g}, step={self.step}; positions 0..3, channels 0..{shown - 1} of {self.dim}:"
        ]
        for p, row in zip(positions.tolist(), table[:, :shown].tolist()):
            lines.append(f"  p={p}: " + " ".join(f"{v:+.6f}" for v in row))
        return "\n".join(lines)
