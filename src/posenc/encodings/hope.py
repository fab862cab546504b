"""HoPE: high-frequency rotary position encoding (Chen et al., ACL 2025, "HoPE: A Novel Positional
Encoding Without Long-Term Decay for Enhanced Context Awareness and Extrapolation", arXiv 2410.21216).

RoPE's pair ``k`` turns by ``p · θ_k``, ``θ_k = base^(-2k/d)``. HoPE keeps only the high-frequency
pairs and makes the others position-independent: pair ``k`` turns by ``p · θ'_k`` with

    ``θ'_k = θ_k`` for ``k < n_high``,  ``θ'_k = 0`` (the identity: ``cos = 1``, ``sin = 0``) otherwise.

The pairs kept are given directly (``high_freq_pairs = n_high``) or by the training length ``L``
(``train_length``): a pair is kept when it completes at least one full period inside the training
window, ``θ_k · L ≥ 2π`` (period ``2π/θ_k ≤ L``); the lower frequencies never turn a full circle
during training, which is where the paper places RoPE's "activated", U-shape-forming components.
Because ``θ' = 0`` gives ``R(0) = I``, ``R(a)ᵀ R(b) = R(b − a)`` still holds exactly: HoPE is
relative (shift invariant), only without long-term decay in the identity channels
(docs/conventions.md §7.9).

Conventions: ``pairing="half"`` (``(k, k + d/2)``, HF Llama) or ``"interleaved"`` (``(2k, 2k+1)``);
the kept pairs are the lowest indices (highest frequencies) in both. Angles are float32
(``positions · θ'``), real-valued positions allowed; ``cos``/``sin`` are cast to the activations'
dtype. Derived tables (``θ'``, ``cos``/``sin``) are non-persistent float32 buffers.

Backends: sdpa and eager (q and k are rotated before the kernel, which then sees plain attention).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from ..kernels.rope import RotaryTables
from .base import LayerContext, RotaryEncoding
from .registry import at_least, greater_than, register
from .rope import Pairing, apply_cos_sin, check_pairing, rope_inv_freq
from .spec import format_spec

__functional__ = ["hope_inv_freq"]


def hope_inv_freq(
    head_dim: int,
    base: float = 10000.0,
    high_freq_pairs: int | None = None,
    train_length: int | None = None,
) -> Tensor:
    """HoPE's frequencies ``θ' [d/2]`` (float32): RoPE's ``θ_k`` for the kept high-frequency pairs, 0 for the rest.

    Args:
        head_dim: per-head size ``d`` (even).
        base: RoPE's ``θ`` base.
        high_freq_pairs: keep pairs ``0 … n−1`` (exclusive with ``train_length``).
        train_length: keep the pairs with ``θ_k · L ≥ 2π`` (a full period inside ``L`` tokens).

    Raises:
        ValueError: both or neither of ``high_freq_pairs``/``train_length``, or either out of range
            (the message names it).
    """
    inv_freq, _ = rope_inv_freq(head_dim, base)
    pairs = inv_freq.shape[0]
    if (high_freq_pairs is None) == (train_length is None):
        raise ValueError(
            "hope: give exactly one of high_freq_pairs (how many high-frequency pairs rotate) or "
            f"train_length (keep pairs with a full period inside it); got high_freq_pairs={high_freq_pairs}, "
            f"train_length={train_length}"
        )
    if high_freq_pairs is not None:
        if isinstance(high_freq_pairs, bool) or not isinstance(high_freq_pairs, int):
            raise ValueError(f"hope: high_freq_pairs must be an int, got {high_freq_pairs!r}")
        if not 0 <= high_freq_pairs <= pairs:
            raise ValueError(
                f"hope: high_freq_pairs must be in [0, head_dim/2 = {pairs}], got high_freq_pairs={high_freq_pairs}"
            )
        keep = torch.arange(pairs) < high_freq_pairs
    else:
        if isinstance(train_length, bool) or not isinstance(train_length, int) or train_length < 1:
            raise ValueError(f"hope: train_length must be a positive int, got train_length={train_length!r}")
        # float64 comparison, so a frequency at the boundary is decided the same on every device
        theta = 1.0 / (float(base) ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
        keep = theta * train_length >= 2 * math.pi
    return torch.where(keep, inv_freq, torch.zeros_like(inv_freq))


@register("hope")
class HoPE(RotaryEncoding):
    """HoPE (Chen et al. 2025): RoPE keeping only its high-frequency pairs; the low-frequency pairs do not turn."""

    float_positions = True  # angles p·θ are defined for any real position

    layer_sizes = ("head_dim",)
    option_ranges = {
        "head_dim": at_least(2),
        "base": greater_than(1),
        "high_freq_pairs": at_least(0),
        "train_length": at_least(1),
        "cache_size": at_least(1),
    }
    derived_buffers = ("tables.inv_freq", "tables.cos", "tables.sin")
    shift_invariant = True
    example_options = {"train_length": 64}

    @classmethod
    def layer_defaults(cls, ctx: LayerContext) -> dict[str, Any]:
        """The training length is the model's ``max_len`` (when it has one)."""
        return {} if ctx.max_len is None else {"train_length": ctx.max_len}

    @classmethod
    def options_for_layer(cls, ctx: LayerContext, given: dict[str, Any]) -> dict[str, Any]:
        """As the base, except that a spec naming ``high_freq_pairs`` takes no default ``train_length``."""
        options = super().options_for_layer(ctx, given)
        if given.get("high_freq_pairs") is not None and "train_length" not in given:
            options.pop("train_length", None)
        return options

    def __init__(
        self,
        head_dim: int,
        base: float = 10000.0,
        high_freq_pairs: int | None = None,
        train_length: int | None = None,
        pairing: Pairing = "half",
        cache_size: int = 2048,
    ) -> None:
        """Args: ``head_dim`` (filled in by the layer; even); ``base``; exactly one of
        ``high_freq_pairs`` (pairs ``0 … n−1`` rotate) and ``train_length`` (the pairs with a full
        period inside it rotate; a model's layers default it to the model's ``max_len``);
        ``pairing``; ``cache_size`` (rows of the ``cos``/``sin`` cache)."""
        super().__init__()
        check_pairing(pairing)
        if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim <= 0 or head_dim % 2:
            raise ValueError(f"hope: head_dim must be a positive even integer, got head_dim={head_dim!r}")
        self.head_dim, self.base, self.pairing = head_dim, float(base), pairing
        self.high_freq_pairs, self.train_length = high_freq_pairs, train_length
        hope_inv_freq(head_dim, base, high_freq_pairs, train_length)  # validates the options now
        self.tables = RotaryTables(cache_size=cache_size)
        self.reset_buffers()

    def config(self) -> dict[str, Any]:
        """The options this instance was built with, leaving out those left at None."""
        return {k: v for k, v in self._config.items() if v is not None}

    def spec(self) -> str:
        """A spec string that rebuilds this encoding (options left at None left out)."""
        return format_spec(self.name, self.config())

    def reset_buffers(self) -> None:
        """``θ' [d/2]`` and its ``cos``/``sin`` tables, in float32."""
        inv_freq = hope_inv_freq(self.head_dim, self.base, self.high_freq_pairs, self.train_length)
        self.tables.reset(inv_freq.to(self.buffer_device))

    @property
    def inv_freq(self) -> Tensor:
        """``θ' [d/2]`` (float32): RoPE's frequencies, 0 where a pair does not turn."""
        return self.tables.inv_freq

    @property
    def rotating_pairs(self) -> int:
        """How many pairs turn with the position (the high-frequency ones)."""
        return int(torch.count_nonzero(self.inv_freq))

    def rotate(self, q: Tensor, k: Tensor, q_pos: Tensor, k_pos: Tensor) -> tuple[Tensor, Tensor]:
        if q.shape[-1] != self.head_dim or k.shape[-1] != self.head_dim:
            raise ValueError(
                f"hope: built for head_dim={self.head_dim}, got q {tuple(q.shape)} and k {tuple(k.shape)}"
            )
        q_cos, q_sin = self.tables.tables(q_pos)
        k_cos, k_sin = (q_cos, q_sin) if k_pos is q_pos else self.tables.tables(k_pos)
        return apply_cos_sin(q, q_cos, q_sin, self.pairing), apply_cos_sin(k, k_cos, k_sin, self.pairing)

    def preview(self) -> str:
        kept = self.rotating_pairs
        total = self.head_dim // 2
        return (
            f"{kept} of {total} pairs rotate (θ' = RoPE's θ_0 … θ_{kept - 1}); pairs {kept}..{total - 1} "
            f"are position-free (θ' = 0, pairing={self.pairing})"
        )
