"""posenc's attention in HF's ``AttentionInterface``: :func:`register` and :func:`attention_forward`."""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from ..backends import get_backend
from ..backends.parts.softcap import check_softcap
from ..backends.run import attend
from ..encodings.base import FiniteMark, Kind, checks_values
from ..kernels.position_ranges import counting_positions
from ..layers import step
from ..masks.attention_mask import AttentionMask
from ._common import BACKEND, NOPE, note_backend, transformers_module
from ._masks import note_window_keyword, posenc_mask
from ._positions import swapped_positions

#: The name posenc's attention is registered under in HF's ``AttentionInterface``.
ATTN_IMPLEMENTATION = "posenc"


def register(backend: str = "auto") -> str:
    """Register posenc's attention in HF transformers as ``attn_implementation="posenc"``.

    Args:
        backend: the posenc backend every call uses (``"auto"``: the dispatcher's choice per call).

    Returns:
        The implementation name to pass to ``from_pretrained(..., attn_implementation=...)`` or
        ``model.set_attn_implementation(...)``.
    """
    if backend != "auto":
        get_backend(backend)  # an unknown name fails here, naming the available ones
    transformers = transformers_module()
    from transformers.masking_utils import AttentionMaskInterface

    BACKEND["name"] = backend
    transformers.AttentionInterface.register(ATTN_IMPLEMENTATION, attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, posenc_mask)
    return ATTN_IMPLEMENTATION


@dataclass
class _CheckedKeys:
    """What a module's last call found finite: its keys' count, batch and last key's fingerprint."""

    mark: FiniteMark
    length: int
    batch: int
    tail: Tensor  # a copy of the last key ``[B, Hkv, 1, D]``: links the next call's keys to these


#: Per HF attention module, the keys its last call checked (weakly held: a dropped model frees them).
_CHECKED: weakref.WeakKeyDictionary[nn.Module, _CheckedKeys] = weakref.WeakKeyDictionary()


def _known_finite_keys(module: nn.Module, key: Tensor, q_len: int) -> tuple[int, FiniteMark | None]:
    """``(known_finite_keys, finite_mark)`` for a call of ``module``: the keys an HF cache handed back
    that the module's previous call already found finite, so the nan check reads the new ones only.

    HF's caches append: a decode step's keys are the last call's keys (possibly reordered by beam
    search, which keeps them finite) followed by the ``q_len`` new ones. The link is accepted only
    when the counts match (``past == the last call's keys``, same batch) and the key at ``past - 1``
    equals the last call's final key (a copy kept of it); anything else (a cropped, sliding, static or
    other cache) checks every key, as before. Like posenc's own cache, it trusts a cache's tensors
    as written by attention: a value written into an HF cache in place elsewhere is not seen.
    """
    if not checks_values() or key.device.type != "cpu":  # only CPU requests test values
        return 0, None
    past = key.shape[2] - q_len
    previous = _CHECKED.get(module)
    known = past if _linked(previous, key, past) else 0
    tail = key.narrow(2, key.shape[2] - 1, 1).clone()
    if previous is None:  # (a new weak reference per call cost a decode step microseconds)
        _CHECKED[module] = _CheckedKeys(FiniteMark(), key.shape[2], key.shape[0], tail)
        return known, _CHECKED[module].mark
    previous.mark.finite = False  # until this call's check finds every key finite
    previous.length, previous.batch, previous.tail = key.shape[2], key.shape[0], tail
    return known, previous.mark


def _linked(previous: _CheckedKeys | None, key: Tensor, past: int) -> bool:
    """Whether the first ``past`` keys of ``key`` are those the module's last call found finite
    (``previous``): as many, for the same batch, dtype and device, and the last of them equal to the
    copy kept of that call's final key."""
    return (
        previous is not None
        and previous.mark.finite
        and past == previous.length
        and past > 0
        and key.shape[0] == previous.batch
        and key.dtype == previous.tail.dtype
        and key.device == previous.tail.device
        and torch.equal(key.narrow(2, past - 1, 1), previous.tail)
    )


def _paged(kwargs: dict[str, Any]) -> bool:
    """Whether HF called with its paged cache (continuous batching): it hands the attention function
    the cache itself (transformers 5.19-5.23) or the read/write indices into it (5.24)."""
    get = kwargs.get
    return (
        get("read_index") is not None
        or get("write_index") is not None
        or get("block_table") is not None
        or type(get("cache")).__name__ == "PagedAttentionCache"
    )


