"""RoPE frequency scaling: a registry of pure functions ``(config, seq_len) -> (inv_freq, attention_scale)``.

Every function takes one plain ``config`` dict, spelled like an HF ``rope_parameters`` dict
(transformers 5.23 ``modeling_rope_utils.py``) plus two model-level entries HF keeps on the model
config:

==================================  ===========================================================
key                                 meaning
==================================  ===========================================================
``head_dim``                        per-head size ``d`` (required)
``rope_theta``                      base ``b`` (default 10000)
``partial_rotary_factor``           rotary width ``d_r = int(d * factor)`` (default 1.0)
``rotary_dim``                      posenc only: ``d_r`` given exactly (wins over the factor)
``factor``                          context-extension factor ``s``
``original_max_position_embeddings``  pretraining length ``L_orig`` (yarn, llama3, longrope: required)
``max_position_embeddings``         the model's maximum length (dynamic's ``L``; yarn/longrope
                                    derive ``factor = max / L_orig`` when ``factor`` is None)
==================================  ===========================================================

A key the type does not read is a ValueError (:func:`check_scaling_keys`), except the model-level
keys above and :data:`HF_CARRIED_KEYS`.

It returns ``inv_freq`` ``[d_r // 2]`` float32 (angles are ``position * inv_freq``) and
``attention_scale``, a float that multiplies both ``cos`` and ``sin`` (so the logits scale by its
square, as in HF). ``seq_len`` is the current sequence length (``max(position) + 1``); only
``dynamic`` and ``longrope`` read it.

Types (docs/conventions.md §7.5):

* ``default``: ``θ_k = b^(-2k/d_r)``.
* ``linear``: position interpolation, ``θ_k / s``.
* ``ntk``: static NTK-aware base rescale ``b' = b · s^(d_r / (d_r - 2))`` (the formula of
  rotary-embedding-torch's ``theta_rescale_factor``); not an HF type. ``s`` is ``factor`` or, under
  HunYuan's name, ``alpha`` (NTK-alpha: HF HunYuan's ``{"rope_type": "dynamic", "alpha": a}``, which
  its rotary embedding relabels ``ntk_alpha``, reads as this type).
* ``dynamic``: dynamic NTK, ``b' = b · (s·L'/L - (s - 1))^(d_r/(d_r - 2))`` with
  ``L' = max(seq_len, L)`` and ``L`` the larger of the two lengths given; unchanged while
  ``seq_len <= L``.
* ``yarn``: NTK-by-parts ramp between ``θ`` and ``θ/s`` plus ``attention_scale = 0.1 ln s + 1``
  (or the DeepSeek ``mscale`` ratio).
* ``llama3``: Llama 3.1 wavelength bands (keep / smooth / divide by ``s``).
* ``longrope``: per-frequency ``short_factor`` / ``long_factor`` lists chosen by ``seq_len``.
* ``proportional``: p-RoPE (HF ``"proportional"``, Gemma 4 global layers): only the first
  ``p · d/2`` pairs rotate, with the frequencies of the whole head ``b^(-2k/d)``; the other pairs
  get frequency 0 (no rotation); everything divided by ``factor`` (default 1). The table spans the
  whole head, so with half pairing pair ``k`` is channels ``(k, k + d/2)``.

:class:`RopeScaling` carries a type and its options for the RoPE encoding (its ``scaling``:
:mod:`posenc.encodings._scaling_option`). Each type registers,
next to its function, an example configuration (:func:`rope_scaling_example`) that the figures
draw, so a new type appears in them without any other change.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from typing import Any, ClassVar, Literal, get_args

import torch
from torch import Tensor

from ._scaling_config import (  # reading a config: its width, base, factor and lengths
    _base,
    _exponents,
    _factor,
    _factor_or_ratio,
    _inv_freq,
    _length,
    _original_length,
    rotary_width,
)
from .registry import at_least, greater_than

__functional__ = ["rope_scaling_types", "rope_scaled_inv_freq"]

#: The built-in scaling types (``"default"``: none): the one list of them. Each has one registered
#: function below (checked at import) and a :data:`SCALING_OPTIONS` entry; the experiment variants
#: name them. RoPE's ``scaling`` option stays a ``str``: an unknown name is refused by
#: :func:`rope_scaled_inv_freq` with the list of registered types, and a type registered later works.
ScalingType = Literal["default", "linear", "ntk", "dynamic", "yarn", "llama3", "longrope", "proportional"]
SCALING_TYPES: tuple[str, ...] = get_args(ScalingType)

_LENGTHS = ("original_max_position_embeddings", "max_position_embeddings")
#: The options each type reads (HF ``rope_parameters`` names): the one list of them. Their union, in
#: this order, is :attr:`RopeScaling.OPTIONS` (its fields), the keys of :data:`SCALING_OPTION_RANGES`
#: and the flat spec options of RoPE's ``scaling`` (M-RoPE: those of :data:`FIXED_LENGTH_OPTIONS`),
#: gathered into one value by :func:`~posenc.encodings._scaling_option.scaling_group`.
SCALING_OPTIONS: dict[str, tuple[str, ...]] = {
    "default": (),
    "linear": ("factor",),
    "ntk": ("factor", "alpha"),
    "dynamic": ("factor", *_LENGTHS),
    "yarn": (
        "factor",
        *_LENGTHS,
        "beta_fast",
        "beta_slow",
        "mscale",
        "mscale_all_dim",
        "attention_factor",
        "truncate",
    ),
    "llama3": ("factor", *_LENGTHS, "low_freq_factor", "high_freq_factor"),
    "longrope": ("factor", *_LENGTHS, "attention_factor", "short_factor", "long_factor"),
    "proportional": ("factor",),
}

#: Keys every type takes beside its own options: its name (HF's ``rope_type``, legacy ``type``),
#: the base, the rotary width, and what HF keeps on the model config (``head_dim``, the model's
#: ``max_position_embeddings``, which the bridge always passes and only some types read).
MODEL_KEYS: tuple[str, ...] = (
    "rope_type",
    "type",
    "rope_theta",
    "partial_rotary_factor",
    "rotary_dim",
    "head_dim",
    "max_position_embeddings",
)
#: Keys real HF configs carry in ``rope_parameters`` for other parts of the model, which HF's own
#: validation is told to ignore (``ignore_keys_at_rope_validation`` of Qwen2/3-VL, Qwen3-Omni,
#: GLM-4V, Ministral 3, ...): M-RoPE's bands (read by :class:`~posenc.encodings.mrope.MRoPE`) and
#: Ministral 3's query temperature. They do not change the frequencies, so they pass unread; any
#: other key is refused (HF only warns), since a key no one reads (Phi-3.5-MoE's ``short_mscale``,
#: ``short_factor`` on yarn) means the frequencies differ from what the config asks for.
HF_CARRIED_KEYS = frozenset({"mrope_section", "mrope_interleaved", "interleaved", "llama_4_scaling_beta"})


def check_scaling_keys(rope_type: str, config: dict[str, Any]) -> None:
    """ValueError naming the keys of ``config`` (values not None) that ``rope_type`` does not read.

    A type not in :data:`SCALING_OPTIONS` is left to :func:`rope_scaled_inv_freq`, which refuses
    unknown names with the list of types.
    """
    if rope_type not in SCALING_OPTIONS:
        return
    own = SCALING_OPTIONS[rope_type]
    accepted = set(own) | set(MODEL_KEYS) | HF_CARRIED_KEYS
    unknown = sorted(k for k, v in config.items() if v is not None and k not in accepted)
    if unknown:
        elsewhere = [k for k in unknown if k in _ALL_OPTIONS]
        hint = f" ({', '.join(elsewhere)}: an option of another type; check rope_type)" if elsewhere else ""
        raise ValueError(
            f"RoPE scaling {rope_type!r} does not take {', '.join(map(repr, unknown))}{hint}; it takes "
            f"{', '.join(own) or 'no options'}, besides {', '.join(MODEL_KEYS)}"
        )


ScalingFunction = Callable[[dict[str, Any], "int | None"], tuple[Tensor, float]]
#: ``example(original, pairs, factor) -> (options, seq_len)``: a configuration of the type for a
#: model pretrained at ``original`` positions with ``pairs`` rotary pairs, extended by ``factor``,
#: and the sequence length to evaluate it at (None: any; length-dependent types need one).
ScalingExample = Callable[[int, int, float], "tuple[dict[str, Any], int | None]"]

_SCALINGS: dict[str, ScalingFunction] = {}
_EXAMPLES: dict[str, ScalingExample] = {}

#: Types that change their frequencies with the current sequence length.
LENGTH_DEPENDENT = frozenset({"dynamic", "longrope"})


def _union(types: Any) -> tuple[str, ...]:
    return tuple(dict.fromkeys(option for t in types for option in SCALING_OPTIONS[t]))


_ALL_OPTIONS = frozenset(_union(SCALING_TYPES))
#: The options of the types whose frequencies do not depend on the length (M-RoPE takes only these).
FIXED_LENGTH_OPTIONS = _union(t for t in SCALING_TYPES if t not in LENGTH_DEPENDENT)


def _scaling(name: str, *, example: ScalingExample) -> Callable[[ScalingFunction], ScalingFunction]:
    """Register scaling function ``name`` with its ``example`` configuration (for the figures)."""
    if not callable(example):
        raise TypeError(f"RoPE scaling {name!r}: example must be a function (original, pairs, factor)")

    def decorator(fn: ScalingFunction) -> ScalingFunction:
        _SCALINGS[name] = fn
        _EXAMPLES[name] = example
        return fn

    return decorator


def rope_scaling_example(
    rope_type: str, original: int, rotary_dim: int, factor: float
) -> tuple[dict[str, Any], int | None]:
    """The example configuration of ``rope_type`` (an HF ``rope_parameters`` dict) and its sequence length.

    Raises:
        ValueError: unknown type.
    """
    if rope_type not in _EXAMPLES:
        raise ValueError(f"unknown RoPE scaling {rope_type!r}; available: {', '.join(rope_scaling_types())}")
    options, seq_len = _EXAMPLES[rope_type](original, rotary_dim // 2, factor)
    return {"rope_type": rope_type, **options}, seq_len


@dataclass(frozen=True)
class RopeScaling:
    """A RoPE scaling type and its options, named as HF ``rope_parameters`` (None: not given).

    ``type`` is one of :func:`rope_scaling_types`; which options a type reads is documented on its
    function (``yarn_inv_freq``, ...). :meth:`config` gives the dict the scaling functions read.
    """

    type: str = "default"
    factor: float | None = None
    alpha: float | None = None
    original_max_position_embeddings: int | None = None
    max_position_embeddings: int | None = None
    beta_fast: float | None = None
    beta_slow: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool | None = None
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    short_factor: list[float] | None = None
    long_factor: list[float] | None = None

    #: The option names (every field but ``type``): those of :data:`SCALING_OPTIONS`.
    OPTIONS: ClassVar[tuple[str, ...]] = _union(SCALING_TYPES)

    def __post_init__(self) -> None:
        check_scaling_keys(self.type, self.options())

    @classmethod
    def from_options(cls, scaling: str | None, **options: Any) -> RopeScaling:
        """From RoPE's typed options; options left at None are not given.

        Raises:
            ValueError: options given without a scaling type.
        """
        given = {k: v for k, v in options.items() if v is not None}
        if given and scaling in (None, "default"):
            raise ValueError(
                f"rope: option(s) {', '.join(sorted(given))} need a scaling type, e.g. scaling='yarn'"
            )
        return cls(type=scaling or "default", **given)

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> RopeScaling:
        """From an HF-style dict (``rope_type`` or the legacy ``type``).

        Keys the type does not read are a ValueError naming them (:func:`check_scaling_keys`),
        except :data:`MODEL_KEYS` (read elsewhere: base, rotary width) and :data:`HF_CARRIED_KEYS`.
        HunYuan's NTK-alpha (``rope_type`` ``"dynamic"`` or ``"ntk_alpha"`` with an ``alpha``) is the
        ``ntk`` type with that ``alpha``, as HF's ``HunYuanDenseV1RotaryEmbedding`` reads it: its
        checkpoints' other options (``factor`` 1.0, ``beta_fast``, ...) are not read, as in HF.
        """
        rope_type = config.get("rope_type", config.get("type", "default")) or "default"
        if rope_type in _NTK_ALPHA_TYPES and config.get("alpha") is not None:
            return cls(type="ntk", alpha=config["alpha"])
        check_scaling_keys(rope_type, config)
        return cls(type=rope_type, **{k: config[k] for k in cls.OPTIONS if config.get(k) is not None})

    def options(self) -> dict[str, Any]:
        """The options that are given (not None), without the type."""
        return {k: v for k, v in asdict(self).items() if k != "type" and v is not None}

    def config(self) -> dict[str, Any]:
        """The HF-style dict read by :func:`rope_scaled_inv_freq` (without ``head_dim`` and base)."""
        return {"rope_type": self.type, **self.options()}

    @property
    def length_dependent(self) -> bool:
        """Whether the frequencies change with the current sequence length (dynamic, longrope)."""
        return self.type in LENGTH_DEPENDENT


if tuple(f.name for f in fields(RopeScaling) if f.name != "type") != RopeScaling.OPTIONS:
    raise TypeError("RopeScaling's fields must be the options of SCALING_OPTIONS, in their order")

_NON_NEGATIVE = ("mscale", "mscale_all_dim")
#: The documented ranges of the scaling options (HF ``rope_parameters``), declared by every
#: encoding that takes them (RoPE, M-RoPE) in its ``option_ranges``: lengths at least 1, mscales at
#: least 0, ``truncate`` (a bool) none, every other option greater than 0.
SCALING_OPTION_RANGES = {
    option: at_least(1) if option in _LENGTHS else at_least(0) if option in _NON_NEGATIVE else greater_than(0)
    for option in RopeScaling.OPTIONS
    if option != "truncate"
}


def rope_scaling_types() -> list[str]:
    """Names of the RoPE scaling types (``default``, ``linear``, ``ntk``, ``dynamic``, ...)."""
    return sorted(_SCALINGS)


def rope_scaled_inv_freq(config: dict[str, Any], seq_len: int | None = None) -> tuple[Tensor, float]:
    """Dispatch on ``config["rope_type"]`` (or the legacy key ``"type"``; default ``"default"``).

    Raises:
        ValueError: for an unknown type or missing / invalid parameters (the message names them).
    """
    rope_type = config.get("rope_type", config.get("type", "default")) or "default"
    if rope_type not in _SCALINGS:  # every name of SCALING_TYPES registers its function below
        raise ValueError(
            f"unknown RoPE scaling (rope_type) {rope_type!r}; available: {', '.join(rope_scaling_types())}"
        )
    check_scaling_keys(rope_type, config)
    return _SCALINGS[rope_type](config, seq_len)


# ---------------------------------------------------------------------------- shared pieces


# ---------------------------------------------------------------------------- the types


def _common(original: int, factor: float) -> dict[str, Any]:
    return {"factor": factor, "original_max_position_embeddings": original}


def _longrope_example(original: int, pairs: int, factor: float) -> tuple[dict[str, Any], int | None]:
    # LongRoPE's per-pair factors are searched per model; a ramp from 1 to factor stands in for them,
    # shown at the extended length (where long_factor applies).
    ramp = [1.0 + (factor - 1.0) * k / max(pairs - 1, 1) for k in range(pairs)]
    options = {**_common(original, factor), "short_factor": [1.0] * pairs, "long_factor": ramp}
    return options, int(factor * original)


@_scaling("default", example=lambda original, pairs, factor: ({}, None))
def default_inv_freq(config: dict[str, Any], seq_len: int | None = None) -> tuple[Tensor, float]:
    """The paper's frequencies ``θ_k = b^(-2k/d_r)``; attention scale 1."""
    return _inv_freq(_base(config), rotary_width(config)), 1.0


