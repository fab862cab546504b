"""ComRoPE: rotary embedding with trainable commuting angle matrices (Yu et al., CVPR 2025, "ComRoPE:
Scalable and Robust Rotary Position Embedding Parameterized by Trainable Commuting Angle Matrices",
arXiv 2506.03737; code: github.com/Longin-Yu/ComRoPE, ``model.py``).

A token at the point ``x ∈ R^A`` (``A = num_axes``) has its query and key multiplied by

    ``R(x) = exp(x_1 A_1 + … + x_A A_A)``,

each ``A_i`` block-diagonal, ``m = d/b`` skew-symmetric ``b × b`` blocks ``B_ij`` on the channels
``j·b … (j+1)·b − 1`` (``b = block_size``), the blocks of one index ``j`` pairwise commuting, so
``R(x)`` is block-diagonal with block ``j`` equal to ``exp(Σ_i x_i B_ij)``. The authors' two
solutions, with ``P_hj`` a trainable ``b × b`` matrix per head ``h`` and block ``j``
(``freqs``, drawn ``N(0, init_std²)``, the code's ``init_std = 1``):

* ``variant="ap"`` (axial partition, ``ComRoPEAPAttention``): ``B_ij = P_j − P_jᵀ`` if
  ``j ≡ i (mod A)``, else ``0``: every block turns with one axis;
* ``variant="ld"`` (linearly dependent, ``ComRoPELDAttention``): ``B_ij = θ_ij (P_j − P_jᵀ)``,
  the trainable ``θ [A, m]`` (``multiplier``, ``N(0, 1)``) shared by the heads.

Because the generators commute, ``R(a)ᵀ R(b) = R(b − a)``: attention sees only ``b − a``
(docs/conventions.md §7.12). With ``b = 2`` and one axis ComRoPE-AP is RoPE with trainable
frequencies; larger blocks mix channels inside a block. Queries and keys are the authors'
column vectors: ``q' = R(x) q`` (``torch.matmul(R, Q)``).

Positions (:mod:`posenc.encodings._axes`): ``num_axes`` coordinates per token, from
``position_ids`` (real-valued, e.g. the authors' patch centres ``(i + ½)/n``), or from patch
indices with ``grid_width``, or the token position on every axis. Grouped-query attention: the
matrices are per query head; a key head uses those of the first query head of its group. ``R`` is
formed in float32 (float64 with float64 parameters) by ``torch.matrix_exp`` (``b = 2``: the closed
form ``cos``/``sin``) and cast to the activations' dtype. Whole token positions on every axis with
``b > 2`` take the power form ``exp(pM) = Π_k exp(2^k M)^{bit_k(p)}`` (:func:`apply_power_rotation`:
one float64 ``matrix_exp`` per bit of the largest position instead of one per token).

Backends: sdpa and eager (q and k are rotated before the kernel, which then sees plain attention).
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from torch import Tensor, nn

from ._axes import AxisPositions, check_axes, head_groups
from .base import RotaryEncoding, checks_values
from .registry import at_least, register
from .spec import format_spec

__functional__ = [
    "comrope_generators",
    "skew_part",
    "skew_exp",
    "block_rotations",
    "apply_block_rotation",
    "apply_power_rotation",
]

Variant = Literal["ap", "ld"]


def skew_part(raw: Tensor) -> Tensor:
    """``P − Pᵀ`` over the last two axes (a skew-symmetric matrix from any square one).

    Raises:
        ValueError: ``raw`` is not a batch of square matrices (the message names it).
    """
    if raw.dim() < 2 or raw.shape[-1] != raw.shape[-2]:
        raise ValueError(f"skew_part: raw must be square matrices [..., b, b], got {tuple(raw.shape)}")
    return raw - raw.transpose(-1, -2)


def comrope_generators(
    freqs: Tensor, num_axes: int, variant: Variant = "ap", multiplier: Tensor | None = None
) -> Tensor:
    """The angle matrices' blocks ``[H, A, m, b, b]``: block ``j`` of ``A_i`` for each head.

    ``freqs [H, m, b, b]`` are the trainable ``P_hj``; ``"ap"`` keeps ``P_j − P_jᵀ`` on axis
    ``j mod A`` (zero on the others), ``"ld"`` scales it by ``multiplier [A, m]`` on every axis.

    Raises:
        ValueError: ``freqs`` or ``multiplier`` of the wrong shape, or an unknown variant (named).
    """
    if freqs.dim() != 4 or freqs.shape[-1] != freqs.shape[-2]:
        raise ValueError(
            f"comrope: freqs must have shape [H, m, b, b] (square blocks), got {tuple(freqs.shape)}"
        )
    skew = skew_part(freqs)[:, None]  # [H, 1, m, b, b]
    blocks = freqs.shape[1]
    if variant == "ap":
        axis = torch.arange(blocks, device=freqs.device) % num_axes
        mask = (axis[None, :] == torch.arange(num_axes, device=freqs.device)[:, None]).to(skew.dtype)
        return skew * mask[None, :, :, None, None]
    if variant == "ld":
        if multiplier is None or tuple(multiplier.shape) != (num_axes, blocks):
            got = None if multiplier is None else tuple(multiplier.shape)
            raise ValueError(
                f"comrope: multiplier must have shape [num_axes, m] = [{num_axes}, {blocks}], got {got}"
            )
        return skew * multiplier.to(skew.dtype)[None, :, :, None, None]
    raise ValueError(f"comrope: variant must be 'ap' or 'ld', got variant={variant!r}")


def skew_exp(generator: Tensor) -> Tensor:
    """``exp(G)`` of skew-symmetric ``G [..., b, b]``: the closed form for ``b = 2``
    (``[[cos w, −sin w], [sin w, cos w]]``, ``w = G[1, 0]``), ``torch.matrix_exp`` otherwise."""
    if generator.shape[-1] == 2:
        w = generator[..., 1, 0]
        cos, sin = w.cos(), w.sin()
        return torch.stack([torch.stack([cos, -sin], -1), torch.stack([sin, cos], -1)], -2)
    return torch.matrix_exp(generator.contiguous())


def block_rotations(generators: Tensor, coords: Tensor) -> Tensor:
    """The block rotations ``R [B, H, T, m, b, b] = exp(Σ_i x_i G_i)`` of coordinates ``coords [B, T, A]``.

    ``generators [H, A, m, b, b]`` (skew-symmetric blocks; ``m = 1`` for a dense generator).
    Computed in the wider of float32 and the generators' dtype.

    Raises:
        ValueError: the generators are not ``[H, A, m, b, b]`` with square blocks, or their axes
            disagree with ``coords`` (the message names ``generators``).
    """
    if generators.dim() != 5 or generators.shape[-1] != generators.shape[-2]:
        raise ValueError(
            f"block_rotations: generators must have shape [H, A, m, b, b] (square blocks), got {tuple(generators.shape)}"
        )
    if coords.shape[-1] != generators.shape[1]:
        raise ValueError(
            f"block_rotations: generators have {generators.shape[1]} axes, coords {coords.shape[-1]} "
            f"(coords {tuple(coords.shape)})"
        )
    dtype = torch.promote_types(generators.dtype, torch.float32)
    summed = torch.einsum("bta,hanij->bhtnij", coords.to(dtype), generators.to(dtype))
    return skew_exp(summed)


def apply_block_rotation(x: Tensor, rotations: Tensor) -> Tensor:
    """``x [B, H, T, D]`` with channels ``j·b … (j+1)·b − 1`` multiplied by ``rotations[..., j, :, :]``
    (``[B|1, H|1, T, m, b, b]``, cast to ``x``'s dtype); channels past ``m·b`` pass through."""
    blocks, size = rotations.shape[-3], rotations.shape[-1]
    width = blocks * size
    head, rest = x[..., :width], x[..., width:]
    split = head.unflatten(-1, (blocks, size))
    out = torch.einsum("...nij,...nj->...ni", rotations.to(x.dtype), split).flatten(-2)
    return out if not rest.shape[-1] else torch.cat((out, rest), dim=-1)


@register("comrope")
class ComRoPE(AxisPositions, RotaryEncoding):
    """ComRoPE (Yu et al. 2025): R(x) = exp(Σ x_i A_i) with trainable, commuting, block-diagonal skew A_i."""

    float_positions = True  # exp(x·A) is defined for any real coordinate

    layer_sizes = ("num_heads", "head_dim")
    option_ranges = {
        "num_heads": at_least(1),
        "head_dim": at_least(2),
        "block_size": at_least(2),
        "num_axes": at_least(1),
        "grid_width": at_least(1),
        "init_std": at_least(0),
    }
    shift_invariant = True
    example_options = {"block_size": 4, "init_std": 0.3}

    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        variant: Variant = "ap",
        block_size: int = 2,
        num_axes: int = 1,
        grid_width: int | None = None,
        init_std: float = 1.0,
    ) -> None:
        """Args: ``num_heads``, ``head_dim`` (filled in by the layer); ``variant`` (``"ap"`` or
        ``"ld"``); ``block_size`` ``b`` (the authors' default 2; ``head_dim`` a multiple of
        ``b·num_axes`` for ``"ap"``, of ``b`` for ``"ld"``); ``num_axes`` (coordinates per token);
        ``grid_width`` (two axes from row-major patch indices); ``init_std`` (the ``P`` blocks'
        initial standard deviation, the authors' 1)."""
        super().__init__()
        if variant not in ("ap", "ld"):
            raise ValueError(f"comrope: variant must be 'ap' or 'ld', got variant={variant!r}")
        check_axes("comrope", num_axes, grid_width)
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 2:
            raise ValueError(f"comrope: block_size must be an int >= 2, got block_size={block_size!r}")
        unit = block_size * num_axes if variant == "ap" else block_size
        if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim <= 0 or head_dim % unit:
            what = "block_size·num_axes" if variant == "ap" else "block_size"
            raise ValueError(
                f"comrope: head_dim must be a positive multiple of {what} = {unit} (variant={variant!r}), "
                f"got head_dim={head_dim!r}"
            )
        self.num_heads, self.head_dim, self.variant, self.block_size = (
            num_heads,
            head_dim,
            variant,
            block_size,
        )
        self.num_axes, self.grid_width = num_axes, grid_width
        blocks = head_dim // block_size
        self.freqs = nn.Parameter(torch.randn(num_heads, blocks, block_size, block_size) * init_std)
        if variant == "ld":
            self.multiplier = nn.Parameter(torch.randn(num_axes, blocks))
        else:
            self.multiplier = None

    def config(self) -> dict[str, Any]:
        """The options this instance was built with, leaving out those left at None."""
        return {k: v for k, v in self._config.items() if v is not None}

    def spec(self) -> str:
        """A spec string that rebuilds this encoding (options left at None left out)."""
        return format_spec(self.name, self.config())

    def generators(self, dtype: torch.dtype | None = None) -> Tensor:
        """The blocks of the angle matrices ``[H, A, m, b, b]`` (block ``j`` of ``A_i`` per head),
        from the parameters cast to ``dtype`` (default: theirs)."""
        multiplier = (
            self.multiplier if self.multiplier is None or dtype is None else self.multiplier.to(dtype)
        )
        freqs = self.freqs if dtype is None else self.freqs.to(dtype)
        return comrope_generators(freqs, self.num_axes, self.variant, multiplier)

    @property
    def block_width(self) -> int:
        """``b``, the size of a block."""
        return self.block_size

    def rotations(self, coords: Tensor, heads: int | None = None) -> Tensor:
        """``R(x) [B, H, T, m, b, b]`` at coordinates ``coords [B, T, A]`` (``heads`` key/value heads under GQA)."""
        generators = self.generators()
        if heads is not None:
            generators = head_groups(generators, heads, "comrope")
        return block_rotations(generators, coords)

    def rotate(self, q: Tensor, k: Tensor, q_pos: Tensor, k_pos: Tensor) -> tuple[Tensor, Tensor]:
        if q.shape[-1] != self.head_dim or k.shape[-1] != self.head_dim:
            raise ValueError(
                f"comrope: built for head_dim={self.head_dim}, got q {tuple(q.shape)} and k {tuple(k.shape)}"
            )
        return rotate_grouped(self, q, k, q_pos, k_pos)

    def preview(self) -> str:
        m = self.head_dim // self.block_size
        where = (
            f"block j turns with axis j mod {self.num_axes}"
            if self.variant == "ap"
            else f"every block turns with θ_ij-weighted axes (θ [{self.num_axes}, {m}])"
        )
        return (
            f"variant={self.variant}: {m} skew blocks of {self.block_size}x{self.block_size} per head "
            f"({self.num_heads} heads), {where}; R(x) = exp(Σ x_i A_i), relative: R(a)ᵀR(b) = R(b − a)"
        )