def _check_supported(kwargs: dict[str, Any]) -> None:
    if _paged(kwargs):
        raise ValueError("posenc attention does not serve HF's paged cache (continuous batching)")


def attention_forward(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    s_aux: Tensor | None = None,
    position_bias: Tensor | None = None,
    **kwargs: Any,
) -> tuple[Tensor, Tensor | None]:
    """HF's attention-function signature, served by posenc's backends.

    Shapes: ``query [B, H, Tq, D]``, ``key``/``value [B, Hkv, Tk, D]``; ``attention_mask`` bool or float
    ``[B, 1, Tq, Tk]`` or None; ``s_aux [H]`` attention sinks. Returns ``(out [B, Tq, H, D], weights)``
    with weights ``[B, H, Tq, Tk]`` only when HF asks for them (``output_attentions``).
    ``position_bias [B or 1, H, Tq, Tk]`` (T5's relative bias, trainable): added to the logits.
    ``softcap`` (Gemma 2's ``attn_logit_softcapping``, in ``kwargs``): the logits ``q·k·scaling`` become
    ``softcap * tanh(s / softcap)`` before the mask is added, as HF's eager attention does; the
    dispatcher then picks a backend that caps (sdpa does not).
    """
    note_window_keyword(module, kwargs)  # posenc's mask interface skips a window only if it arrives
    plain = None
    if attention_mask is None and query.shape[2] == 1 and s_aux is None and position_bias is None:
        plain = _plain_call(module, query, key, value, dropout, scaling, kwargs)
        known = step.remembered(module)  # the decode plan HF's full call taught (posenc.layers.step)
        if plain is not None and known is not None and known.key == plain:
            out = _plain_decode(module, query, key, value, scaling)
            if out is not None:
                return out, None
    _check_supported(kwargs)
    q_len = query.shape[2]
    layer_causal = bool(getattr(module, "is_causal", True) if is_causal is None else is_causal)
    causal = layer_causal and attention_mask is None and q_len > 1
    key, value, offset = _causal_keys(module, key, value, q_len, causal)
    window = kwargs.get("sliding_window")
    if position_bias is not None:
        attention_mask = _with_position_bias(attention_mask, position_bias, causal, key.shape[2], window)
        causal = False
    query, key, encoding, q_pos, k_pos = _positions(module, query, key, kwargs.get("position_ids"))
    known, mark = _known_finite_keys(module, key, q_len) if key.shape[2] else (0, None)
    window_mask = (
        _causal_window(window, query, key, offset)
        if causal
        else _window_mask(attention_mask, window, query, key, layer_causal)
    )
    name, out, weights = attend(
        query,
        key,
        value,
        encoding=encoding,
        q_pos=q_pos,
        k_pos=k_pos,
        scale=query.shape[-1] ** -0.5 if scaling is None else float(scaling),
        mask=window_mask,
        causal=causal,
        causal_offset=offset,
        attn_mask=None if window_mask is not None else attention_mask,
        dropout_p=float(dropout),
        need_weights=bool(kwargs.get("output_attentions", False)),
        sinks=s_aux,
        backend=BACKEND["name"],
        known_finite_keys=known,
        finite_mark=mark,
        softcap=_softcap(kwargs.get("softcap")),
    )
    note_backend(name)
    if plain is not None:  # served on sdpa with finite values: the next call of it is plain
        step.remember(module, plain if name == "sdpa" and mark is not None and mark.finite else None)
    return out.transpose(1, 2).contiguous(), weights


def _causal_keys(module: nn.Module, key: Tensor, value: Tensor, q_len: int, causal: bool) -> tuple:
    """``(key, value, causal_offset)`` of a causal call with more keys than queries: Gemma 4's
    KV-shared layers attend the whole sequence from its last queries (HF cut the queries to the last
    ``logits_to_keep`` tokens and left the mask None); any other drops the empty static-cache slots
    after the prompt (HF's sdpa rule)."""
    if not causal or key.shape[2] <= q_len:
        return key, value, 0
    if getattr(module, "is_kv_shared_layer", False):
        return key, value, key.shape[2] - q_len
    return key[:, :, :q_len], value[:, :, :q_len], 0


