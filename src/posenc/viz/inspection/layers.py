"""The encoding per layer type, as the config says and the weights confirm.

Every family section (:mod:`.tables`, :mod:`.buckets`, :mod:`.rotary`) returns :class:`Finding`\\ s,
each naming the :class:`Encoding`\\ s it found (a stack, a layer type or every layer, a family and its
options) and the :class:`Check`\\ s it made of the config against the weights. This module reads the
stacks of a config (:func:`stacks`: an encoder-decoder has two, every other model one), lays the
encodings out as one :class:`LayerRow` per stack and layer type (:func:`layer_rows`), and checks
the attention sizes of each stack against its q and k projections (:func:`head_checks`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from .model import ModelView

__all__ = [
    "Check",
    "Encoding",
    "Finding",
    "LayerRow",
    "Stack",
    "head_checks",
    "layer_rows",
    "stack_of",
    "stacks",
]

#: The config attributes that give each size, per stack, first found wins.
LAYERS = {
    "encoder": ("encoder_layers", "num_layers"),
    "decoder": ("decoder_layers", "num_decoder_layers", "num_layers"),
    "model": ("num_hidden_layers", "n_layer", "num_layers"),
}
HEADS = {
    "encoder": ("encoder_attention_heads", "num_heads", "num_attention_heads"),
    "decoder": ("decoder_attention_heads", "num_heads", "num_attention_heads"),
    "model": ("num_attention_heads", "n_head", "num_heads"),
}
KV_HEADS = ("num_key_value_heads",)
HEAD_DIM = ("head_dim", "d_kv")
HIDDEN = ("d_model", "hidden_size", "n_embd")

#: The names of the query and key projections' weights in HF's model families.
Q_WEIGHTS = ("q_proj.weight", "query.weight", "q.weight", "q_lin.weight")
K_WEIGHTS = ("k_proj.weight", "key.weight", "k.weight", "k_lin.weight")


@dataclass(frozen=True)
class Encoding:
    """One positional encoding a stack uses.

    Attributes:
        stack: ``"model"``, or ``"encoder"`` / ``"decoder"`` of an encoder-decoder.
        layer_type: the config's ``layer_types`` entry it serves, or None for every layer.
        family: ``"learned absolute"``, ``"fixed sinusoid"``, ``"bucketed relative bias"``, ``"RoPE"``.
        where: where it acts (``"added to the input"``, ``"added to the logits"``, ``"rotates q and k"``).
        options: its options as the page shows them (``{"positions": 512}``).
        window: the sliding window of its layer type, or None.
    """

    stack: str
    layer_type: str | None
    family: str
    where: str
    options: dict[str, Any]
    window: int | None = None


@dataclass(frozen=True)
class Check:
    """The config against the weights: ``what`` is checked, what each says, whether they agree."""

    what: str
    config: str
    weights: str
    agrees: bool


@dataclass(frozen=True)
class Finding:
    """What one family section found in one place of the model; subclasses add the measurements.

    Attributes:
        title: a heading naming the weight or layer type (``embeddings.position_embeddings.weight``).
        encodings: the encodings it reports for the layer table.
        checks: the config-against-weights checks it made.
        summary: one-line statements of what it shows (the terminal and the page print them).
    """

    title: str
    encodings: tuple[Encoding, ...]
    checks: tuple[Check, ...]
    summary: tuple[str, ...]

    def table(self) -> tuple[list[str], list[list[str]]]:
        """``(columns, rows)`` of the numbers the page shows for it (none by default)."""
        return [], []

    def numbers(self) -> dict[str, Any]:
        """The measurements as JSON values (written to ``inspect.json``)."""
        return {}


@dataclass(frozen=True)
class Stack:
    """One stack of attention layers and its sizes from the config (None: the config does not say)."""

    name: str
    layers: int | None
    heads: int | None
    kv_heads: int | None
    head_dim: int | None
    hidden: int | None
    layer_types: tuple[str, ...] | None


@dataclass(frozen=True)
class LayerRow:
    """One row of the page's first table: a stack's layer type and every encoding it uses."""

    stack: str
    layer_type: str | None
    layers: tuple[int, ...]
    encodings: tuple[Encoding, ...]
    heads: int | None
    kv_heads: int | None
    head_dim: int | None

    @property
    def window(self) -> int | None:
        return next((e.window for e in self.encodings if e.window is not None), None)


def first(config: Any, names: tuple[str, ...]) -> Any:
    """The first of the attributes ``names`` that ``config`` sets (not None), else None."""
    return next((getattr(config, n) for n in names if getattr(config, n, None) is not None), None)


def stacks(config: Any) -> list[Stack]:
    """The attention stacks of ``config``: ``encoder`` and ``decoder`` of an encoder-decoder,
    else one ``model`` (the text config of a multimodal one)."""
    names = ("encoder", "decoder") if getattr(config, "is_encoder_decoder", False) else ("model",)
    text = config if names != ("model",) else config.get_text_config()
    found = []
    for name in names:
        heads = first(text, HEADS[name])
        hidden = first(text, HIDDEN)
        head_dim = first(text, HEAD_DIM) or (hidden // heads if hidden and heads else None)
        types = getattr(text, "layer_types", None) if name == "model" else None
        found.append(
            Stack(
                name=name,
                layers=first(text, LAYERS[name]),
                heads=heads,
                kv_heads=first(text, KV_HEADS) or heads,
                head_dim=head_dim,
                hidden=hidden,
                layer_types=tuple(types) if types else None,
            )
        )
    return found


def stack_of(name: str, config: Any) -> str:
    """The stack a weight ``name`` belongs to: ``encoder`` / ``decoder`` by the first such part of
    the name in an encoder-decoder, else ``model``."""
    if not getattr(config, "is_encoder_decoder", False):
        return "model"
    return next((part for part in name.split(".") if part in ("encoder", "decoder")), "model")


def layer_index(name: str) -> int | None:
    """The layer number in a weight's name (``model.layers.7.self_attn...`` -> 7), or None."""
    found = re.search(r"\.(\d+)\.", f".{name}.")
    return int(found.group(1)) if found else None


