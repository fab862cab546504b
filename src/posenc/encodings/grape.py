"""GRAPE, multiplicative: group representational position encoding (Zhang et al., ICLR 2026, "Group
Representational Position Encoding", arXiv 2512.07805; code: github.com/model-architectures/GRAPE,
``model/llama-mha-grape-m-nonctx.py``).

A position ``n`` acts on queries and keys as ``G(n) = exp(n ω L)`` with ``L`` a rank-2 skew
generator ``L = a bᵀ − b aᵀ``, whose exponential has the closed form (Rodrigues)

    ``exp(θ L) = I + (sin(θ s)/s) L + ((1 − cos(θ s))/s²) L²``,  ``s² = |a|²|b|² − (a·b)²``

(:func:`grape_rank2_exp`). Multi-subspace GRAPE stacks ``D/2`` such generators on mutually
orthogonal planes, which commute, so ``G(n) = Π_j exp(n ω_j L_j)`` and
``G(m)ᵀ G(n) = G(n − m)``: the exact relative law (docs/conventions.md §7.15).

This encoding is the authors' non-contextual commuting GRAPE-M (``MSGRAPECommuting``): the planes
are the canonical coordinate pairs ``(a, b) = (e_j, e_{j+D/2})`` (half pairing) and the
frequencies are learned, ``ω_j = exp(λ_j / c)`` with ``λ`` initialised to ``c · log θ_j``,
``θ_j = base^(−2j/D)`` (RoPE's spectrum; ``c = log_freq_scale``, the authors' 16, a learning-rate
scaling), shared by the heads (``share_across_heads=True``, the paper's configs) or one spectrum
per head. With ``L = a bᵀ − b aᵀ`` the pair ``(x1, x2)`` becomes
``(x1 cos φ + x2 sin φ, −x1 sin φ + x2 cos φ)``, ``φ = n ω_j``, as the authors'
``apply_rotary_emb`` (RoPE turned the other way; scores are the same for any fixed sign).

Positions are 1-D, integer or real (``G(t)`` for real ``t``). Grouped-query attention with
per-head spectra: a key head uses its group's first query head's. Angles in float32 (float64 for
float64 parameters), cast to the activations' dtype.

Backends: sdpa and eager (q and k are rotated before the kernel, which then sees plain attention).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ._axes import head_groups
from .base import RotaryEncoding
from .registry import at_least, greater_than, register
from .rope import rope_inv_freq

__functional__ = ["grape_rank2_exp", "grape_log_freq_init", "apply_grape"]


def grape_rank2_exp(a: Tensor, b: Tensor, theta: Tensor | float) -> Tensor:
    """``exp(θ L)``, ``L = a bᵀ − b aᵀ``, in closed form ``[..., D, D]`` for ``a``, ``b`` ``[..., D]``.

    ``I + (sin(θs)/s) L + ((1 − cos(θs))/s²) L²`` with ``s² = |a|²|b|² − (a·b)²`` (the area of the
    parallelogram of ``a`` and ``b``, squared); ``s = 0`` (parallel or zero vectors) gives ``I``.

    Raises:
        ValueError: ``a`` and ``b`` differ in shape (the message names them).
    """
    if a.shape != b.shape or a.dim() < 1:
        raise ValueError(
            f"grape_rank2_exp: a and b must be vectors [..., D] of one shape, got {tuple(a.shape)} and {tuple(b.shape)}"
        )
    theta = torch.as_tensor(theta, dtype=a.dtype, device=a.device)[..., None, None]
    L = a[..., :, None] * b[..., None, :] - b[..., :, None] * a[..., None, :]
    s2 = (a * a).sum(-1) * (b * b).sum(-1) - (a * b).sum(-1) ** 2
    s = s2.clamp_min(0).sqrt()[..., None, None]
    safe = torch.where(s > 0, s, torch.ones_like(s))
    first = torch.where(s > 0, torch.sin(theta * safe) / safe, theta)
    second = torch.where(s > 0, (1 - torch.cos(theta * safe)) / safe**2, theta**2 / 2)
    eye = torch.eye(a.shape[-1], dtype=a.dtype, device=a.device)
    return eye + first * L + second * (L @ L)


def grape_log_freq_init(head_dim: int, base: float = 10000.0, log_freq_scale: float = 16.0) -> Tensor:
    """The authors' initial ``λ [D/2] = c · log θ_j``, ``θ_j = base^(−2j/D)`` (float32)."""
    inv_freq, _ = rope_inv_freq(head_dim, base)
    return inv_freq.log() * float(log_freq_scale)


