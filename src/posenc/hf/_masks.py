"""posenc's entry in HF's ``AttentionMaskInterface``: HF's ``sdpa_mask``, except that a plain sliding
window is passed on as None (the window itself reaches the attention function as ``sliding_window``).

HF builds each layer type's mask once per forward through the mask interface of the model's
``attn_implementation``. For a sliding-window layer, HF's ``sdpa_mask`` materialises a dense bool
``[B, 1, L, L]`` (1 GiB at 32k tokens) even when it is nothing but causal-with-a-window, and the
bridge then had to compare it whole with posenc's structured window before the window backends could
serve it (:func:`posenc.hf._attention._window_mask`). :func:`posenc_mask` skips both: when the
call is a plain prefill window (below), it returns None, and :func:`~posenc.hf.attention_forward`
reads None with a ``sliding_window`` as causal with that window, the rule HF's flash-attention
path applies to the same arguments. Anything else (padding, packed documents, block overlays, a
model's own ``or``/``and`` mask functions, a cache offset, a traced graph) is ``sdpa_mask``'s,
unchanged.

The window is left unbuilt only for a model whose attention calls are known to name their window:
PhiMoE's attention passes no ``sliding_window``, so a None would have reached it as plain causal
(logits 0.12 off HF's sdpa at window 4). :func:`note_window_keyword` records, per HF config object,
whether every attention call of its model so far carried the keyword; until a call has shown it
(a model's first forward), the window is built dense, as ``sdpa_mask`` builds it.

A model whose attention does not go through HF's ``AttentionInterface`` (MPNet: it adds the mask
to its scores itself) gets HF's eager mask (0 where allowed, the dtype's minimum elsewhere): the
form its own arithmetic reads, so it runs exactly as with ``attn_implementation="eager"``, and a
warning says that posenc serves none of its attention (posenc's bool mask added as numbers put its
padded batches 0.13-0.16 off eager). Once :func:`posenc.hf.use_posenc_attention` has replaced such a
model's attention (:func:`note_own_attention_served`), its attention reads a bool mask as one: it gets
``sdpa_mask``'s, as any served model, and no warning.
"""

from __future__ import annotations

import functools
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn


def posenc_mask(*args: Any, **kwargs: Any) -> Tensor | None:
    """HF's ``sdpa_mask(**kwargs)`` (bool ``[B, 1, Tq, Tk]``, True = attend, or None), None for a plain
    sliding window the attention function will be told of (:func:`plain_window`,
    :func:`window_reaches_attention`), or HF's ``eager_mask`` (float ``[B, 1, Tq, Tk]``) for a model
    that adds the mask to its scores itself (:func:`own_attention_model`)."""
    from transformers.masking_utils import eager_mask, sdpa_mask

    warn_right_padded_decoding(kwargs.get("attention_mask"), kwargs.get("q_offset"))
    config = kwargs.get("config")
    own = own_attention_model(type(config)) if config is not None else None
    if own is not None and not own_attention_served(config):
        _warn_own_attention(own)
        return eager_mask(*args, **kwargs)
    if not args and plain_window(kwargs) is not None and window_reaches_attention(config):
        return None
    return sdpa_mask(*args, **kwargs)


def warn_right_padded_decoding(padding: Any, q_offset: Any) -> None:
    """Warn when a cached call (``q_offset > 0``) has a 2-D ``attention_mask [B, Tk]`` whose row holds
    padding after a real token and a real token after it: a right-padded prompt being continued.

    HF's masks keep such a batch's attention right (the pads stay hidden), but each generated token
    follows its row's pads, the first one predicted from a pad's logits: HF PR 48161 refuses or
    warns on it too. Left padding (pads first, then only real tokens) passes, as does right padding
    without a cache (an encoder, a training batch)."""
    if not isinstance(padding, Tensor) or padding.dim() != 2 or padding.shape[-1] < 3:
        return
    if not isinstance(q_offset, int) or q_offset <= 0 or torch.compiler.is_compiling():
        return
    real = padding.bool()
    started = real.cummax(dim=1).values  # True from a row's first real token on
    hole = (started & ~real).any(dim=1) & real[:, -1]  # padding after real tokens, and a new token after it
    if bool(hole.any()):
        rows = hole.nonzero().flatten().tolist()
        warnings.warn(
            f"posenc.hf: cached generation over a right-padded attention_mask (rows {rows} have padding "
            "between their prompt and the new tokens): each new token is predicted after the pads; pad "
            "decoder-only prompts on the left (tokenizer.padding_side = 'left')",
            UserWarning,
            stacklevel=4,
        )