@_scaling("linear", example=lambda original, pairs, factor: ({"factor": factor}, None))
def linear_inv_freq(config: dict[str, Any], seq_len: int | None = None) -> tuple[Tensor, float]:
    """Position interpolation (Chen et al. 2023): ``θ_k / factor``, i.e. positions divided by ``factor``."""
    factor = _factor(config, "linear")
    inv_freq = _inv_freq(_base(config), rotary_width(config))
    return inv_freq / factor, 1.0


@_scaling("ntk", example=lambda original, pairs, factor: ({"factor": factor}, None))
def ntk_inv_freq(config: dict[str, Any], seq_len: int | None = None) -> tuple[Tensor, float]:
    """Static NTK-aware scaling: base ``b · factor^(d_r/(d_r-2))`` (rotary-embedding-torch ``theta_rescale_factor``).

    The exponent makes the lowest frequency exactly ``θ_{last}/factor`` (interpolation) while the
    highest stays ``1`` (extrapolation).
    """
    return _inv_freq(ntk_base(config), rotary_width(config)), 1.0


def ntk_base(config: dict[str, Any]) -> float:
    """The base of static NTK-aware scaling, ``b · s^(d_r/(d_r-2))`` with ``s`` the ``factor`` or
    HunYuan's ``alpha`` (one of them; ``config`` as for :func:`ntk_inv_freq`): what a rotary
    embedding without an ``ntk`` type is given instead."""
    factor = _ntk_factor(config)
    width = rotary_width(config)
    if width <= 2:
        raise ValueError(f"RoPE scaling 'ntk' needs a rotary dimension > 2, got {width}")
    return _base(config) * factor ** (width / (width - 2))