def rotate_grouped(enc: Any, q: Tensor, k: Tensor, q_pos: Tensor, k_pos: Tensor) -> tuple[Tensor, Tensor]:
    """Rotate ``q`` and ``k`` by ``enc.rotations`` of their coordinates, key heads taking the
    rotation of their group's first query head and every query head its group's.

    Token positions on every axis (no ``position_ids``, no ``grid_width``), whole numbers and blocks
    wider than 2: ``R(p) = exp(p M)``, ``M = Σ_i G_i``, is applied by :func:`apply_power_rotation`
    (one ``matrix_exp`` per bit of the largest position instead of one per token)."""
    kv_heads = k.shape[1]
    if q.shape[1] % max(kv_heads, 1):
        raise ValueError(f"{enc.name}: {q.shape[1]} query heads are not a multiple of {kv_heads} key heads")
    group = q.shape[1] // max(kv_heads, 1)
    dtype = torch.promote_types(
        next(enc.parameters()).dtype, torch.float32
    )  # float64 with float64 parameters
    one_axis = enc._ids is None and enc.grid_width is None
    if (
        one_axis
        and enc.block_width > 2
        and not q_pos.is_floating_point()
        and not k_pos.is_floating_point()
        and checks_values()  # the bit count reads the positions
    ):
        summed = head_groups(
            enc.generators(torch.float64).sum(dim=1), kv_heads, enc.name
        )  # exact sums  # [Hkv|1, m, b, b]
        q_gen = summed.repeat_interleave(group, dim=0) if group > 1 and summed.shape[0] > 1 else summed
        return apply_power_rotation(q, q_gen, q_pos, dtype), apply_power_rotation(k, summed, k_pos, dtype)
    k_rot = enc.rotations(enc.axis_coords(k_pos, k.shape[2], "keys", dtype, k.shape[0]), kv_heads)
    if q_pos is k_pos and q.shape[2] == k.shape[2]:
        q_rot = k_rot
    else:
        q_rot = enc.rotations(enc.axis_coords(q_pos, q.shape[2], "queries", dtype, q.shape[0]), kv_heads)
    if group > 1 and q_rot.shape[1] > 1:
        q_rot = q_rot.repeat_interleave(group, dim=1)
    return apply_block_rotation(q, q_rot), apply_block_rotation(k, k_rot)