#: Per HF config object (by id; the weak reference tells a reused id from it): whether every posenc
#: attention call of its model so far was handed the ``sliding_window`` keyword.
_WINDOW_NAMED: dict[int, tuple[weakref.ref, bool]] = {}


def note_window_keyword(module: nn.Module, kwargs: dict[str, Any]) -> None:
    """Record whether this attention call of ``module`` (an HF attention layer; its ``config`` is the
    one HF's mask functions get) was handed ``sliding_window`` (None included: a full layer of Gemma 3
    names no window, and says so). One call without it marks the model for good. A traced call
    records nothing (a graph would guard on this state and recompile each time it changes); its
    model's windows are then built by ``sdpa_mask``, as before any call was seen."""
    if torch.compiler.is_compiling():
        return
    config = module.__dict__.get("config")
    if config is None:
        return
    named = "sliding_window" in kwargs
    key = id(config)
    entry = _WINDOW_NAMED.get(key)
    if entry is not None and entry[0]() is config:
        if entry[1] and not named:
            _WINDOW_NAMED[key] = (entry[0], False)
        return
    _WINDOW_NAMED[key] = (weakref.ref(config, _forget(key)), named)


def _forget(key: int) -> Callable[[weakref.ref], None]:
    """The callback dropping a dead config's entry (only its own: the id may be taken again)."""

    def forget(ref: weakref.ref) -> None:
        if _WINDOW_NAMED.get(key, (None,))[0] is ref:
            del _WINDOW_NAMED[key]

    return forget


def window_reaches_attention(config: Any) -> bool:
    """Whether the model of ``config`` hands its attention function the ``sliding_window`` keyword:
    seen on every posenc attention call it made so far, and on at least one (else unknown: False)."""
    if config is None:
        return False
    entry = _WINDOW_NAMED.get(id(config))
    return entry is not None and entry[0]() is config and entry[1]


#: Per HF config object (by id; the weak reference tells a reused id from it): the configs of models
#: whose own attention :func:`posenc.hf.use_posenc_attention` replaced by posenc's (MPNet).
_SERVED: dict[int, weakref.ref] = {}


def note_own_attention_served(config: Any) -> None:
    """Record that the model of ``config`` (a model of :func:`own_attention_model`'s kind) now runs
    posenc's attention, which reads HF's bool masks: :func:`posenc_mask` then builds ``sdpa_mask``'s."""
    key = id(config)

    def forget(ref: weakref.ref) -> None:
        if _SERVED.get(key) is ref:
            del _SERVED[key]

    _SERVED[key] = weakref.ref(config, forget)


def own_attention_served(config: Any) -> bool:
    """Whether :func:`note_own_attention_served` recorded ``config`` (this very object)."""
    ref = _SERVED.get(id(config))
    return ref is not None and ref() is config


#: :func:`own_attention_model`'s answers by config class. A plain dict, not ``functools.cache``: a
#: compiled forward reads it as a guarded constant, where dynamo warns on every cache wrapper it meets.
_OWN_ATTENTION: dict[type, str | None] = {}


def own_attention_model(config_class: type) -> str | None:
    """The name of the HF model class of ``config_class`` when its attention does not go through HF's
    ``AttentionInterface`` (it computes scores and adds the mask itself: MPNet), else None.

    HF's own test decides (``_can_set_attn_implementation``: the model's module calls
    ``ALL_ATTENTION_FUNCTIONS.get_interface``, the check behind its refusal to switch such a model's
    implementation), together with the class's ``_supports_attention_backend`` flag: a model either
    one vouches for is served by posenc. A config class HF's ``AutoModel`` does not map is unknown:
    None, served as before."""
    if config_class not in _OWN_ATTENTION:
        _OWN_ATTENTION[config_class] = _own_attention_model(config_class)
    return _OWN_ATTENTION[config_class]


