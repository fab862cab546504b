"""FoPE: Fourier position embedding (Hua et al., ICML 2025, "Fourier Position Embedding: Enhancing
Attention's Periodic Extension for Length Generalization", arXiv 2412.17739).

The authors' code (``olmo/model.py``, ``FourierEmbedding`` over ``RotaryEmbedding``, with the
paper's configs ``rope_clamp_floor_freq``, ``rope_clamp_floor_to_zero``, ``fourier_ignore_zero``,
``fourier_separate_basis``, ``fourier_separate_head``, ``fourier_init=eye_xavier_norm``) computes:

1. **Clip to floor.** RoPE's frequencies ``θ_k = base^(-2k/d)``, ``k < d/2``; those below the floor
   ``2π / L`` (``L = train_length``, a period longer than the training window: under-trained) are
   set to zero and dropped, leaving the ``K`` frequencies ``θ_0 … θ_{K-1}`` (all ``d/2`` without
   ``train_length``).
2. **Fourier series.** Per head ``h``, two coefficient matrices ``A_h`` (sine) and ``B_h``
   (cosine) of shape ``[K, n]``, ``n = min(K, d/4)`` (``max_pairs`` overrides ``d/4``), give each
   output pair ``j < n`` the short series

       ``s_j(p) = Σ_k sin(p θ_k) A_h[k, j]``,   ``c_j(p) = Σ_k cos(p θ_k) B_h[k, j]``.

   They are initialised as the authors do: Xavier-normal with gain ``sigma`` (0.3 in the paper's
   60M runs; torch's fans of the ``[H, K, n]`` tensor) plus the identity (``K = n``) or a strided
   identity ``[k = j·⌈K/n⌉, j] = 1`` (``K > n``), so each series is dominated by its own frequency.
   Not trained by default (``learnable=False``, the authors' ``fourier_learnable``): they are
   persistent buffers, saved in the ``state_dict``.
3. **Zeroed pairs.** Pairs ``n … d/2−1`` get the zero frequency. ``padding="zero_frequency"``
   (default): ``cos = 1``, ``sin = 0``, the identity (the paper's zero-frequency component).
   ``padding="authors"``: ``cos = sin = 1`` as the authors' code pads (``F.pad(value=1)`` on both),
   a constant, position-free ``[[1, −1], [1, 1]]`` on each such pair.
4. **Rotation** with ``rotate_half`` pairing (pair ``j`` is channels ``(j, j + d/2)``):
   ``x' = x · [c, c] + rotate_half(x) · [s, s]``, the same for queries and keys.

With ``sigma > 0`` the series mix frequencies, ``c² + s² ≠ 1`` and ``R(a)ᵀ R(b) ≠ R(b − a)``:
FoPE is not shift invariant (the paper's point is robustness of the spectrum, not exact relativity).
``sigma = 0`` with ``n = K`` is RoPE with the floor frequencies zeroed, which is relative again.
Grouped-query attention: the coefficients are per key/value head (as vLLM's
``FourierRotaryEmbedding``): query head ``h`` uses those of its group, ``(h // g) · g`` with ``g``
query heads per key head; with ``separate_heads=False`` one pair of matrices serves every head.

Angles are float32 from integer or real-valued positions; the ``cos``/``sin`` of the kept
frequencies are RoPE's cached tables (:class:`~posenc.kernels.rope.RotaryTables`), the series are
formed from them per call and cast to the activations' dtype
(docs/conventions.md §7.10).

Backends: sdpa and eager (q and k are transformed before the kernel, which then sees plain attention).
"""

from __future__ import annotations

import math
from typing import Any, Literal

import torch
from torch import Tensor, nn

from ..kernels.rope import RotaryTables
from .base import LayerContext, RotaryEncoding
from .registry import at_least, greater_than, register
from .rope import rope_inv_freq
from .spec import format_spec

__functional__ = ["fope_inv_freq", "fope_init_coefficients", "fope_cos_sin", "fope_series", "apply_fope"]

Padding = Literal["zero_frequency", "authors"]


def fope_inv_freq(head_dim: int, base: float = 10000.0, train_length: int | None = None) -> Tensor:
    """The ``K`` frequencies FoPE keeps ``[K]`` (float32, on the CPU): RoPE's ``θ_k`` at or above ``2π / train_length``."""
    with torch.device("cpu"):  # K depends on the values: never on the meta device
        inv_freq, _ = rope_inv_freq(head_dim, base)
    if train_length is None:
        return inv_freq
    if isinstance(train_length, bool) or not isinstance(train_length, int) or train_length < 1:
        raise ValueError(f"fope: train_length must be a positive int, got train_length={train_length!r}")
    return inv_freq[inv_freq >= 2 * math.pi / train_length]


def fope_output_pairs(kept: int, head_dim: int, max_pairs: int | None = None) -> int:
    """``n = min(K, d/4)`` (the authors' ``min(input_dim, head_dim // 4)``), or ``min(K, max_pairs)``."""
    cap = head_dim // 4 if max_pairs is None else max_pairs
    return min(kept, cap)