def _positions(module: nn.Module, query: Tensor, key: Tensor, position_ids: Tensor | None) -> tuple:
    """``(query, key, encoding, q_pos, k_pos)``: HF's positions are already in q and k unless
    ``swap_encoding`` gave the module an encoding of posenc's; a swapped RoPE rotates them here."""
    encoding = _swapped_encoding(module)
    q_len, k_len = query.shape[2], key.shape[2]
    if encoding is None:
        return (
            query,
            key,
            NOPE,
            counting_positions(q_len, query.device),
            counting_positions(k_len, query.device),
        )
    q_pos, k_pos = swapped_positions(module, position_ids, q_len, k_len, query.device)
    if encoding.kind is Kind.ROTARY:
        query, key = encoding.rotate(query, key, q_pos, k_pos)
        encoding = NOPE
    return query, key, encoding, q_pos, k_pos


def _swapped_encoding(module: nn.Module) -> Any:
    """``module.posenc_encoding`` (a submodule, or a plain attribute: T5's bias) or None, without
    ``nn.Module.__getattr__``, whose miss raises and catches an AttributeError on every call."""
    found = module.__dict__.get("posenc_encoding")
    return found if found is not None else module._modules.get("posenc_encoding")


def _plain_call(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    dropout: float,
    scaling: float | None,
    kwargs: dict[str, Any],
) -> tuple | None:
    """The signature (:func:`posenc.layers.step.signature`) of a plain decode call, else None:
    one query on CPU without gradients, HF's positions already in q and k, no mask, bias, sinks,
    soft-cap, window, dropout, weights or paged cache (the caller has checked the query count, the
    mask, the sinks and the bias). Its call fields: the shapes but the key count, the dtypes and the
    scale."""
    if (
        dropout
        or torch.is_grad_enabled()
        or not (query.is_cpu and key.is_cpu and value.is_cpu)
        or BACKEND["name"] != "auto"
        or not checks_values()
        or kwargs.get("softcap") is not None
        or kwargs.get("output_attentions")
        or kwargs.get("sliding_window") is not None
        or _paged(kwargs)
        or _swapped_encoding(module) is not None
    ):
        return None
    k_shape, v_shape = key.shape, value.shape
    if k_shape[2] == 0 or v_shape[2] != k_shape[2]:
        return None
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    if type(scale) is not float:
        return None
    keys = (k_shape[0], k_shape[1], k_shape[3], v_shape[0], v_shape[1], v_shape[3])
    return step.signature((query.shape, *keys, query.dtype, key.dtype, value.dtype, scale))


def _plain_decode(
    module: nn.Module, query: Tensor, key: Tensor, value: Tensor, scaling: float | None
) -> Tensor | None:
    """A plain decode step of a signature the full path served on sdpa: ``out [B, 1, H, D]``.

    It serves only a step linked to the module's last call (:func:`_linked`: that call found its
    keys finite, this one has exactly one more, and the key before it equals the last call's final
    key), tests q and the new key and value for nan (:func:`posenc.layers.step.fresh_finite`),
    and runs sdpa as its backend does (:func:`posenc.layers.step.attend_plain`). Anything else
    returns None, having changed nothing: the full path then links, checks and dispatches as usual
    (a nan goes to a backend that propagates it).
    """
    past = key.shape[2] - 1
    previous = _CHECKED.get(module)
    if not _linked(previous, key, past):
        return None
    new_key = key.narrow(2, past, 1)
    finite, block = step.fresh_finite(query, new_key, value.narrow(2, past, 1))
    if not finite:
        return None
    # The new last key, from the block (a copy of it that nobody else holds): the next call's link.
    tail = new_key.clone() if block is None else block.narrow(1, query.shape[1], key.shape[1])
    previous.length, previous.tail = past + 1, tail
    out = step.attend_plain(query, key, value, query.shape[-1] ** -0.5 if scaling is None else scaling)
    note_backend("sdpa")
    return out.transpose(1, 2).contiguous()


def _softcap(softcap: object) -> float | None:
    """HF's ``softcap`` checked as the model's ``attn_logit_softcapping`` (a cap that is not finite and
    > 0 is an error naming it); None when the model caps nothing."""
    try:
        return check_softcap(softcap)
    except ValueError as error:
        raise ValueError(f"attn_logit_softcapping (HF's softcap): {error}") from None


