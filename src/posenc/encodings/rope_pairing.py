"""Switching a model's RoPE pairing in place, exactly: :func:`switch_rope_pairing_` permutes the q/k
projection rows of every layer built on a :class:`~posenc.encodings.rope.RoPE` (found through
:func:`register_rope_user`, which each layer calls) so that its scores are unchanged under the other
pairing (docs/conventions.md §7.3).
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

from .base import PositionalEncoding
from .rope import Pairing, RoPE, check_pairing, convert_rope_pairing

__all__ = ["register_rope_user", "rope_users", "switch_rope_pairing_"]


# ---------------------------------------------------------------------------- switching a model's pairing

#: The layers built on each encoding (weakly held): an encoding object may serve several layers, and
#: switch_rope_pairing_ must find those outside the module it is given.
_USERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def register_rope_user(encoding: PositionalEncoding, layer: nn.Module) -> None:
    """Record that ``layer`` (an attention layer with ``rotary_encoding()``) is built on ``encoding``.

    Every attention layer calls it at construction and after a copy, whatever its encoding's kind.
    """
    _USERS.setdefault(encoding, weakref.WeakSet()).add(layer)


def rope_users(encoding: PositionalEncoding) -> list[nn.Module]:
    """The live layers whose rotary encoding is ``encoding`` (those since given another one left out)."""
    return [layer for layer in list(_USERS.get(encoding, ())) if layer.rotary_encoding() is encoding]


def _permutes_rope_channels(module: nn.Module) -> bool:
    """A layer whose q/k rows :func:`switch_rope_pairing_` may permute (``MultiheadAttention`` says so)."""
    return bool(getattr(type(module), "permutes_rope_channels", False))


def switch_rope_pairing_(module: nn.Module, pairing: Pairing = "interleaved") -> int:
    """Switch the RoPE of every attention layer in ``module`` to ``pairing``, in place, exactly.

    Half pairing (HF/GPT-NeoX: channel ``k`` with ``k + d_r/2``) and interleaved pairing (the paper,
    Meta's original Llama: ``2k`` with ``2k+1``) are one model up to a permutation of each head's q
    and k channels (docs/conventions.md §7.3). This permutes the output rows of every such layer's
    ``q_proj`` and ``k_proj`` (weights and biases; :func:`convert_rope_pairing`) and switches the
    encoding, so every attention score, and so the layer's output, stays the same up to float
    rounding. Values and the output projection are untouched, except in a K = V layer
    (``value_from_key``), whose values are the permuted keys: its ``out_proj`` input columns are
    permuted the same way, so the output stays the same too.

    Why: the layer rotates its fresh q/k projections in place, and interleaved pairs rotate as one
    complex multiply (one pass; 145% of the time of copying q and k, measured on 2 CPU threads),
    while half pairs take five eager elementwise passes (35%) where the compiled loop of
    :mod:`posenc.kernels.rope_native` does not serve them (it reaches the complex multiply's rate
    on CPU given a C compiler; benchmarks/RESULTS.md). There, a checkpoint in HF's half layout
    runs its rotations faster after one switch. Save it with the encodings' new spec (``pairing`` is in
    :meth:`~posenc.encodings.base.PositionalEncoding.spec`): its weights are now in the interleaved layout.

    Args:
        module: a model, or one :class:`~posenc.MultiheadAttention`.
        pairing: the pairing to switch to.

    Returns:
        How many layers were switched (layers already in ``pairing`` are left alone).

    Raises:
        ValueError: ``pairing`` is not ``"half"`` or ``"interleaved"``; or an encoding to switch also
            serves a module other than a :class:`~posenc.MultiheadAttention` in ``module`` (such as
            :class:`~posenc.layers.mla.MultiLatentAttention`, which keeps HF's half layout), or a layer
            outside ``module`` (one RoPE object passed to two layers, only one of them in
            ``module``): nothing is changed. Layers in ``module`` that share one encoding (a model
            built with one RoPE object) are all switched.
        A :class:`~posenc.KVCache` entry written before the switch is refused afterwards.
    """
    check_pairing(pairing)
    _refuse_hf_swapped(module)
    layers = [
        m
        for m in module.modules()
        if _permutes_rope_channels(m) and isinstance(m.encoding, RoPE) and m.encoding.pairing != pairing
    ]
    encodings = {id(layer.encoding): layer.encoding for layer in layers}
    _refuse_other_users(module, layers, encodings)
    with torch.no_grad():
        for layer in layers:
            _permute_qk_channels_(layer, pairing)
    for enc in encodings.values():
        enc.switch_pairing_(pairing)
    return len(layers)


def _refuse_hf_swapped(module: nn.Module) -> None:
    """An HF attention given posenc's RoPE by ``posenc.hf.swap_encoding`` has HF's projections:
    :func:`posenc.hf.switch_rope_pairing_` switches it, not this function."""
    swapped = [
        name for name, m in module.named_modules() if isinstance(getattr(m, "posenc_encoding", None), RoPE)
    ]
    if swapped:
        raise ValueError(
            f"switch_rope_pairing_: {swapped[0]!r} is an HF attention swapped by posenc.hf.swap_encoding; "
            "use posenc.hf.switch_rope_pairing_(model, pairing). Nothing was changed"
        )


def _refuse_other_users(module: nn.Module, layers: list[nn.Module], encodings: dict[int, RoPE]) -> None:
    """Refuse, before anything changes, an encoding of ``layers`` that also serves a module whose
    channels would not be permuted: another kind of module in ``module``, or a layer outside it."""
    for name, parent in module.named_modules(remove_duplicate=False):
        for child_name, child in parent.named_children():
            if id(child) in encodings and not (_permutes_rope_channels(parent) and child_name == "encoding"):
                where = f"{name}.{child_name}" if name else child_name
                raise ValueError(
                    f"switch_rope_pairing_: the RoPE at {where!r} also serves {type(parent).__name__}, which "
                    "keeps its own channel layout; give the attention layers their own encoding"
                )
    inside = {id(layer) for layer in layers}
    names = {id(m): f"layer {name!r}" if name else "the layer passed" for name, m in module.named_modules()}
    for layer in layers:
        outside = [user for user in rope_users(layer.encoding) if id(user) not in inside]
        if outside:
            raise ValueError(
                f"switch_rope_pairing_: the RoPE of {names[id(layer)]} also serves another layer, "
                f"{outside[0].describe()}, which is not in the module passed, and would rotate its unpermuted q/k with the new "
                "pairing; pass a module that holds every layer using that encoding (the whole model), or "
                "give the layers their own encoding. Nothing was changed"
            )


def _permute_qk_channels_(layer: nn.Module, pairing: Pairing) -> None:
    """Permute ``layer``'s q and k projection rows from its encoding's pairing to ``pairing`` (and,
    K = V, its output projection's input columns), and mark its cached q/k layout stale."""
    enc = layer.encoding
    for proj, heads in ((layer.q_proj, layer.num_heads), (layer.k_proj, layer.num_kv_heads)):
        if proj is None:  # a KV-shared layer: its keys are its donor's, switched with it
            continue
        for param in (proj.weight, proj.bias):
            if param is not None:
                param.copy_(
                    convert_rope_pairing(param, heads, layer.head_dim, enc.pairing, pairing, enc.rotary_dim)
                )
    if getattr(layer, "value_from_key", False):  # K = V: the values' channels moved with the keys'
        columns = convert_rope_pairing(
            layer.out_proj.weight.T, layer.num_heads, layer.head_dim, enc.pairing, pairing, enc.rotary_dim
        )
        layer.out_proj.weight.copy_(columns.T)
    layer.qk_layout += 1