def fope_init_coefficients(
    heads: int, kept: int, pairs: int, sigma: float, generator: torch.Generator | None = None
) -> Tensor:
    """One coefficient tensor ``[heads, K, n]`` (float32): Xavier-normal (gain ``sigma``) plus the (strided) identity."""
    coef = torch.empty(heads, kept, pairs)
    if coef.numel():
        std = sigma * math.sqrt(2.0 / (kept * pairs + heads * pairs))  # torch's xavier fans of [H, K, n]
        coef.normal_(0.0, std, generator=generator)
    step = math.ceil(kept / pairs) if pairs else 1
    for j in range(pairs):
        if j * step < kept:
            coef[:, j * step, j] += 1.0
    return coef


def fope_cos_sin(
    positions: Tensor, inv_freq: Tensor, cos_coef: Tensor, sin_coef: Tensor, head_dim: int, padding: Padding
) -> tuple[Tensor, Tensor]:
    """The series ``c``, ``s`` ``[B, H, T, d/2]`` for positions ``[B, T]`` (integer or real).

    ``inv_freq [K]``, ``cos_coef``/``sin_coef`` ``[H, K, n]``; pairs ``n … d/2−1`` are padded with
    ``cos = 1`` and ``sin = 0`` (``padding="zero_frequency"``) or ``sin = 1`` (``"authors"``).
    Angles in float32 (float64 with float64 coefficients), as RoPE's.
    """
    dtype = torch.promote_types(cos_coef.dtype, torch.float32)
    angles = positions.to(dtype)[..., None] * inv_freq.to(device=positions.device, dtype=dtype)  # [B, T, K]
    return fope_series(angles.cos(), angles.sin(), cos_coef, sin_coef, head_dim, padding)


def fope_series(
    base_cos: Tensor, base_sin: Tensor, cos_coef: Tensor, sin_coef: Tensor, head_dim: int, padding: Padding
) -> tuple[Tensor, Tensor]:
    """The series from the per-frequency ``cos``/``sin`` ``[B, T, K]`` (RoPE's tables of the kept
    frequencies): ``[B, H, T, d/2]``, computed in the wider of float32 and the coefficients' dtype."""
    dtype = torch.promote_types(cos_coef.dtype, torch.float32)
    cos = torch.einsum("btk,hkn->bhtn", base_cos.to(dtype), cos_coef.to(dtype))
    sin = torch.einsum("btk,hkn->bhtn", base_sin.to(dtype), sin_coef.to(dtype))
    rest = head_dim // 2 - cos.shape[-1]
    if rest:
        shape = (*cos.shape[:-1], rest)
        cos = torch.cat((cos, cos.new_ones(shape)), dim=-1)
        fill = sin.new_ones(shape) if padding == "authors" else sin.new_zeros(shape)
        sin = torch.cat((sin, fill), dim=-1)
    return cos, sin


def apply_fope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """``x [B, H, T, D]`` times ``[c, c]`` plus ``rotate_half(x)`` times ``[s, s]``; ``cos``/``sin`` ``[B|1, H|1, T, D/2]``."""
    half = x.shape[-1] // 2
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