def apply_power_rotation(
    x: Tensor, generator: Tensor, positions: Tensor, dtype: torch.dtype = torch.float32
) -> Tensor:
    """``exp(p M)`` applied to ``x [B, H, T, D]`` at whole positions ``p [B|1, T]`` (non-negative),
    for skew blocks ``M [H|1, m, b, b]``: ``exp(p M) = Π_k exp(2^k M)^{bit_k(p)}``.

    The powers ``exp(2^k M)`` are formed by ``torch.matrix_exp`` in float64 (exact to float64
    rounding even where ``2^k |M|`` is large) and applied in ``dtype`` (at least float32), one
    block product per bit; the result is cast to ``x``'s dtype. Channels past ``m·b`` pass through.
    """
    blocks, size = generator.shape[-3], generator.shape[-1]
    width = blocks * size
    top = int(positions.max()) if positions.numel() else 0
    bits = max(top.bit_length(), 1)
    scales = 2.0 ** torch.arange(bits, dtype=torch.float64, device=generator.device)
    wide = generator.to(torch.float64)
    powers = torch.matrix_exp((scales.view(-1, 1, 1, 1, 1) * wide[None]).contiguous())  # [bits, H, m, b, b]
    compute = torch.promote_types(dtype, x.dtype)
    powers = powers.to(compute)
    head, rest = x[..., :width], x[..., width:]
    y = head.to(compute).unflatten(-1, (blocks, size))  # [B, H, T, m, b]
    for bit in range(bits):
        mask = ((positions >> bit) & 1).bool()[:, None, :, None, None]  # [B, 1, T, 1, 1]
        turned = torch.einsum("hnij,bhtnj->bhtni", powers[bit], y)
        y = torch.where(mask, turned, y)
    out = y.flatten(-2).to(x.dtype)
    return out if not rest.shape[-1] else torch.cat((out, rest), dim=-1)