#: The HF ``rope_type`` names under which HunYuan states NTK-alpha (with an ``alpha``).
_NTK_ALPHA_TYPES = ("dynamic", "ntk_alpha")


def _ntk_factor(config: dict[str, Any]) -> float:
    """``s`` of the ntk type: ``factor``, or ``alpha`` (HunYuan's name for it), never both."""
    alpha = config.get("alpha")
    if alpha is None:
        return _factor(config, "ntk")
    if config.get("factor") is not None:
        raise ValueError(
            "RoPE scaling 'ntk': give factor or alpha (HunYuan's name for the same s in base * s^(d/(d-2))), "
            f"not both (factor={config['factor']}, alpha={alpha})"
        )
    value = float(alpha)
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"RoPE scaling 'ntk': alpha must be finite and > 0, got {alpha}")
    return value


@_scaling(
    "dynamic", example=lambda original, pairs, factor: (_common(original, factor), int(factor * original))
)
def dynamic_inv_freq(config: dict[str, Any], seq_len: int | None = None) -> tuple[Tensor, float]:
    """Dynamic NTK: ``b' = b · (s·L'/L - (s-1))^(d_r/(d_r-2))``, ``L' = max(seq_len, L)``.

    ``L`` is the length the model runs unscaled up to: ``max_position_embeddings`` (HF reads the
    model's max length) or ``original_max_position_embeddings``, the larger when both are given. So
    a served length below the trained one (vLLM issue 52665: ``max_position_embeddings`` 512, trained
    2048) never scales, and ``L' >= L`` keeps the bracket at least 1 (vLLM's ``s·512/2048 - (s-1)``
    went negative: a fractional power of a negative base, then nan).
    """
    factor = _factor(config, "dynamic")
    width = rotary_width(config)
    lengths = [_length(config, k, "dynamic") for k in _LENGTHS if config.get(k) is not None]
    if not lengths:
        raise ValueError(
            "RoPE scaling 'dynamic' needs 'original_max_position_embeddings' (the pretraining length)"
        )
    trained = max(lengths)
    length = max(int(seq_len), trained) if seq_len is not None else trained
    base = _base(config) * ((factor * length / trained) - (factor - 1)) ** (width / (width - 2))
    return _inv_freq(base, width), 1.0


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_correction_dim(rotations: float, width: int, base: float, original: int) -> float:
    """The (fractional) pair index whose wavelength is ``original / rotations``."""
    return (width * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))