@register("fope")
class FoPE(RotaryEncoding):
    """FoPE (Hua et al. 2025): each rotary pair a short Fourier series of RoPE's trained frequencies; the rest zeroed."""

    float_positions = True  # angles p·θ are defined for any real position

    layer_sizes = ("num_heads", "head_dim")
    option_ranges = {
        "num_heads": at_least(1),
        "head_dim": at_least(4),
        "base": greater_than(1),
        "train_length": at_least(1),
        "sigma": at_least(0),
        "max_pairs": at_least(0),
    }
    derived_buffers = ("tables.inv_freq", "tables.cos", "tables.sin")
    example_options = {"train_length": 64}

    @classmethod
    def layer_defaults(cls, ctx: LayerContext) -> dict[str, Any]:
        """The floor's training length is the model's ``max_len`` (the authors' ``max_sequence_length``)."""
        return {} if ctx.max_len is None else {"train_length": ctx.max_len}

    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        base: float = 10000.0,
        train_length: int | None = None,
        sigma: float = 0.3,
        max_pairs: int | None = None,
        separate_heads: bool = True,
        padding: Padding = "zero_frequency",
        learnable: bool = False,
    ) -> None:
        """Args: ``num_heads``, ``head_dim`` (filled in by the layer; ``head_dim`` even);
        ``base``; ``train_length`` (the floor ``2π/L``; None keeps every frequency; a model's
        layers default it to the model's ``max_len``); ``sigma`` (the
        Xavier gain of the harmonics; 0 gives the identity series); ``max_pairs`` (cap on the pairs
        that carry a series, default ``d/4`` as the authors); ``separate_heads`` (one pair of
        coefficient matrices per head, as the authors, or one for all); ``padding``
        (``"zero_frequency"`` or ``"authors"``); ``learnable`` (train the coefficients)."""
        super().__init__()
        if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim <= 0 or head_dim % 2:
            raise ValueError(f"fope: head_dim must be a positive even integer, got head_dim={head_dim!r}")
        if padding not in ("zero_frequency", "authors"):
            raise ValueError(f"fope: padding must be 'zero_frequency' or 'authors', got padding={padding!r}")
        self.num_heads, self.head_dim, self.base = num_heads, head_dim, float(base)
        self.train_length, self.padding = train_length, padding
        kept = fope_inv_freq(head_dim, base, train_length).shape[0]
        pairs = fope_output_pairs(kept, head_dim, max_pairs)
        heads = num_heads if separate_heads else 1
        self.tables = RotaryTables()  # cos/sin of the kept frequencies, RoPE's cache
        self.reset_buffers()
        sin_coef = fope_init_coefficients(heads, kept, pairs, sigma)
        cos_coef = fope_init_coefficients(heads, kept, pairs, sigma)
        if learnable:
            self.sin_coef = nn.Parameter(sin_coef)
            self.cos_coef = nn.Parameter(cos_coef)
        else:
            self.register_buffer("sin_coef", sin_coef)
            self.register_buffer("cos_coef", cos_coef)

    def config(self) -> dict[str, Any]:
        """The options this instance was built with, leaving out those left at None."""
        return {k: v for k, v in self._config.items() if v is not None}

    def spec(self) -> str:
        """A spec string that rebuilds this encoding (options left at None left out)."""
        return format_spec(self.name, self.config())

    def reset_buffers(self) -> None:
        """The kept frequencies ``θ [K]`` and their ``cos``/``sin`` tables, float32."""
        self.tables.reset(fope_inv_freq(self.head_dim, self.base, self.train_length).to(self.buffer_device))

    @property
    def inv_freq(self) -> Tensor:
        """The kept frequencies ``θ [K]`` (float32)."""
        return self.tables.inv_freq

    @property
    def series_pairs(self) -> int:
        """``n``: the pairs that carry a Fourier series (the rest are zeroed)."""
        return int(self.cos_coef.shape[-1])

    def _coefficients(self, heads: int) -> tuple[Tensor, Tensor]:
        """The ``[heads|1, K, n]`` coefficients for ``heads`` heads (key/value heads under GQA)."""
        cos_coef, sin_coef = self.cos_coef, self.sin_coef
        have = cos_coef.shape[0]
        if have == 1 or have == heads:
            return cos_coef, sin_coef
        if have % heads:
            raise ValueError(
                f"fope: {have} coefficient heads (num_heads) cannot be grouped over {heads} heads; "
                "num_heads must be a multiple of the key/value heads"
            )
        index = torch.arange(heads, device=cos_coef.device) * (have // heads)
        return cos_coef[index], sin_coef[index]

    def _cos_sin(self, positions: Tensor, heads: int) -> tuple[Tensor, Tensor]:
        cos_coef, sin_coef = self._coefficients(heads)
        if self.inv_freq.numel():
            base_cos, base_sin = self.tables.tables(positions)  # [B, T, K], cached for whole positions
        else:  # every frequency below the floor: nothing turns
            base_cos = base_sin = positions.new_zeros((*positions.shape, 0), dtype=torch.float32)
        return fope_series(base_cos, base_sin, cos_coef, sin_coef, self.head_dim, self.padding)

    def rotate(self, q: Tensor, k: Tensor, q_pos: Tensor, k_pos: Tensor) -> tuple[Tensor, Tensor]:
        if q.shape[-1] != self.head_dim or k.shape[-1] != self.head_dim:
            raise ValueError(
                f"fope: built for head_dim={self.head_dim}, got q {tuple(q.shape)} and k {tuple(k.shape)}"
            )
        kv_heads = k.shape[1]
        if q.shape[1] % max(kv_heads, 1):
            raise ValueError(f"fope: {q.shape[1]} query heads are not a multiple of {kv_heads} key heads")
        group = q.shape[1] // max(kv_heads, 1)
        k_cos, k_sin = self._cos_sin(k_pos, kv_heads)  # [B, Hkv|1, Tk, d/2]
        q_cos, q_sin = self._cos_sin(q_pos, kv_heads)
        if group > 1 and q_cos.shape[1] > 1:  # every query head of a group uses its key head's series
            q_cos, q_sin = q_cos.repeat_interleave(group, dim=1), q_sin.repeat_interleave(group, dim=1)
        return apply_fope(q, q_cos, q_sin), apply_fope(k, k_cos, k_sin)

    def preview(self) -> str:
        kept = int(self.inv_freq.shape[0])
        return (
            f"{kept} of {self.head_dim // 2} frequencies kept (floor 2π/{self.train_length}); "
            f"{self.series_pairs} pairs carry a Fourier series over them, the other "
            f"{self.head_dim // 2 - self.series_pairs} are zeroed ({self.padding}); "
            f"{self.cos_coef.shape[0]} coefficient head(s)"
        )
