"""The channel permutation of :func:`posenc.hf.switch_rope_pairing_`, applied to one HF attention module.

Switching RoPE's pairing renames the q and k channels of every head (docs/conventions.md §7.3). For
the logits to stay the same, everything that indexes those channels before the rotation must be
permuted with them:

* ``q_proj`` and ``k_proj``: their output rows (weights and biases);
* ``q_norm`` and ``k_norm`` (Qwen3, Gemma 3 and 4, OLMo 2, Cohere): their per-channel weights and
  biases, of ``[D]`` (one head's channels, shared by every head), ``[heads * D]`` (OLMo 2 norms the
  whole projection) or ``[heads, D]`` (Cohere); the statistics they normalise by are sums over
  channels, which a permutation leaves alone.

A module whose values are its keys (Gemma 4's K = V, ``attention_k_eq_v``) is refused: its value
channels would move with the key rows. So is any parameter the module holds besides these (a
per-channel weight this function does not know would be left in the old layout, and the logits
would change silently); each refusal names what it found.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import Tensor, nn

from ..encodings.rope import RoPE, convert_rope_pairing

#: Submodules whose parameters this module permutes, or which never see the q/k channels.
_NORMS = {"q_proj": "q_norm", "k_proj": "k_norm"}
_PROJECTIONS = tuple(_NORMS)
_UNTOUCHED = ("v_proj", "v_norm", "posenc_encoding", "rotary_emb")


def permute_attention_channels(attention: nn.Module, encoding: RoPE, pairing: str) -> None:
    """Permute ``attention``'s q/k channels (and what reads them) from ``encoding.pairing`` to
    ``pairing``, in place, once :func:`check_permutable` passed it (the caller checks every module
    before changing any); the caller switches the encoding afterwards."""
    convert = partial(
        convert_rope_pairing,
        head_dim=encoding.head_dim,
        src=encoding.pairing,
        dst=pairing,
        rotary_dim=encoding.rotary_dim,
    )
    with torch.no_grad():
        for name in _PROJECTIONS:
            projection = getattr(attention, name, None)
            if projection is None:  # Gemma 4's KV-shared layers: the donor's keys are switched there
                continue
            heads = projection.out_features // encoding.head_dim
            for param in (projection.weight, projection.bias):
                if param is not None:
                    param.copy_(convert(param, heads))
            norm = getattr(attention, _NORMS[name], None)
            if norm is not None:
                for param in norm.parameters():
                    param.copy_(_converted_norm_param(convert, param, heads, encoding.head_dim))


def values_are_keys(attention: nn.Module) -> bool:
    """Whether the module's values are its key projection (K = V): Gemma 4 names it
    ``use_alternative_attention``; a module built without a ``v_proj`` says it too."""
    if getattr(attention, "use_alternative_attention", False):
        return True
    return "v_proj" in attention._modules and attention._modules["v_proj"] is None


def check_permutable(attention: nn.Module, encoding: RoPE) -> None:
    """Refuse a module whose values are its keys, or that holds a parameter outside the known q/k/v/o
    projections and q/k/v norms."""
    if values_are_keys(attention):
        raise ValueError(
            f"switch_rope_pairing_: {type(attention).__name__} takes its values from the key projection "
            "(K = V): the switch would permute the value channels too; keep this model's pairing"
        )
    known = set(_PROJECTIONS) | set(_NORMS.values()) | set(_UNTOUCHED) | {"o_proj"}
    for name, child in attention.named_children():
        if name not in known and any(True for _ in child.parameters()):
            raise ValueError(_unknown(attention, f"submodule {name!r} ({type(child).__name__})"))
    for projection_name, norm_name in _NORMS.items():
        projection, norm = getattr(attention, projection_name, None), getattr(attention, norm_name, None)
        if projection is not None and norm is not None:
            heads = projection.out_features // encoding.head_dim
            for param_name, param in norm.named_parameters():
                if param.numel() not in (encoding.head_dim, heads * encoding.head_dim):
                    raise ValueError(
                        f"switch_rope_pairing_: {norm_name}.{param_name} has shape {list(param.shape)}, neither "
                        f"one head's channels [{encoding.head_dim}] nor every head's [{heads * encoding.head_dim}]; "
                        "its channels cannot be permuted with the rotation"
                    )
    heads = attention.o_proj.in_features // encoding.head_dim if hasattr(attention, "o_proj") else None
    for name, param in attention.named_parameters(recurse=False):
        if param.dim() != 1 or param.shape[0] != heads:  # one number per head (sinks) is no channel
            raise ValueError(_unknown(attention, f"parameter {name!r} of shape {list(param.shape)}"))


def _converted_norm_param(convert, param: Tensor, heads: int, head_dim: int) -> Tensor:
    """A norm's per-channel parameter permuted: one head's ``[D]`` or every head's ``[H * D]`` /
    ``[H, D]`` (the sizes :func:`check_permutable` lets through)."""
    if param.numel() == head_dim:  # one head's channels, shared by every head
        return convert(param.reshape(head_dim), 1).reshape(param.shape)
    return convert(param.reshape(heads * head_dim), heads).reshape(param.shape)


def _unknown(attention: nn.Module, what: str) -> str:
    return (
        f"switch_rope_pairing_: {type(attention).__name__} holds {what}, which may index the q/k channels "
        "the switch permutes; only q_proj/k_proj, q_norm/k_norm, v_proj/v_norm and o_proj are known, so "
        "the switch is refused rather than leaving it in the old layout"
    )