def _own_attention_model(config_class: type) -> str | None:
    try:
        from transformers.models.auto.modeling_auto import MODEL_MAPPING

        found = MODEL_MAPPING[config_class]
    except (KeyError, ValueError, AttributeError, ImportError):
        return None
    for model_class in found if isinstance(found, (tuple, list)) else (found,):
        can_set = getattr(model_class, "_can_set_attn_implementation", None)
        if getattr(model_class, "_supports_attention_backend", True) or can_set is None or can_set():
            continue
        return model_class.__name__
    return None


@functools.cache
def _warn_own_attention(model_name: str) -> None:
    """Say once per model class that posenc serves none of its attention."""
    warnings.warn(
        f"posenc.hf: {model_name} does not route its attention through HF's AttentionInterface (it adds "
        "the mask to its scores itself), so attn_implementation='posenc' serves none of its attention: it "
        "runs its own eager attention with HF's eager mask, exactly as attn_implementation='eager'; load it "
        "with attn_implementation='eager' to say so",
        UserWarning,
        stacklevel=3,
    )


def plain_window(kwargs: dict[str, Any]) -> int | None:
    """The window ``W`` when the mask HF asks for is exactly causal with the last ``W`` keys over a
    fresh, unpadded sequence (query ``i`` sees keys ``i - W < j <= i``); else None.

    Read off the mask interface's own arguments (transformers 5.21 and 5.24 pass them by keyword; a
    release that passes other ones gets ``sdpa_mask``, as any argument missing here means None):

    * ``local_size`` set: a sliding-window or chunked layer (the two factories that pass it);
    * ``allow_is_causal_skip`` true and ``use_vmap`` false: HF clears them when the model adds an
      ``or``/``and`` mask function, packed documents (``position_ids`` restarting) or block ids, so
      the mask function is the factory's own rule;
    * ``q_offset == kv_offset == 0`` and ``q_length == kv_length``: no cache before these tokens;
    * the 2-D ``attention_mask`` absent or all True: no padding;
    * the mask function equals the window rule on the first ``W + 1`` positions, which tells the
      sliding rule from the chunked one (chunk ``W``: query ``W`` and key ``W - 1`` differ).
    """
    window = kwargs.get("local_size")
    if not isinstance(window, int) or window < 1 or torch.compiler.is_compiling():
        return None
    if kwargs.get("allow_is_causal_skip") is not True or kwargs.get("use_vmap") is not False:
        return None
    q_len, k_len = kwargs.get("q_length"), kwargs.get("kv_length")
    offsets = (kwargs.get("q_offset"), kwargs.get("kv_offset"))
    if not (
        isinstance(q_len, int) and q_len == k_len and all(isinstance(o, int) and o == 0 for o in offsets)
    ):
        return None
    padding = kwargs.get("attention_mask")
    if padding is not None and not (isinstance(padding, Tensor) and bool(padding.all())):
        return None
    rule = kwargs.get("mask_function")
    if rule is None or not _is_window_rule(rule, window, min(q_len, window + 1)):
        return None
    return window


def _is_window_rule(rule: Any, window: int, n: int) -> bool:
    """Whether HF's index-based mask function ``rule`` keeps exactly ``i - window < j <= i`` on the
    first ``n`` queries and keys (called on broadcast indices, as ``sdpa_mask`` calls it)."""
    index = torch.arange(n)
    i, j = index[:, None], index[None, :]
    want = (j <= i) & (j > i - window)
    zero = torch.zeros(1, 1, 1, 1, dtype=torch.long)
    try:
        kept = rule(zero, zero, index[None, None, :, None], index[None, None, None, :])
        return isinstance(kept, Tensor) and bool((kept.expand(1, 1, n, n) == want).all())
    except (TypeError, RuntimeError, IndexError):  # a rule that needs other arguments or devices: not ours
        return False
