"""Clipped RoPE: RoPE with its slowest frequencies tapered to zero (Li et al. 2026, "CoPE: Clipped RoPE
as A Scalable Free Lunch for Long Context LLMs", arXiv 2602.05258; code: hrlics/CoPE
``modeling_cope.py``, ``LlamaRotaryEmbedding``; mlx-lm PR 1387 ``CoPERoPE``).

The paper calls it CoPE; posenc's ``cope`` is Golovneva et al.'s contextual position encoding, so this
one is ``clipped_rope``.

The pairs whose period ``2π / θ_k`` exceeds the trained length never turned a whole rotation in
training; past that length they reach angles the model never saw. Clipped RoPE multiplies the last
``c`` frequencies (the slowest) by a raised-cosine (Hann) taper,

    θ_{n-c+i} ← θ_{n-c+i} · ½ (1 + cos(π i / (c - 1))),   i = 0 .. c-1,

so the first clipped pair keeps its frequency and the slowest is frozen at 0 (it no longer turns);
``hard=True`` is the paper's hard-clip ablation (the ``c`` frequencies set to 0).

Conventions:

* ``c`` is ``clip_pairs`` when given (the reference code's ``clip_low_n``, 20 there); otherwise the
  number of pairs whose period ``2π / θ_k`` exceeds ``trained_length`` (mlx-lm's auto-sized clip; for a
  base of 1e7, 64 rotary channels and 262,144 trained positions, 10 of 32 pairs). One of the two is
  required. ``c = 1`` leaves the frequencies as they are (the taper's one value is 1), as in the
  reference.
* The taper acts on the final frequencies, after a ``scaling`` (YaRN, PI, ...), as the reference
  applies it after HF's ``rope_init_fn`` (and again after each dynamic recomputation); the auto count
  reads those frequencies. RoPE's other options are ``rope``'s. Shift invariant (a rotation by
  fixed frequencies).

Backends: those of RoPE (rotated q and k).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from .registry import at_least, register
from .rope import DropRotation, Pairing, RoPE
from .rope_scaling import RopeScaling, rope_scaled_inv_freq

__functional__ = ["clip_pairs_past", "clip_inv_freq"]


def clip_pairs_past(inv_freq: Tensor, trained_length: int) -> int:
    """How many pairs of ``inv_freq [n]`` (fast to slow) have a period ``2π / θ_k`` longer than
    ``trained_length`` (a frequency of 0 counts: it never turns)."""
    periods = 2 * math.pi / inv_freq.double()
    return int((periods > trained_length).sum())


def clip_inv_freq(inv_freq: Tensor, clip: int, *, hard: bool = False) -> Tensor:
    """``inv_freq [n]`` with its last ``clip`` frequencies multiplied by the raised-cosine taper
    ``½(1 + cos(linspace(0, π, clip)))`` (1 at the first clipped pair, 0 at the slowest), or set to 0
    with ``hard``. ``0 <= clip <= n``."""
    n = inv_freq.shape[0]
    if not 0 <= clip <= n:
        raise ValueError(f"clipped_rope: clip_pairs must be in [0, {n}] (the rotary pairs), got {clip}")
    if clip == 0:
        return inv_freq
    angles = torch.linspace(0.0, math.pi, steps=clip, dtype=torch.float32, device=inv_freq.device)
    taper = torch.zeros_like(angles) if hard else 0.5 * (1.0 + torch.cos(angles))
    return torch.cat([inv_freq[: n - clip], inv_freq[n - clip :] * taper.to(inv_freq.dtype)])


@register("clipped_rope")
class ClippedRoPE(RoPE):
    """Clipped RoPE (CoPE, Li et al. 2026): RoPE whose slowest frequencies are tapered to zero."""

    option_ranges = {**RoPE.option_ranges, "trained_length": at_least(1), "clip_pairs": at_least(0)}
    example_options: dict[str, Any] = {"trained_length": 64}

    def __init__(
        self,
        head_dim: int | None = None,
        *,
        trained_length: int | None = None,
        clip_pairs: int | None = None,
        hard: bool = False,
        base: float = 10000.0,
        pairing: Pairing = "half",
        rotary_dim: int | None = None,
        partial_rotary_factor: float | None = None,
        cache_size: int = 2048,
        scaling: str | RopeScaling | dict | None = None,
        rope_parameters: dict | None = None,
        drop_rotation: DropRotation = "never",
        learned_frequencies: bool = False,
    ) -> None:
        """
        Args:
            head_dim: per-head size (filled in by the attention layer).
            trained_length: the length the model was trained on; the pairs whose period exceeds it
                are clipped (when ``clip_pairs`` is not given).
            clip_pairs: the number of slowest pairs to clip, given exactly (the reference code's
                ``clip_low_n``); wins over ``trained_length``.
            hard: set the clipped frequencies to 0 instead of tapering them (the paper's ablation).

        ``base``, ``pairing``, ``rotary_dim``, ``partial_rotary_factor``, ``cache_size``, ``scaling``,
        ``rope_parameters``, ``drop_rotation`` and ``learned_frequencies`` are RoPE's
        (:class:`~posenc.encodings.rope.RoPE`).
        """
        if trained_length is None and clip_pairs is None:
            raise ValueError(
                "clipped_rope needs trained_length (clip the pairs whose period exceeds it) or clip_pairs "
                "(clip that many slowest pairs), e.g. clipped_rope:trained_length=4096"
            )
        if not isinstance(hard, bool):
            raise ValueError(f"clipped_rope: hard must be True or False, got {hard!r}")
        self.trained_length, self.clip_pairs, self.hard = trained_length, clip_pairs, hard
        super().__init__(
            head_dim,
            base,
            pairing,
            rotary_dim,
            partial_rotary_factor,
            cache_size,
            scaling,
            rope_parameters,
            drop_rotation,
            learned_frequencies,
        )

    def clipped(self, inv_freq: Tensor) -> int:
        """The number of pairs clipped from ``inv_freq`` (``clip_pairs``, or those past ``trained_length``)."""
        if self.clip_pairs is not None:
            return self.clip_pairs
        return clip_pairs_past(inv_freq, self.trained_length)

    def reset_buffers(self) -> None:
        """RoPE's tables, from the clipped frequencies."""
        if not self.is_bound:
            self.tables.reset(None)
            return
        with torch.device("cpu"):  # the count reads the frequencies' values (a meta build has none)
            inv_freq, self.attention_scale = rope_scaled_inv_freq(self.scaling_config, self._seq_len)
            inv_freq = clip_inv_freq(inv_freq, self.clipped(inv_freq), hard=self.hard)
        self.tables.reset(inv_freq.to(self.buffer_device), self.attention_scale)

    def extra_repr(self) -> str:
        clip = (
            f"clip_pairs={self.clip_pairs}"
            if self.clip_pairs is not None
            else f"trained_length={self.trained_length}"
        )
        return f"{super().extra_repr()}, {clip}" + (", hard=True" if self.hard else "")