@_scaling("yarn", example=lambda original, pairs, factor: (_common(original, factor), None))
def yarn_inv_freq(config: dict[str, Any], seq_len: int | None = None) -> tuple[Tensor, float]:
    """YaRN (Peng et al. 2023): ramp from ``θ`` (fast pairs) to ``θ/s`` (slow pairs), scale ``0.1 ln s + 1``.

    Options: ``beta_fast`` (32), ``beta_slow`` (1), ``mscale``/``mscale_all_dim`` (DeepSeek ratio),
    ``attention_factor`` (overrides the scale), ``truncate`` (True: floor/ceil the ramp ends).
    """
    base, width = _base(config), rotary_width(config)
    original = _original_length(config, "yarn")
    factor = _factor_or_ratio(config, "yarn", original)
    if not factor > 0:
        raise ValueError(f"RoPE scaling 'yarn': factor must be > 0, got {factor}")
    attention = config.get("attention_factor")
    if attention is None:
        mscale, mscale_all = config.get("mscale"), config.get("mscale_all_dim")
        if mscale and mscale_all:
            attention = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all)
        else:
            attention = _yarn_mscale(factor)
    beta_fast = config.get("beta_fast") or 32.0
    beta_slow = config.get("beta_slow") or 1.0
    low = _yarn_correction_dim(beta_fast, width, base, original)
    high = _yarn_correction_dim(beta_slow, width, base, original)
    if config.get("truncate", True) is not False:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, width - 1)
    if low == high:
        high += 0.001  # the ramp needs a non-empty interval
    ramp = ((torch.arange(width // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # extrapolation weight: 1 for fast (high-frequency) pairs
    wavelength_factor = base ** _exponents(width)
    extrapolated = 1.0 / wavelength_factor
    interpolated = 1.0 / (factor * wavelength_factor)
    return interpolated * (1 - keep) + extrapolated * keep, float(attention)


@_scaling(
    "llama3",
    example=lambda original, pairs, factor: (
        {**_common(original, factor), "low_freq_factor": 1.0, "high_freq_factor": 4.0},
        None,
    ),
)
def llama3_inv_freq(config: dict[str, Any], seq_len: int | None = None) -> tuple[Tensor, float]:
    """Llama 3.1: keep wavelengths below ``L_orig/high_freq_factor``, divide those above ``L_orig/low_freq_factor`` by ``factor``, blend between."""
    factor = _factor(config, "llama3")
    original = _original_length(config, "llama3")
    for key in ("low_freq_factor", "high_freq_factor"):
        if config.get(key) is None:
            raise ValueError(f"RoPE scaling 'llama3' needs {key!r}")
    low_factor, high_factor = float(config["low_freq_factor"]), float(config["high_freq_factor"])
    if not high_factor > low_factor:
        raise ValueError(
            f"RoPE scaling 'llama3': high_freq_factor ({high_factor}) must exceed low_freq_factor ({low_factor})"
        )
    inv_freq = _inv_freq(_base(config), rotary_width(config))
    wavelength = 2 * math.pi / inv_freq
    long_wave = wavelength > original / low_factor
    short_wave = wavelength < original / high_factor
    scaled = torch.where(long_wave, inv_freq / factor, inv_freq)
    smooth = (original / wavelength - low_factor) / (high_factor - low_factor)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    return torch.where(~short_wave & ~long_wave, blended, scaled), 1.0


@_scaling("longrope", example=_longrope_example)
def longrope_inv_freq(config: dict[str, Any], seq_len: int | None = None) -> tuple[Tensor, float]:
    """LongRoPE (Phi-3): ``θ_k = 1 / (ext_k · b^(2k/d_r))``; ``ext = long_factor`` if ``seq_len > L_orig`` else ``short_factor``."""
    width = rotary_width(config)
    original = _original_length(config, "longrope")
    lists = {}
    for key in ("short_factor", "long_factor"):
        values = config.get(key)
        if values is None or len(values) != width // 2:
            got = "missing" if values is None else f"length {len(values)}"
            raise ValueError(
                f"RoPE scaling 'longrope' needs {key!r} with rotary_dim/2 = {width // 2} values, got {got}"
            )
        lists[key] = values
    factor = _factor_or_ratio(config, "longrope", original)
    attention = config.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    chosen = lists["long_factor"] if seq_len is not None and seq_len > original else lists["short_factor"]
    ext = torch.tensor(chosen, dtype=torch.float32)
    return 1.0 / (ext * _base(config) ** _exponents(width)), float(attention)


def _proportional_example(original: int, pairs: int, factor: float) -> tuple[dict[str, Any], int | None]:
    # Gemma 4's global layers rotate a quarter of the pairs and keep the base frequencies (factor 1).
    return {"partial_rotary_factor": 0.25}, None


def _rotating_pairs(config: dict[str, Any], head_dim: int) -> int:
    """p-RoPE's rotating pairs: ``rotary_dim / 2``, or HF's ``int(partial_rotary_factor · head_dim // 2)``."""
    if config.get("rotary_dim") is not None:
        width = int(config["rotary_dim"])
        if width % 2 or not 0 <= width <= head_dim:
            raise ValueError(
                f"RoPE scaling 'proportional': rotary_dim (the rotating channels) must be even and in "
                f"[0, head_dim={head_dim}], got rotary_dim={width}"
            )
        return width // 2
    proportion = config.get("partial_rotary_factor")
    proportion = 1.0 if proportion is None else float(proportion)
    if not 0.0 <= proportion <= 1.0:
        raise ValueError(
            "RoPE scaling 'proportional': partial_rotary_factor (the rotating fraction of the head) must be "
            f"in [0, 1], got partial_rotary_factor={proportion}"
        )
    return int(proportion * head_dim // 2)


@_scaling("proportional", example=_proportional_example)
def proportional_inv_freq(config: dict[str, Any], seq_len: int | None = None) -> tuple[Tensor, float]:
    """p-RoPE (HF ``"proportional"``): ``θ_k = b^(-2k/d) / s`` for the first ``r`` pairs, ``0`` for the rest.

    ``d`` is the whole head (``head_dim``, not the rotary width), ``r = int(p · d // 2)`` with
    ``p = partial_rotary_factor`` in ``[0, 1]`` (default 1; or ``r = rotary_dim / 2``), ``s =
    factor`` (default 1, must be > 0). Returns ``d/2`` frequencies (the zero ones leave their pairs
    unrotated) and attention scale 1 (docs/conventions.md §7.5.7).
    """
    head_dim = config.get("head_dim")
    if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim <= 0 or head_dim % 2:
        raise ValueError(
            f"RoPE scaling 'proportional': head_dim must be a positive even int, got {head_dim!r}"
        )
    factor = 1.0 if config.get("factor") is None else _factor(config, "proportional")
    rotating = _rotating_pairs(config, head_dim)
    exponents = torch.arange(0, 2 * rotating, 2, dtype=torch.int64).float() / head_dim
    inv_freq = torch.cat((1.0 / (_base(config) ** exponents), torch.zeros(head_dim // 2 - rotating)))
    return inv_freq / factor, 1.0


if not set(_SCALINGS) == set(SCALING_OPTIONS) == set(SCALING_TYPES):
    raise TypeError("every name of SCALING_TYPES needs a registered function and a SCALING_OPTIONS entry")