def apply_grape(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Pairs ``(j, j + D/2)`` of ``x [B, H, T, D]`` mapped to ``(x1 c + x2 s, −x1 s + x2 c)``;
    ``cos``/``sin`` ``[B|1, H|1, T, D/2]`` (cast to ``x``'s dtype)."""
    half = x.shape[-1] // 2
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos + x2 * sin, x2 * cos - x1 * sin), dim=-1)


@register("grape")
class GRAPE(RotaryEncoding):
    """Multiplicative GRAPE (Zhang et al. 2026): G(n) = exp(n Σ ω_j L_j), commuting rank-2 generators, learned spectrum."""

    float_positions = True  # G(t) = exp(t ω L) for any real t

    layer_sizes = ("num_heads", "head_dim")
    option_ranges = {
        "num_heads": at_least(1),
        "head_dim": at_least(2),
        "base": greater_than(1),
        "log_freq_scale": greater_than(0),
    }
    shift_invariant = True

    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        base: float = 10000.0,
        share_across_heads: bool = True,
        log_freq_scale: float = 16.0,
        learnable: bool = True,
    ) -> None:
        """Args: ``num_heads``, ``head_dim`` (filled in by the layer; even); ``base`` (the initial
        spectrum, RoPE's); ``share_across_heads`` (one spectrum, or one per head);
        ``log_freq_scale`` (``c`` in ``ω = exp(λ/c)``, the authors' 16); ``learnable`` (train ``λ``)."""
        super().__init__()
        if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim <= 0 or head_dim % 2:
            raise ValueError(f"grape: head_dim must be a positive even integer, got head_dim={head_dim!r}")
        self.num_heads, self.head_dim, self.log_freq_scale = num_heads, head_dim, float(log_freq_scale)
        log_freq = grape_log_freq_init(head_dim, base, log_freq_scale)
        log_freq = log_freq[None] if share_across_heads else log_freq[None].repeat(num_heads, 1)
        self.log_freq = nn.Parameter(log_freq, requires_grad=learnable)  # [H|1, D/2]

    @property
    def freq(self) -> Tensor:
        """The frequencies ``ω = exp(λ/c)`` ``[H|1, D/2]``."""
        return torch.exp(self.log_freq / self.log_freq_scale)

    def _cos_sin(self, positions: Tensor, heads: int) -> tuple[Tensor, Tensor]:
        dtype = torch.promote_types(self.log_freq.dtype, torch.float32)
        freq = head_groups(self.freq.to(dtype), heads, "grape")  # [H|1, D/2]
        angles = positions.to(dtype)[:, None, :, None] * freq[None, :, None, :]  # [B, H|1, T, D/2]
        return angles.cos(), angles.sin()

    def rotate(self, q: Tensor, k: Tensor, q_pos: Tensor, k_pos: Tensor) -> tuple[Tensor, Tensor]:
        if q.shape[-1] != self.head_dim or k.shape[-1] != self.head_dim:
            raise ValueError(
                f"grape: built for head_dim={self.head_dim}, got q {tuple(q.shape)} and k {tuple(k.shape)}"
            )
        kv_heads = k.shape[1]
        if q.shape[1] % max(kv_heads, 1):
            raise ValueError(f"grape: {q.shape[1]} query heads are not a multiple of {kv_heads} key heads")
        group = q.shape[1] // max(kv_heads, 1)
        k_cos, k_sin = self._cos_sin(k_pos, kv_heads)
        q_cos, q_sin = (k_cos, k_sin) if q_pos is k_pos else self._cos_sin(q_pos, kv_heads)
        if group > 1 and q_cos.shape[1] > 1:
            q_cos, q_sin = q_cos.repeat_interleave(group, dim=1), q_sin.repeat_interleave(group, dim=1)
        return apply_grape(q, q_cos, q_sin), apply_grape(k, k_cos, k_sin)

    def preview(self) -> str:
        freq = ", ".join(f"{v:.4g}" for v in self.freq[0].tolist()[:4])
        return (
            f"{self.head_dim // 2} commuting rank-2 generators on the planes (j, j + D/2), "
            f"{self.log_freq.shape[0]} learned spectrum(s) ω = exp(λ/{self.log_freq_scale:g}) = [{freq}, ...]; "
            "G(m)ᵀG(n) = G(n − m)"
        )
