"""Per-layer attention recipes: which encoding, window, chunk, sinks and query temperature each layer
of a model gets, and named presets that reproduce published layouts.

A recipe is a list of :class:`LayerSpec`, one per layer. :func:`layer_pattern` expands a preset
string such as ``"gemma3"`` or ``"gemma3:window=16,global_every=3"`` for a given number of layers.
The presets follow the layer layouts of the HF transformers configurations:

=========  ===================================================================================
preset     layers
=========  ===================================================================================
gemma3     5 local : 1 global. Local: sliding ``window`` (Gemma 3: 1024), RoPE base 1e4; every
           ``global_every``-th layer (``(i + 1) % 6 == 0``) global, RoPE base 1e6.
llama4     3 chunked RoPE layers : 1 global NoPE layer (``(i + 1) % 4 == 0``), chunk 8192, RoPE
           base 5e5; the NoPE layers scale their queries by the attention temperature
           ``log1p(floor((pos + 1) / floor_scale)) * attn_scale + 1`` (floor_scale 8192, 0.1).
smollm3    RoPE (base 2e6) everywhere except every 4th layer (``(i + 1) % 4 == 0``), which is NoPE.
gpt-oss    alternating sliding window (even layers, window 128) and full attention, learned
           attention sinks in every layer.
cohere2    3 sliding : 1 full (``(i + 1) % 4 == 0``). Sliding: window 4096, RoPE base 1e4 with
           interleaved pairing; full layers NoPE (Command R7B / Command A).
gemma4     5 local : 1 global, the last layer always global. Local: window 512, RoPE base 1e4;
           global: p-RoPE (HF ``"proportional"``), base 1e6, a quarter of the pairs rotating;
           options: the last N layers KV-shared, the global layers' head size and KV heads,
           K = V on the global layers.
granite-   1 full : 3 sliding (``i % 4 == 0`` full, the first layer included), window 128, RoPE
swa        base 1e4 (``full_base=0`` / ``sliding_base=0``: NoPE, HF's ``layer_rope_theta`` 0),
           learned attention sinks in every layer (Granite SWA / "granite-swash").
olmo3      3 sliding : 1 full (``(i + 1) % 4 == 0``), window 4096, RoPE base 5e5 in both.
mistral-   3 LeRoPE layers : 1 NoPE layer (``(i + 1) % 4 == 0``, HF ``no_rope_layers``); YaRN
large4     (factor 2048 over 512 tokens, attention factor 1) with learned frequencies
           ``exp(alpha)``, interleaved pairs; every layer scales its queries by the learned
           ``s_h · ln(p + 1) + b_h`` (:class:`LogPositionQueryScaling`).
swan       SWAN-GPT (Puvvada et al. 2025): each block of ``nope_every`` (4) layers is one global
           NoPE layer followed by sliding-window RoPE layers (window 512, RoPE base 1e4);
           ``log_base=a``: its NoPE layers' query scale ``log_a(p + a)`` (inference).
=========  ===================================================================================

Parts of these models that posenc does not build are left out and named in each preset's
docstring (Gemma 4's q/k/v norms, Granite's multipliers).

Sizes (window, chunk) default to the published ones; CPU-scale experiments pass smaller ones.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from ..encodings.spec import parse_spec
from .temperature import (  # the query temperature forms a LayerSpec names, re-exported
    LearnedLogTemperature,
    LogPositionQueryScaling,
    LogQueryTemperature,
    QueryTemperature,
    TemperatureForm,
)

__all__ = [
    "LAYER_PRESETS",
    "LayerSpec",
    "LearnedLogTemperature",
    "LogPositionQueryScaling",
    "LogQueryTemperature",
    "QueryTemperature",
    "TemperatureForm",
    "available_layer_presets",
    "is_layer_preset",
    "layer_pattern",
    "mark_kv_shared",
]


@dataclass(frozen=True)
class LayerSpec:
    """What one attention layer of a model gets (see :class:`posenc.MultiheadAttention`)."""

    encoding: str = "nope"
    window: int | None = None
    chunk: int | None = None
    sinks: bool = False
    temperature: TemperatureForm | None = None
    #: Logit soft-capping (Gemma 2): ``softcap * tanh(s / softcap)`` on the layer's logits, or None.
    softcap: float | None = None
    #: KV-shared (Gemma 4's ``num_kv_shared_layers``): the layer computes no keys or values and attends
    #: with those of the last unshared layer before it of its type (:mod:`posenc.layers.kv_sharing`); a
    #: model's option, which a lone :class:`~posenc.MultiheadAttention` refuses.
    kv_shared: bool = False
    #: The layer's head size and key/value heads when they differ from the model's (Gemma 4's global
    #: layers: HF ``global_head_dim``, ``num_global_key_value_heads``); None: the model's. Sizes, which
    #: the model passes to the layer as ``head_dim=`` and ``num_kv_heads=``.
    head_dim: int | None = None
    num_kv_heads: int | None = None
    #: K = V (Gemma 4's global layers, HF ``attention_k_eq_v``): the values are the key projection
    #: before the encoding acts, and the layer has no ``v_proj`` (``MultiheadAttention(value_from_key=True)``).
    value_from_key: bool = False


def mark_kv_shared(layers: Sequence[LayerSpec], kv_shared_layers: int) -> list[LayerSpec]:
    """``layers`` with the last ``kv_shared_layers`` marked ``kv_shared`` (HF ``num_kv_shared_layers``)."""
    count = len(layers)
    if isinstance(kv_shared_layers, bool) or not isinstance(kv_shared_layers, int):
        raise ValueError(f"kv_shared_layers must be an int, got {kv_shared_layers!r}")
    if not 0 <= kv_shared_layers < count:
        raise ValueError(
            f"kv_shared_layers must be in [0, num_layers={count}) (at least one layer computes its own "
            f"keys and values), got {kv_shared_layers}"
        )
    if kv_shared_layers and any(layer.kv_shared for layer in layers):
        raise ValueError(
            "kv_shared_layers: the pattern already marks layers kv_shared (e.g. 'gemma4:kv_shared_layers=N'); "
            "give the count once"
        )
    first = count - kv_shared_layers
    return [replace(layer, kv_shared=True) if i >= first else layer for i, layer in enumerate(layers)]


#: Layer presets by name: ``fn(num_layers, **options) -> [LayerSpec per layer]`` (the recipes of
#: published models, ``"gemma3:window=8"``); the paper setups of ``posenc extrapolate --preset``
#: are :data:`posenc.experiments.presets.PAPER_PRESETS`.
LAYER_PRESETS: dict[str, Callable[..., list[LayerSpec]]] = {}


def _layer_preset(name: str):
    def decorator(fn: Callable[..., list[LayerSpec]]) -> Callable[..., list[LayerSpec]]:
        LAYER_PRESETS[name] = fn
        return fn

    return decorator


@_layer_preset("gemma3")
def gemma3(
    num_layers: int,
    window: int = 1024,
    global_every: int = 6,
    local_base: float = 10_000.0,
    global_base: float = 1_000_000.0,
) -> list[LayerSpec]:
    """Gemma 3: local sliding-window layers with a small RoPE base, every ``global_every``-th global."""
    return [
        LayerSpec(f"rope:base={global_base}")
        if (i + 1) % global_every == 0
        else LayerSpec(f"rope:base={local_base}", window=window)
        for i in range(num_layers)
    ]


@_layer_preset("llama4")
def llama4(
    num_layers: int,
    chunk: int = 8192,
    nope_every: int = 4,
    base: float = 500_000.0,
    floor_scale: float = 8192.0,
    attn_scale: float = 0.1,
) -> list[LayerSpec]:
    """Llama 4: chunked RoPE layers, every ``nope_every``-th a global NoPE layer with query temperature."""
    temperature = QueryTemperature(floor_scale, attn_scale)
    return [
        LayerSpec("nope", temperature=temperature)
        if (i + 1) % nope_every == 0
        else LayerSpec(f"rope:base={base}", chunk=chunk)
        for i in range(num_layers)
    ]


@_layer_preset("smollm3")
def smollm3(num_layers: int, nope_every: int = 4, base: float = 2_000_000.0) -> list[LayerSpec]:
    """SmolLM3: RoPE layers, every ``nope_every``-th layer NoPE."""
    return [
        LayerSpec("nope") if (i + 1) % nope_every == 0 else LayerSpec(f"rope:base={base}")
        for i in range(num_layers)
    ]


@_layer_preset("gpt-oss")
def gpt_oss(num_layers: int, window: int = 128, base: float = 150_000.0) -> list[LayerSpec]:
    """gpt-oss: sliding-window and full layers alternating, attention sinks everywhere."""
    return [
        LayerSpec(f"rope:base={base}", window=window if i % 2 == 0 else None, sinks=True)
        for i in range(num_layers)
    ]


@_layer_preset("cohere2")
def cohere2(
    num_layers: int, window: int = 4096, full_every: int = 4, base: float = 10_000.0
) -> list[LayerSpec]:
    """Cohere 2 (Command R7B, Command A): sliding-window RoPE layers, every ``full_every``-th layer
    full attention without positions (NoPE).

    As HF ``Cohere2Config``: ``layer_types`` (``sliding_window_pattern`` 4), ``sliding_window``
    4096 and ``rope_theta`` 1e4 (the released checkpoints set their own theta: pass ``base``);
    Cohere rotates interleaved pairs ``(2k, 2k + 1)`` (HF ``Cohere2RotaryEmbedding``), so the
    sliding layers use ``pairing=interleaved``. Not in the recipe: Cohere's parallel attention/MLP
    block and its logit scale (the model around the layers is posenc's).
    """
    return [
        LayerSpec("nope")
        if (i + 1) % full_every == 0
        else LayerSpec(f"rope:base={base},pairing=interleaved", window=window)
        for i in range(num_layers)
    ]


@_layer_preset("gemma4")
def gemma4(
    num_layers: int,
    window: int = 512,
    global_every: int = 6,
    local_base: float = 10_000.0,
    global_base: float = 1_000_000.0,
    global_rotating: float = 0.25,
    kv_shared_layers: int = 0,
    global_head_dim: int = 0,
    global_kv_heads: int = 0,
    k_eq_v: bool = False,
) -> list[LayerSpec]:
    """Gemma 4: local sliding-window RoPE layers, every ``global_every``-th layer and always the
    last one global with p-RoPE (only ``global_rotating`` of the pairs rotate, at the frequencies
    of the whole head).

    Exact, as HF ``Gemma4TextConfig``: ``layer_types`` (5:1, the last layer forced to
    ``full_attention``), ``sliding_window`` 512, ``rope_parameters`` per layer type (local:
    ``default``, theta 1e4; global: ``proportional``, theta 1e6, ``partial_rotary_factor``
    0.25).

    Options for the rest of HF's attention layout (each off by default, so the recipe's layers
    have the model's sizes):

    * ``kv_shared_layers=N`` (HF ``num_kv_shared_layers``): the last ``N`` layers are KV-shared
      (:attr:`LayerSpec.kv_shared`): each attends with the keys and values of the last unshared
      layer of its type, as HF's ``kv_sharing_modes`` picks it (:mod:`posenc.layers.kv_sharing`).
    * ``global_head_dim=D`` (HF ``global_head_dim``; the released models: 512 against a
      ``head_dim`` of 256): the global layers' head size (``LayerSpec.head_dim``), their p-RoPE
      built for it. 0: the model's.
    * ``global_kv_heads=K`` (HF ``num_global_key_value_heads``, which HF applies only with
      ``attention_k_eq_v``): the global layers' key/value heads. 0: the model's.
    * ``k_eq_v=true`` (HF ``attention_k_eq_v``, default False as in HF's config): K = V on the
      global layers (``LayerSpec.value_from_key``): their values are the key projection before
      RoPE, and they have no ``v_proj``; the sliding layers keep theirs, as in HF's
      ``Gemma4TextAttention`` (``attention_k_eq_v and not is_sliding``).

    Not in the recipe: the q/k/v norms (HF normalises the values, K = V's included, with a
    scale-free RMS norm) and attention scale 1; per-layer input embeddings (PLE).
    """
    if not isinstance(k_eq_v, bool):
        raise ValueError(f"gemma4: k_eq_v must be True or False (HF attention_k_eq_v), got {k_eq_v!r}")
    wide = {"head_dim": global_head_dim or None, "num_kv_heads": global_kv_heads or None}
    layers = [
        LayerSpec(
            f"rope:base={global_base},scaling=proportional,partial_rotary_factor={global_rotating}",
            value_from_key=k_eq_v,
            **wide,
        )
        if (i + 1) % global_every == 0 or i == num_layers - 1
        else LayerSpec(f"rope:base={local_base}", window=window)
        for i in range(num_layers)
    ]
    return mark_kv_shared(layers, kv_shared_layers)


@_layer_preset("granite-swa")
def granite_swa(
    num_layers: int,
    window: int = 128,
    full_every: int = 4,
    sliding_base: float = 10_000.0,
    full_base: float = 10_000.0,
) -> list[LayerSpec]:
    """Granite SWA ("granite-swash"): the first of every ``full_every`` layers full attention, the
    others a sliding window; learned attention sinks (one logit per head) in every layer.

    As HF ``GraniteSWAConfig``: ``layer_types`` (``i % 4 == 0`` full), ``sliding_window`` 128,
    ``layer_rope_theta`` (default ``rope_theta`` 1e4 everywhere; a base of 0 is NoPE, as HF's
    ``layer_rope_theta`` entry 0), the per-head ``sinks`` of ``GraniteSWAAttention``.
    Approximated: Granite's ``attention_multiplier`` (HF scales scores by it, default 1, instead of
    ``1/sqrt(head_dim)``) and its embedding, residual and logit multipliers, which are the model's,
    not the layer's.
    """

    def encoding(base: float) -> str:
        return f"rope:base={base}" if base else "nope"

    return [
        LayerSpec(encoding(full_base), sinks=True)
        if i % full_every == 0
        else LayerSpec(encoding(sliding_base), window=window, sinks=True)
        for i in range(num_layers)
    ]


@_layer_preset("olmo3")
def olmo3(
    num_layers: int,
    window: int = 4096,
    full_every: int = 4,
    sliding_base: float = 500_000.0,
    full_base: float = 500_000.0,
) -> list[LayerSpec]:
    """OLMo 3: sliding-window RoPE layers, every ``full_every``-th layer full attention.

    As HF ``Olmo3Config``: ``layer_types`` (``(i + 1) % 4 == 0`` full), ``sliding_window`` 4096,
    ``rope_parameters`` per layer type (theta 5e5 in both). HF applies a ``rope_scaling`` (the
    long-context checkpoints' YaRN) to the full layers only: give such a model a list of
    :class:`LayerSpec` with the scaled spec on those layers. Not in the recipe: OLMo's q/k norms.
    """
    return [
        LayerSpec(f"rope:base={full_base}")
        if (i + 1) % full_every == 0
        else LayerSpec(f"rope:base={sliding_base}", window=window)
        for i in range(num_layers)
    ]


@_layer_preset("mistral-large4")
def mistral_large4(
    num_layers: int,
    nope_every: int = 4,
    base: float = 10_000.0,
    factor: float = 2048.0,
    original_max_position_embeddings: int = 512,
    beta_fast: float = 32.0,
    beta_slow: float = 1.0,
) -> list[LayerSpec]:
    """Mistral Large 4 (HF ``MistralLarge4TextConfig``): LeRoPE layers, every ``nope_every``-th NoPE,
    a learned log-position query temperature on every layer.

    As HF: ``no_rope_layers`` (``int((i + 1) % no_rope_layer_interval != 0)``, interval 4: layers 3,
    7, 11, ... are NoPE); the default ``rope_parameters`` (yarn, ``rope_theta`` 1e4, ``factor`` 2048,
    ``original_max_position_embeddings`` 512, ``beta_fast`` 32, ``beta_slow`` 1,
    ``attention_factor`` 1) with LeRoPE's learned ``alpha`` (``rope:learned_frequencies=true``,
    applied after YaRN, as ``MistralLarge4TextRotaryEmbedding``); interleaved pairs ``(2k, 2k + 1)``
    (HF ``apply_rotary_pos_emb_interleave``, which writes the rotated pairs out as halves: the same
    logits); ``MistralLarge4TextSoftmaxScaling`` on every layer, RoPE and NoPE
    (:class:`LearnedLogTemperature`).

    Approximated: posenc's :class:`~posenc.MultiheadAttention` layers stand for HF's multi-head latent
    attention (for MLA itself: :class:`~posenc.layers.mla.MultiLatentAttention` with
    ``rope="rope:...,learned_frequencies=true"`` and ``query_temperature=LearnedLogTemperature()``,
    ``q_lora_rank=None``); each RoPE layer has its own ``alpha``, where HF shares one per model (load
    HF's into each: :func:`posenc.encodings.rope.load_lerope_alpha_`); YaRN's ``mscale_all_dim``
    softmax factor is not set by HF's default config and so not here. Not in the recipe: the DSA
    indexer (top-k sparse attention), MoE, KV sharing across layers, the final logit soft-cap and
    the vision tower.
    """
    rope = (
        f"rope:base={base},pairing=interleaved,scaling=yarn,factor={factor},"
        f"original_max_position_embeddings={original_max_position_embeddings},beta_fast={beta_fast},"
        f"beta_slow={beta_slow},attention_factor=1.0,learned_frequencies=true"
    )
    temperature = LearnedLogTemperature()
    return [
        LayerSpec("nope" if (i + 1) % nope_every == 0 else rope, temperature=temperature)
        for i in range(num_layers)
    ]


@_layer_preset("swan")
def swan(
    num_layers: int, window: int = 512, nope_every: int = 4, base: float = 10_000.0, log_base: float = 0.0
) -> list[LayerSpec]:
    """SWAN-GPT (Puvvada et al. 2025, "SWAN-GPT: An Efficient and Scalable Approach for
    Long-Context Language Modeling"): NoPE layers with global attention interleaved with
    sliding-window RoPE layers (SWA-RoPE); each block of ``nope_every`` layers starts with the
    NoPE layer (the paper's 1 NoPE : 3 SWA-RoPE, window 512).

    ``log_base=a`` (> 1; default 0, off): the dynamic attention scaling SWAN applies at inference to
    its NoPE layers, queries at position ``p`` times ``log_a(p + a)``
    (:meth:`LogQueryTemperature.swan`; ``a`` is tuned after training). Train without it and
    build the evaluation model with it (or set ``layer.attn.query_temperature``). The formula is
    taken from a later paper's restatement (arXiv 2601.22156, Eq. 11): the SWAN paper's own text was
    not reachable, so its exact position count (0- or 1-based) is unconfirmed (docs/conventions.md §11.2).
    No HF configuration exists: the test writes the paper's layout out.
    """
    temperature = LogQueryTemperature.swan(log_base) if log_base else None
    return [
        LayerSpec("nope", temperature=temperature)
        if i % nope_every == 0
        else LayerSpec(f"rope:base={base}", window=window)
        for i in range(num_layers)
    ]


def available_layer_presets() -> list[str]:
    return sorted(LAYER_PRESETS)


def is_layer_preset(spec: object) -> bool:
    """True when ``spec`` is a preset string (``"gemma3"`` or ``"gemma3:window=16"``)."""
    return isinstance(spec, str) and parse_spec(spec)[0] in LAYER_PRESETS


def _parse_bool(text: str) -> bool:
    """A bool option's text (``true``/``false``, ``1``/``0``, ``yes``/``no``, as encoding specs read
    them); anything else raises ``ValueError`` (``bool("false")`` would be True)."""
    truth = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}
    if text.lower() not in truth:
        raise ValueError(text)
    return truth[text.lower()]


def layer_pattern(spec: str, num_layers: int) -> list[LayerSpec]:
    """The layers of preset ``spec`` (``"name"`` or ``"name:option=value,..."``) for ``num_layers``.

    Raises ``ValueError`` naming an unknown preset or option, or a value of the wrong type.
    """
    name, raw = parse_spec(spec)
    if name not in LAYER_PRESETS:
        raise ValueError(f"unknown layer preset {name!r}; available: {', '.join(available_layer_presets())}")
    fn = LAYER_PRESETS[name]
    params = {k: p for k, p in inspect.signature(fn).parameters.items() if k != "num_layers"}
    options: dict[str, object] = {}
    for key, text in raw.items():
        if key not in params:
            raise ValueError(f"layer preset {name!r}: unknown option {key!r}; options: {', '.join(params)}")
        kind = type(params[key].default)
        try:
            value = _parse_bool(text) if kind is bool else kind(text)
        except ValueError:
            expected = "true or false" if kind is bool else kind.__name__
            raise ValueError(
                f"layer preset {name!r}: option {key!r} must be {expected}, got {text!r}"
            ) from None
        if kind is int and value <= 0:
            raise ValueError(f"layer preset {name!r}: option {key!r} must be positive, got {value}")
        options[key] = value
    return fn(num_layers, **options)