def _causal_window(window: int | None, query: Tensor, key: Tensor, offset: int) -> AttentionMask | None:
    """A causal call with no mask in a layer that names its window (``sliding_window``): posenc's
    structured causal window at ``offset``, as HF's flash attention reads the same arguments; None
    when the window hides no key (no query sees more than ``window`` keys: plain causal, as before).

    HF hands such a layer None in two cases: its ``sdpa_mask`` skipped a window that hides nothing,
    or posenc's mask interface (:func:`posenc.hf._masks.posenc_mask`) passed a plain sliding window
    on without building it (only for a model whose calls were seen to carry ``sliding_window``:
    :func:`posenc.hf._masks.note_window_keyword`).
    """
    q_len, k_len = query.shape[2], key.shape[2]
    if window is None or offset + q_len <= int(window):
        return None
    return AttentionMask.build(
        q_len=q_len,
        k_len=k_len,
        batch=query.shape[0],
        heads=query.shape[1],
        device=query.device,
        causal=True,
        causal_offset=offset,
        window=int(window),
    )


def _window_mask(
    attention_mask: Tensor | None, window: int | None, query: Tensor, key: Tensor, causal: bool = True
) -> AttentionMask | None:
    """HF's mask of a sliding-window layer as posenc's structured mask (at the cache offset: causal
    with the last ``window`` keys, or for a non-causal layer the band ``|i - j| < W``), when the dense
    mask HF built is exactly that; else None (the dense mask is used as it is, exact but without the
    window backends' skipping).

    HF names the window of the layer it calls (``sliding_window``: Gemma 2/3, Mistral, Qwen2, ...). A
    causal layer's mask keeps key ``j`` for query ``i`` iff ``j > i + offset - window``, the rule of
    :class:`~posenc.masks.attention_mask.SlidingWindowMask`. A bidirectional layer's keyword is counted two ways
    (docs/conventions.md §1.7): ModernBERT and EmbeddingGemma hand it ``W`` (their masks keep
    ``|i - j| < W``), T5Gemma's encoder ``W - 1`` (its mask keeps ``|i - j| <= W - 1``), so both are
    tried. The dense mask is compared with the structured one whole (an O(Tq*Tk) comparison, as
    cheap as HF's own construction of it), so padding, packed sequences or a window HF applies
    differently keep the dense mask: nothing is assumed.
    """
    if window is None or attention_mask is None or attention_mask.dtype != torch.bool:
        return None  # (a float mask may carry values: T5's position bias, a user's additive mask)
    if attention_mask.dim() != 4 or torch.compiler.is_compiling():  # (a compiled graph reads no values)
        return None
    batch, heads, q_len, k_len = query.shape[0], query.shape[1], query.shape[2], key.shape[2]
    if attention_mask.shape[-2:] != (q_len, k_len):
        return None
    for candidate in (int(window),) if causal else (int(window), int(window) + 1):
        mask = AttentionMask.build(
            q_len=q_len,
            k_len=k_len,
            batch=batch,
            heads=heads,
            device=query.device,
            causal=causal,
            causal_offset=k_len - q_len,
            window=candidate,
        )
        if _equals_dense(mask, attention_mask):
            return mask
    return None


def _equals_dense(mask: AttentionMask, allowed: Tensor) -> bool:
    """Whether ``mask`` allows exactly what HF's bool ``allowed [B|1, 1, Tq, Tk]`` allows."""
    dense = mask.dense()
    if dense is None:
        dense = torch.ones(1, 1, mask.q_len, mask.k_len, dtype=torch.bool, device=allowed.device)
    return bool((allowed == dense).all())


def _with_position_bias(
    mask: Tensor | None, bias: Tensor, causal: bool, k_len: int, window: int | None = None
) -> Tensor:
    """One float mask: ``bias`` where ``mask`` (bool, True = attend; or float, added) lets a key through,
    ``-inf`` elsewhere (posenc's mask module turns those into hidden keys, as a bool mask would).
    ``causal`` (HF passed no mask): causal, with the last ``window`` keys when the layer names one
    (a plain sliding window that posenc's mask interface left unbuilt: Inkling's local layers)."""
    bias = bias[..., :k_len]
    if causal:
        q_len = bias.shape[-2]
        ones = torch.ones(q_len, k_len, dtype=torch.bool, device=bias.device)
        mask = ones.tril()
        if window is not None:
            mask &= ~ones.tril(-int(window))
        mask = mask[None, None]
    if mask is None:
        return bias
    if mask.dtype == torch.bool:
        return bias.masked_fill(~mask, float("-inf"))
    return bias + mask
