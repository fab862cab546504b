"""RoPE: rotary position embedding (Su et al. 2021, "RoFormer"), with every HF scaling type.

Each 2-D pair of query/key channels is rotated by ``position · θ_k``, ``θ_k = base^(-2k/d_r)``,
so ``⟨R_m q, R_n k⟩`` depends only on ``n - m`` (docs/conventions.md §7.1).

Conventions:

* ``pairing="half"`` pairs channel ``k`` with ``k + d_r/2`` (GPT-NeoX, HF Llama/Mistral/Qwen,
  ``rotate_half``); ``pairing="interleaved"`` pairs ``(2k, 2k+1)`` (the paper, GPT-J, Meta's
  complex form). :func:`convert_rope_pairing` permutes q/k projection rows so a checkpoint can
  switch pairing without changing any output.
* Partial rotary: only the first ``rotary_dim`` channels of each head rotate; ``θ`` uses
  ``rotary_dim`` in its exponent (GPT-NeoX ``rotary_pct``, HF ``partial_rotary_factor``, GPT-J).
* Positions may be real-valued (docs/conventions.md §7.11).
* Angles are computed in float32 (``positions.float() * inv_freq``) whatever the model dtype;
  only ``cos``/``sin`` are cast to the activations' dtype, so a bf16 model keeps positions > 256.
* Scaling (:mod:`posenc.encodings.rope_scaling`): one ``scaling`` value, a type of its
  ``SCALING_TYPES`` and its options (a :class:`RopeScaling`, a dict of its fields, or, in spec
  strings, flat options: ``rope:scaling=yarn,factor=4``), or an HF ``rope_parameters`` dict as it is.
  ``attention_scale`` multiplies both ``cos`` and ``sin`` (logits scale by its square), as HF.
  ``dynamic`` and ``longrope`` recompute their frequencies at forward time from the current length
  ``max(position) + 1`` of the call (queries and new keys together). HF's ``dynamic_rope_update``
  does the same for longrope; for dynamic it only grows (it keeps the largest length seen until a
  call drops below the original length), so the two agree whenever lengths do not shrink above the
  original length. Keys already in a KV cache keep the rotation they were given.
* ``learned_frequencies=True`` is LeRoPE (Mistral Large 4, HF ``MistralLarge4TextRotaryEmbedding``):
  a learned ``alpha [n_pairs]`` (float32, initialised to 0, so the rotation starts as the
  scaling's) multiplies the final frequencies, ``θ_k · exp(α_k)``, after every scaling type and
  before ``attention_scale``, as HF does. ``cos``/``sin`` are then computed from the parameter at
  each call (no cached table); without it the cached tables serve as before (docs/conventions.md §7.18).
* ``drop_rotation="eval"`` rotates in training mode only: a model trained with RoPE is evaluated
  without rotating q and k (DroPE's "drop the positional embedding after training"); ``"always"``
  never rotates, NoPE on the same weights (docs/conventions.md §7.8).

Backends: sdpa and eager (q and k are rotated before the kernel, which then sees plain attention).
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from torch import Tensor, nn

from ..kernels.rope import RotaryTables, rotary, rotary_cos_sin
from ._scaling_option import resolve_scaling, scaling_group
from .base import RotaryEncoding, check_table_size
from .registry import Range, at_least, greater_than, register
from .rope_scaling import SCALING_OPTION_RANGES, RopeScaling, rope_scaled_inv_freq
from .spec import format_spec

__functional__ = ["rope_inv_freq", "apply_rope", "convert_rope_pairing", "rope_cos_sin"]

Pairing = Literal["half", "interleaved"]
#: When the rotation is left out: never, in eval mode only (DroPE-style evaluation), always (NoPE).
DropRotation = Literal["never", "eval", "always"]


# ---------------------------------------------------------------------------- pure functions


def rope_inv_freq(
    head_dim: int, base: float = 10000.0, scaling: dict[str, Any] | None = None, seq_len: int | None = None
) -> tuple[Tensor, float]:
    """Inverse frequencies ``[rotary_dim // 2]`` (float32) and the attention scale.

    Args:
        head_dim: per-head size ``d``; must be even (or give ``partial_rotary_factor`` in ``scaling``).
        base: ``θ`` base ("rope_theta"); ``scaling["rope_theta"]``, when present, takes precedence.
        scaling: an HF-style ``rope_parameters`` dict (``rope_type``, ``factor``,
            ``original_max_position_embeddings``, ``partial_rotary_factor``, ...), or None for the
            paper's frequencies.
        seq_len: current sequence length, read by the length-dependent types (dynamic, longrope).

    Returns:
        ``(inv_freq, attention_scale)``; angles are ``position * inv_freq``.

    Raises:
        ValueError: odd ``head_dim``/rotary dimension, unknown scaling type, bad scaling parameters.
    """
    if not isinstance(head_dim, int) or head_dim <= 0:
        raise ValueError(f"RoPE: head_dim must be a positive int, got {head_dim!r}")
    config: dict[str, Any] = {"rope_theta": base, **(scaling or {}), "head_dim": head_dim}
    if config.get("partial_rotary_factor") is None and head_dim % 2:
        raise ValueError(f"RoPE: head_dim must be even (channels rotate in pairs), got head_dim={head_dim}")
    return rope_scaled_inv_freq(config, seq_len)


def rope_cos_sin(positions: Tensor, inv_freq: Tensor, attention_scale: float = 1.0) -> tuple[Tensor, Tensor]:
    """``cos`` and ``sin`` of the angles ``positions * inv_freq``, shape ``[..., T, d_r/2]``.

    Computed in float32, or float64 when ``inv_freq`` is float64; never in a lower precision.
    """
    return rotary_cos_sin(positions, inv_freq, attention_scale)


def check_pairing(pairing: str) -> None:
    if pairing not in ("half", "interleaved"):
        raise ValueError(f"RoPE: pairing must be 'half' or 'interleaved', got {pairing!r}")


def apply_cos_sin(x: Tensor, cos: Tensor, sin: Tensor, pairing: Pairing, inplace: bool = False) -> Tensor:
    """Rotate the first ``2 * cos.shape[-1]`` channels of ``x [B, H, T, D]``; ``cos``/``sin`` ``[B|1, T, d_r/2]`` float32.

    Runs the fused kernel (:func:`posenc.kernels.rope.rotary`: chunked, no full-size temporaries,
    under autograd too; under ``torch.compile`` the plain expression), which casts the tables to
    ``x``'s dtype once. ``inplace``: rotate ``x`` itself (a fresh projection nobody else holds).
    """
    return rotary(x, cos, sin, pairing=pairing, inplace=inplace)


def apply_rope(
    x: Tensor,
    positions: Tensor,
    inv_freq: Tensor,
    pairing: Pairing = "half",
    rotary_dim: int | None = None,
    attention_scale: float = 1.0,
) -> Tensor:
    """Rotate ``x [B, H, T, D]`` by ``positions [T]`` or ``[B, T]`` (integer or real-valued).

    Args:
        inv_freq: ``[rotary_dim // 2]`` frequencies (:func:`rope_inv_freq`).
        pairing: ``"half"`` (``(k, k + d_r/2)``, HF Llama) or ``"interleaved"`` (``(2k, 2k+1)``, GPT-J).
        rotary_dim: channels to rotate (the first ones); default ``2 * len(inv_freq)``. The rest
            pass through unchanged.
        attention_scale: multiplies ``cos`` and ``sin`` (HF's ``attention_factor``).

    Angles are float32 whatever ``x.dtype``; ``cos``/``sin`` are cast to ``x.dtype`` afterwards.
    """
    check_pairing(pairing)
    if x.dim() != 4:
        raise ValueError(f"apply_rope: x must have shape [B, H, T, D], got {tuple(x.shape)}")
    width = 2 * inv_freq.shape[-1]
    if rotary_dim is None:
        rotary_dim = width
    if rotary_dim % 2 or rotary_dim <= 0:
        raise ValueError(
            f"apply_rope: rotary_dim must be a positive even number, got rotary_dim={rotary_dim}"
        )
    if rotary_dim != width:
        raise ValueError(
            f"apply_rope: rotary_dim={rotary_dim} but inv_freq has {inv_freq.shape[-1]} values (= rotary_dim/2)"
        )
    if rotary_dim > x.shape[-1]:
        raise ValueError(f"apply_rope: rotary_dim={rotary_dim} exceeds the head dimension {x.shape[-1]}")
    if positions.dim() == 1:
        positions = positions[None]
    if positions.dim() != 2 or positions.shape[-1] != x.shape[2]:
        raise ValueError(
            f"apply_rope: positions must have shape [T] or [B, T] with T={x.shape[2]}, got {tuple(positions.shape)}"
        )
    cos, sin = rope_cos_sin(positions, inv_freq, attention_scale)
    return apply_cos_sin(x, cos, sin, pairing)


def _pairing_permutation(rotary_dim: int, head_dim: int) -> Tensor:
    """``P = [0, 2, ..., d_r-2, 1, 3, ..., d_r-1]`` then the pass-through channels: ``half(x[P]) = interleaved(x)[P]``."""
    return torch.cat(
        (torch.arange(0, rotary_dim, 2), torch.arange(1, rotary_dim, 2), torch.arange(rotary_dim, head_dim))
    )


def convert_rope_pairing(
    weight: Tensor,
    num_heads: int,
    head_dim: int,
    src: Pairing = "interleaved",
    dst: Pairing = "half",
    rotary_dim: int | None = None,
) -> Tensor:
    """Permute the rows of a q or k projection weight ``[num_heads*head_dim, in]`` (or bias ``[num_heads*head_dim]``).

    A model whose q/k projections are converted this way gives the same attention scores with
    ``pairing=dst`` as the original with ``pairing=src`` (docs/conventions.md §7.3). Use
    ``num_heads = num_kv_heads`` for the key projection of grouped-query attention. Values and the
    output projection are unchanged.
    """
    check_pairing(src)
    check_pairing(dst)
    rotary_dim = head_dim if rotary_dim is None else rotary_dim
    if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
        raise ValueError(
            f"convert_rope_pairing: rotary_dim must be even and in (0, head_dim={head_dim}], got {rotary_dim}"
        )
    if weight.shape[0] != num_heads * head_dim:
        raise ValueError(
            f"convert_rope_pairing: weight has {weight.shape[0]} rows, expected num_heads*head_dim = {num_heads * head_dim}"
        )
    if src == dst:
        return weight.clone()
    perm = _pairing_permutation(rotary_dim, head_dim)
    if src == "half":  # half -> interleaved is the inverse permutation
        perm = torch.argsort(perm)
    per_head = weight.reshape(num_heads, head_dim, *weight.shape[1:])
    return per_head[:, perm.to(weight.device)].reshape(weight.shape).clone()


# ---------------------------------------------------------------------------- module


@register("rope")
class RoPE(RotaryEncoding):
    """Rotary position embedding (RoFormer): rotates q and k; half or interleaved pairing, partial, scaled.

    Args:
        head_dim: per-head size (filled in by the attention layer).
        base: ``θ`` base ("rope_theta").
        pairing: ``"half"`` (GPT-NeoX/Llama) or ``"interleaved"`` (paper/GPT-J).
        rotary_dim: rotate only the first ``rotary_dim`` channels (default: all); for
            ``"proportional"``, the channels that turn (0 is allowed there: no pair turns).
        partial_rotary_factor: HF's fraction form of ``rotary_dim`` (exclusive with it), with HF's
            rounding: ``rotary_dim = int(head_dim * p)`` (``int(p * head_dim // 2)`` pairs for
            ``"proportional"``, where it may be 0).
        cache_size: positions whose ``cos``/``sin`` are precomputed; the table grows on demand
            (up to a bound, past which positions are computed directly: :class:`RotaryTables`).
        scaling: the frequency scaling, one value (docs/conventions.md §7.5): ``None``, a type name
            of ``rope_scaling.SCALING_TYPES``, a :class:`RopeScaling` (``RopeScaling("yarn",
            factor=4.0, original_max_position_embeddings=4096)``) or a dict of its fields
            (``{"type": "yarn", "factor": 4.0, ...}``). Spec strings and keywords may give its
            options flat beside a type name (``rope:scaling=yarn,factor=4``, ``RoPE(scaling="yarn",
            factor=4.0)``; ``RopeScaling.OPTIONS``, HF ``rope_parameters`` names): the registry
            gathers them (:mod:`~posenc.encodings._scaling_option`), and ``config()`` lists them
            flat. :attr:`scaling` is the :class:`RopeScaling`. For ``"proportional"`` (p-RoPE),
            ``rotary_dim`` (or HF's ``partial_rotary_factor``) names the channels that turn; the
            frequency table spans the whole head.
        rope_parameters: an HF ``rope_parameters`` dict used as it is (its ``rope_theta`` and
            ``partial_rotary_factor`` set the base and rotary width); exclusive with ``scaling`` and
            its options, except ``max_position_embeddings`` (HF's model-level length, read by
            ``dynamic`` and by yarn/longrope/llama3 when ``original_max_position_embeddings`` is absent).
        drop_rotation: ``"never"`` (default); ``"eval"``: rotate in training mode only, so a model
            trained with RoPE is evaluated (``model.eval()``) without rotating q and k, as DroPE
            evaluates a RoPE-trained checkpoint; ``"always"``: never rotate (NoPE on the same
            weights; a RoPE checkpoint loads unchanged, the encoding has no saved state)
            (docs/conventions.md §7.8).
        learned_frequencies: LeRoPE (Mistral Large 4): a learned :attr:`alpha` ``[n_pairs]``
            (``nn.Parameter``, float32, zeros: HF's ``_init_weights``) scales the final frequencies
            by ``exp(alpha)``, whatever the scaling; saved in the state dict as ``alpha``
            (docs/conventions.md §7.18). Created when ``head_dim`` is known (at construction or
            when the layer binds the encoding); kept float32 when the module is cast.
    """

    float_positions = True  # angles p·θ are defined for any real position

    layer_sizes = ("head_dim",)
    option_ranges = {
        "head_dim": at_least(1),
        "base": greater_than(1),
        "rotary_dim": at_least(0),  # 0 only for p-RoPE (no pair turns); the other types need >= 2
        "partial_rotary_factor": Range(low=0, high=1),
        "cache_size": at_least(1),
        **SCALING_OPTION_RANGES,
    }
    option_groups = {"scaling": scaling_group(RopeScaling.OPTIONS)}
    derived_buffers = ("tables.inv_freq", "tables.cos", "tables.sin")
    shift_invariant = True
    shifts_by_rotation = True  # fixed frequencies: R(p + Δ) = R(Δ) R(p) (not for dynamic or longrope)

    def __init__(
        self,
        head_dim: int | None = None,
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
        super().__init__()
        check_pairing(pairing)
        if not isinstance(learned_frequencies, bool):
            raise ValueError(
                f"rope: learned_frequencies must be True or False (LeRoPE), got {learned_frequencies!r}"
            )
        self.learned_frequencies = learned_frequencies
        self.alpha: nn.Parameter | None = None  # LeRoPE's log-scales of the frequencies, once bound
        if drop_rotation not in ("never", "eval", "always"):
            raise ValueError(
                f"rope: drop_rotation must be 'never', 'eval' or 'always', got drop_rotation={drop_rotation!r}"
            )
        self.drop_rotation = drop_rotation
        if head_dim is not None and (
            isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim <= 0
        ):
            raise ValueError(f"rope: head_dim must be a positive int, got {head_dim!r}")
        check_table_size("rope", "cache_size", cache_size, cache_size * max(head_dim or 2, 2))  # cos and sin
        self.scaling, self._base, self._partial = resolve_scaling(base, scaling, rope_parameters)
        if partial_rotary_factor is not None:
            if rope_parameters is not None:
                raise ValueError(
                    "rope: give partial_rotary_factor inside rope_parameters or as an option, not both"
                )
            self._partial = float(partial_rotary_factor)
        self._rotary_dim_option = rotary_dim
        if rotary_dim is not None and self._partial is not None:
            raise ValueError(
                "rope: give rotary_dim or partial_rotary_factor (the same width as a fraction of head_dim), "
                "not both"
            )
        self.head_dim: int | None = None
        self.pairing = pairing
        self.attention_scale = 1.0
        self._seq_len: int | None = None  # the length the frequencies were computed for (dynamic, longrope)
        self.tables = RotaryTables(cache_size=cache_size)
        if head_dim is not None:
            self.bind(head_dim)

    @property
    def is_bound(self) -> bool:
        """Whether ``head_dim`` is known (given, or taken from the first layer or call)."""
        return self.head_dim is not None

    @property
    def rope_type(self) -> str:
        """The scaling type (``"default"`` without scaling)."""
        return self.scaling.type

    @property
    def inv_freq(self) -> Tensor:
        """The frequencies ``[rotary_dim/2]`` (float32) of the current length."""
        return self.tables.inv_freq

    @property
    def cos_cached(self) -> Tensor:
        """The cached ``cos`` table ``[rows, rotary_dim/2]`` (float32)."""
        return self.tables.cos

    @property
    def sin_cached(self) -> Tensor:
        """The cached ``sin`` table ``[rows, rotary_dim/2]`` (float32)."""
        return self.tables.sin

    def bind(self, head_dim: int) -> None:
        """Fix ``head_dim``, check every option against it and build the float32 tables.

        Called by ``__init__`` when ``head_dim`` is given; otherwise by the first attention layer
        that takes this encoding (:meth:`init_layer`) or the first :meth:`rotate` (from ``q``'s
        last dimension). Binding again to another size is an error.
        """
        if self.head_dim is not None:
            if head_dim != self.head_dim:
                raise ValueError(
                    f"rope: built for head_dim={self.head_dim}, the layer has head_dim={head_dim}"
                )
            return
        self.scaling_config = self._config_for(head_dim)
        inv_freq, _ = rope_scaled_inv_freq(self.scaling_config, None)  # validates every option
        self.rotary_dim = 2 * inv_freq.shape[0]
        if self.rotary_dim > head_dim:
            raise ValueError(f"rope: rotary_dim={self.rotary_dim} exceeds head_dim={head_dim}")
        self.head_dim = head_dim
        if self.learned_frequencies:  # one log-scale per frequency, 0: exp(0) = 1 (HF's init)
            self.alpha = nn.Parameter(torch.zeros(inv_freq.shape[0], device=self.buffer_device))
        self.reset_buffers()

    def init_layer(self, layer) -> None:
        self.bind(layer.head_dim)

    def _config_for(self, head_dim: int) -> dict[str, Any]:
        """The HF-style config dict read by :mod:`rope_scaling` for this ``head_dim``."""
        config: dict[str, Any] = {"rope_theta": self._base, **self.scaling.config()}
        if self._partial is not None:
            config["partial_rotary_factor"] = self._partial
        rotary_dim = self._rotary_dim_option
        if rotary_dim is not None:
            # 0 is meaningful for p-RoPE (no pair rotates); the other types reject it in rotary_width.
            if rotary_dim % 2 or not 0 <= rotary_dim <= head_dim:
                raise ValueError(
                    f"rope: rotary_dim must be even and at most head_dim={head_dim}, got rotary_dim={rotary_dim}"
                )
            config["rotary_dim"] = rotary_dim
        elif self._partial is None and head_dim % 2:
            raise ValueError(
                f"rope: head_dim must be even (channels rotate in pairs), got head_dim={head_dim}"
            )
        config["head_dim"] = head_dim
        return config

    # ------------------------------------------------------------------ config
    def config(self) -> dict[str, Any]:
        """The options this instance was built with, leaving out those left at None."""
        return {k: v for k, v in self._config.items() if v is not None}

    def spec(self) -> str:
        """A spec string that rebuilds this encoding; an HF ``rope_parameters`` dict becomes typed options."""
        config = self.config()
        if "rope_parameters" in config:
            del config["rope_parameters"]
            config["base"] = self._base
            # The channels that turn: the rotary width, or p-RoPE's pairs with non-zero frequency.
            rotating = 2 * int(torch.count_nonzero(self.inv_freq)) if self.is_bound else None
            if self.is_bound and rotating != self.head_dim:
                config["rotary_dim"] = rotating
            if self.rope_type != "default":
                config["scaling"] = self.rope_type
            config.update(self.scaling.options())
        return format_spec(self.name, config)

    def extra_repr(self) -> str:
        """What the rotation computes with, however it was given: the base and scaling resolved from
        ``rope_parameters`` too (their options, not the ``None`` of unused keywords)."""
        parts = [f"head_dim={self.head_dim}", f"base={self._base!r}", f"pairing={self.pairing!r}"]
        if self.is_bound:
            parts.append(f"rotary_dim={self.rotary_dim}")
        if self.rope_type != "default":
            parts.append(f"scaling={self.rope_type!r}")
            parts += [f"{k}={v!r}" for k, v in self.scaling.options().items()]
            parts.append(f"attention_scale={self.attention_scale:.6g}")
        if self.drop_rotation != "never":
            parts.append(f"drop_rotation={self.drop_rotation!r}")
        if self.learned_frequencies:
            parts.append("learned_frequencies=True")
        return ", ".join(parts)

    # ------------------------------------------------------------------ tables
    def reset_buffers(self) -> None:
        """Recompute the frequencies and the ``cos``/``sin`` tables in float32 (empty while unbound)."""
        if not self.is_bound:
            self.tables.reset(None)
            return
        inv_freq, self.attention_scale = rope_scaled_inv_freq(self.scaling_config, self._seq_len)
        self.tables.reset(inv_freq.to(self.buffer_device), self.attention_scale)

    def _refresh_frequencies(self, seq_len: int) -> None:
        """Length-dependent types (dynamic, longrope): recompute from the current length, as HF does per forward."""
        if seq_len != self._seq_len:
            self._seq_len = seq_len
            self.reset_buffers()

    def frequencies(self) -> Tensor:
        """The frequencies the rotation turns by, ``[rotary_dim/2]`` float32: :attr:`inv_freq`, times
        ``exp(alpha)`` with ``learned_frequencies`` (differentiable in :attr:`alpha`)."""
        if self.alpha is None:
            return self.inv_freq
        return self.inv_freq * self.alpha.to(device=self.inv_freq.device, dtype=torch.float32).exp()

    def cos_sin(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """Float32 ``cos``/``sin`` ``[B, T, rotary_dim/2]`` for ``positions [B, T]`` (integer or real-valued).

        With ``learned_frequencies`` they are computed from :meth:`frequencies` at each call (they
        follow :attr:`alpha` as it trains); otherwise they are read from the cached tables.
        """
        if self.alpha is None:
            return self.tables.tables(positions)
        return rotary_cos_sin(positions, self.frequencies().to(positions.device), self.attention_scale)

    def _apply(self, fn, recurse: bool = True) -> RoPE:
        # LeRoPE's alpha stays float32 through a cast (HF keeps rotary_emb in float32): exp(alpha)
        # in bfloat16 would round every frequency. The Parameter object is kept (optimizers hold it).
        super()._apply(fn, recurse)
        if self.alpha is not None and self.alpha.dtype != torch.float32:
            self.alpha.data = self.alpha.data.float()
        return self

    def switch_pairing_(self, pairing: Pairing) -> None:
        """Rotate with ``pairing`` from now on. Half of a switch: the layers that use this encoding
        must permute their q/k projections to match, as :func:`switch_rope_pairing_` does."""
        check_pairing(pairing)
        self.pairing = pairing
        self._config["pairing"] = pairing

    # ------------------------------------------------------------------ hook
    def rotate(self, q: Tensor, k: Tensor, q_pos: Tensor, k_pos: Tensor) -> tuple[Tensor, Tensor]:
        return self._rotate(q, k, q_pos, k_pos, inplace=False)

    def rotate_fresh(self, q: Tensor, k: Tensor, q_pos: Tensor, k_pos: Tensor) -> tuple[Tensor, Tensor]:
        """:meth:`rotate` in place: q and k are fresh projections the caller hands over."""
        return self._rotate(q, k, q_pos, k_pos, inplace=True)

    def _rotate(
        self, q: Tensor, k: Tensor, q_pos: Tensor, k_pos: Tensor, inplace: bool
    ) -> tuple[Tensor, Tensor]:
        self.bind(q.shape[-1])  # a no-op once bound; an error if q's size differs from head_dim
        if q.shape[-1] != self.head_dim or k.shape[-1] != self.head_dim:
            raise ValueError(
                f"rope: built for head_dim={self.head_dim}, got q {tuple(q.shape)} and k {tuple(k.shape)}"
            )
        if self.rotation_dropped:
            return q, k
        if self.scaling.length_dependent:
            # One length for the whole call (max position + 1), so q and k see the same frequencies.
            both = torch.cat((q_pos.reshape(-1), k_pos.reshape(-1)))
            self._refresh_frequencies(int(both.max()) + 1 if both.numel() else 1)
        q_cos, q_sin = self.cos_sin(q_pos)
        # A self-attention step rotates q and k at the same positions: one table lookup
        k_cos, k_sin = (q_cos, q_sin) if k_pos is q_pos else self.cos_sin(k_pos)
        return (
            apply_cos_sin(q, q_cos, q_sin, self.pairing, inplace),
            apply_cos_sin(k, k_cos, k_sin, self.pairing, inplace),
        )

    @property
    def rotation_dropped(self) -> bool:
        """Whether :meth:`rotate` leaves q and k as they are now (``drop_rotation`` and the module's mode)."""
        return self.drop_rotation == "always" or (self.drop_rotation == "eval" and not self.training)

    def preview(self) -> str:
        if not self.is_bound:
            return "head_dim not set yet: the first attention layer that takes this encoding sets it"
        freqs = ", ".join(f"{v:.4g}" for v in self.inv_freq[:6].tolist())
        more = ", ..." if self.inv_freq.numel() > 6 else ""
        dropped = "" if self.drop_rotation == "never" else f", drop_rotation={self.drop_rotation}"
        dropped += (
            ", learned_frequencies (LeRoPE: inv_freq below times exp(alpha))"
            if self.alpha is not None
            else ""
        )
        return (
            f"rope_type={self.rope_type}, pairing={self.pairing}, rotary_dim={self.rotary_dim}/{self.head_dim}, "
            f"attention_scale={self.attention_scale:.6g}{dropped}\ninv_freq = [{freqs}{more}]\n"
            f"wavelengths 2π/θ: shortest {2 * torch.pi / float(self.inv_freq.max()):.4g}, "
            f"longest {2 * torch.pi / float(self.inv_freq.min().clamp_min(1e-30)):.4g} positions"
        )


def load_lerope_alpha_(encoding: RoPE, alpha: Tensor) -> RoPE:
    """Copy an HF LeRoPE ``alpha`` into ``encoding`` (built with ``learned_frequencies=True``), in place.

    HF Mistral Large 4 keeps one ``alpha [n_pairs]`` per model (``model.rotary_emb.alpha``, read by
    every RoPE layer); posenc gives each layer's RoPE its own, so a model loads the same tensor into
    each. Both scale the final frequencies, ``inv_freq · exp(alpha)``, in the same pair order
    (docs/conventions.md §7.18).

    Raises:
        ValueError: ``encoding`` has no ``alpha`` (not ``learned_frequencies``, or not bound yet), or
            ``alpha`` is not a 1-D tensor of its ``n_pairs`` values.
    """
    target = getattr(encoding, "alpha", None)
    if target is None:
        raise ValueError(
            "load_lerope_alpha_: the encoding has no alpha; build it with rope:learned_frequencies=true "
            "and bind it to a head size first"
        )
    if not isinstance(alpha, Tensor) or tuple(alpha.shape) != tuple(target.shape):
        shape = tuple(alpha.shape) if isinstance(alpha, Tensor) else type(alpha).__name__
        raise ValueError(
            f"load_lerope_alpha_: alpha must have shape {tuple(target.shape)} (one per frequency pair), got {shape}"
        )
    with torch.no_grad():
        target.copy_(alpha.detach().to(device=target.device, dtype=torch.float32))
    return encoding