def layer_rows(all_stacks: list[Stack], encodings: list[Encoding]) -> list[LayerRow]:
    """One :class:`LayerRow` per stack and layer type, with the encodings that apply there: those of
    that layer type and those of every layer."""
    rows = []
    for stack in all_stacks:
        mine = [e for e in encodings if e.stack == stack.name]
        count = stack.layers or 0
        types = stack.layer_types if stack.layer_types and len(stack.layer_types) == count else None
        groups: dict[str | None, list[int]] = {}
        for index in range(count):
            groups.setdefault(types[index] if types else None, []).append(index)
        for layer_type, layers in groups.items() or {None: []}.items():
            here = tuple(e for e in mine if e.layer_type in (None, layer_type))
            rows.append(
                LayerRow(
                    stack.name, layer_type, tuple(layers), here, stack.heads, stack.kv_heads, stack.head_dim
                )
            )
    return rows


def head_checks(view: ModelView, all_stacks: list[Stack]) -> list[Check]:
    """Per stack: the rows of every q and k projection equal heads x head_dim (kv heads for k), and
    the layers that hold one equal the config's layer count."""
    checks = []
    for stack in all_stacks:
        for suffixes, heads, label in ((Q_WEIGHTS, stack.heads, "q"), (K_WEIGHTS, stack.kv_heads, "k")):
            names = [n for n in view.weights.ending(*suffixes) if stack_of(n, view.config) == stack.name]
            if not names or heads is None or stack.head_dim is None:
                continue
            rows = sorted({view.weights.shape(n)[0] for n in names})
            expected = heads * stack.head_dim
            checks.append(
                Check(
                    f"{stack.name}: {label} projection rows ({len(names)} weights)",
                    f"{heads} heads x head_dim {stack.head_dim} = {expected}",
                    ", ".join(str(r) for r in rows),
                    rows == [expected],
                )
            )
            if label == "q" and stack.layers is not None:
                layers = {layer_index(n) for n in names} - {None}
                checks.append(
                    Check(
                        f"{stack.name}: layers with a q projection",
                        f"{stack.layers} layers",
                        str(len(layers)),
                        len(layers) == stack.layers,
                    )
                )
    return checks


def join_layers(layers: tuple[int, ...]) -> str:
    """``(0, 1, 2, 4, 6, 7)`` -> ``"0-2, 4, 6-7"``."""
    runs: list[list[int]] = []
    for index in layers:
        if runs and index == runs[-1][-1] + 1:
            runs[-1].append(index)
        else:
            runs.append([index])
    return ", ".join(str(r[0]) if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs)
