"""RoPE: what each frequency of a trained model's queries and keys carries (Barbero et al. 2024,
"Round and round we go! What makes Rotary Positional Encodings useful?").

Found when the (text) config holds RoPE parameters (``rope_parameters``, or the older
``rope_theta``) and the weights hold ``q_proj`` projections. The model is built by HF and run once
on the first ``tokens`` tokens of the reference text; a forward hook on every attention module's
``q_proj`` and ``k_proj`` takes the queries and keys after projection and before rotation: split
into heads of ``head_dim`` (the keys into the kv heads, GQA), passed through the module's own
``q_norm`` / ``k_norm`` where it has them (Gemma 3, Qwen 3 and OLMo 2 normalize before rotating).
Each rotated pair's norm (:func:`~posenc.pretrained.measures.pair_norms`, HF's ``rotate_half``
pairing, or interleaved when the config says ``rope_interleave``) is averaged over the tokens.

The frequencies are the model's own: the ``inv_freq`` buffer of its rotary embedding (one per
layer type, ``{layer_type}_inv_freq``, in Gemma 3), so a scaled RoPE shows its scaled wavelengths.
Pairs whose wavelength ``2π / θ_k`` exceeds the training context never turn a full circle inside it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
from matplotlib import colormaps, colors
from matplotlib.figure import Figure
from torch import Tensor, nn

from ...pretrained.measures import pair_norms, wavelengths
from .._style import SEQUENTIAL
from ..registry import new_figure
from .layers import Check, Encoding, Finding, first, join_layers
from .model import InspectError, ModelView

__all__ = ["HEADING", "ID", "INTRO", "RotaryFinding", "figures", "find"]

ID = "rotary"
HEADING = "RoPE: what each frequency carries"
INTRO = (
    "RoPE rotates each pair of query and key channels by position x θ_k; the rotation keeps a pair's "
    "norm, so the mean norm of pair k over real text is how much the layer puts on frequency k. "
    "Barbero et al. (2024) find the lowest frequencies (long wavelengths, barely rotating within the "
    "context) used as semantic channels, and a few high-frequency pairs carrying positional heads. "
    "Pairs are numbered from the highest frequency (pair 0, wavelength 2π) to the lowest."
)

#: How many of the largest pairs the page names per layer type.
TOP = 3


@dataclass(frozen=True)
class RotaryFinding(Finding):
    """The queries and keys of every RoPE layer, pair by pair.

    Attributes:
        layer_types: each attention layer's type (None: the config names no types).
        inv_freq: ``{layer type: [P]}`` the model's inverse frequencies ``θ_k``.
        q_norms, k_norms: ``[layers, heads, P]`` the mean norm of each pair of each head (kv heads for k).
        context: the training context (``max_position_embeddings``).
        windows: ``{layer type: window}`` of the sliding layer types.
        tokens: how many tokens were read, and ``how`` they were made.
    """

    layer_types: tuple[str | None, ...] = ()
    inv_freq: Any = None
    q_norms: Any = None
    k_norms: Any = None
    context: int | None = None
    windows: Any = None
    tokens: int = 0
    how: str = ""

    def types(self) -> list[str | None]:
        return list(dict.fromkeys(self.layer_types))

    def beyond(self, layer_type: str | None) -> np.ndarray:
        """The pairs of ``layer_type`` whose wavelength exceeds the context."""
        lengths = wavelengths(torch.as_tensor(self.inv_freq[layer_type])).numpy()
        return np.nonzero(lengths > (self.context or math.inf))[0]

    def table(self) -> tuple[list[str], list[list[str]]]:
        columns = [
            "layer type",
            "layers",
            "pairs",
            "wavelengths",
            "pairs past the context",
            "mean |q| past / rest",
            "largest |q| pairs",
            "largest |k| pairs",
        ]
        rows = []
        for kind in self.types():
            layers = [i for i, t in enumerate(self.layer_types) if t == kind]
            lengths = wavelengths(torch.as_tensor(self.inv_freq[kind])).numpy()
            past = self.beyond(kind)
            q = self.q_norms[layers].mean(axis=(0, 1))
            k = self.k_norms[layers].mean(axis=(0, 1))
            rest = np.setdiff1d(np.arange(len(q)), past)
            ratio = f"{q[past].mean() / q[rest].mean():.2f}" if len(past) and len(rest) else "n/a"
            rows.append(
                [
                    kind or "every layer",
                    join_layers(tuple(layers)),
                    str(len(lengths)),
                    f"{lengths.min():.3g} .. {lengths.max():.3g}",
                    f"{len(past)} ({past.min()}-{past.max()})" if len(past) else "0",
                    ratio,
                    ", ".join(str(p) for p in np.argsort(-q)[:TOP]),
                    ", ".join(str(p) for p in np.argsort(-k)[:TOP]),
                ]
            )
        return columns, rows

    def numbers(self) -> dict[str, Any]:
        return {
            "layer_types": list(self.layer_types),
            "context": self.context,
            "windows": dict(self.windows),
            "tokens": self.tokens,
            "inv_freq": {str(k): [float(v) for v in f] for k, f in self.inv_freq.items()},
            "pairs_past_context": {str(k): [int(p) for p in self.beyond(k)] for k in self.types()},
            "q_pair_norms": self.q_norms.mean(axis=1).tolist(),
            "k_pair_norms": self.k_norms.mean(axis=1).tolist(),
        }


def rope_parameters(text: Any) -> Any:
    """The config's RoPE parameters: ``rope_parameters`` (flat, or one dict per layer type), or
    ``{"rope_theta": ...}`` from an older config; None without RoPE."""
    found = getattr(text, "rope_parameters", None)
    if found:
        return found
    theta = getattr(text, "rope_theta", None)
    return {"rope_type": "default", "rope_theta": theta} if theta else None


def find(view: ModelView, *, tokens: int) -> list[RotaryFinding]:
    """One :class:`RotaryFinding` for a model whose config and weights hold RoPE attention."""
    text = view.config.get_text_config()
    parameters = rope_parameters(text)
    if parameters is None or not view.weights.ending("q_proj.weight"):
        return []
    module = view.module()
    attention = attention_modules(module)
    if not attention:
        return []
    head_dim = first(text, ("head_dim",)) or text.hidden_size // text.num_attention_heads
    types = getattr(text, "layer_types", None)
    layer_types = tuple(types) if types and len(types) == len(attention) else (None,) * len(attention)
    inv_freq = {kind: _inv_freq(module, kind) for kind in dict.fromkeys(layer_types)}
    ids, how = view.token_ids(tokens)
    q_norms, k_norms = capture(module, attention, ids, head_dim, _pairing(text), inv_freq, layer_types)
    context = getattr(text, "max_position_embeddings", None)
    window = getattr(text, "sliding_window", None)
    windows = {k: window for k in inv_freq if k is not None and "sliding" in k and window}
    encodings, checks = _describe(text, attention, layer_types, inv_freq, head_dim, parameters, windows)
    finding = RotaryFinding(
        title="RoPE layers",
        encodings=encodings,
        checks=checks,
        summary=(),
        layer_types=layer_types,
        inv_freq={k: v.numpy() for k, v in inv_freq.items()},
        q_norms=q_norms.numpy(),
        k_norms=k_norms.numpy(),
        context=context,
        windows=windows,
        tokens=int(ids.shape[1]),
        how=how,
    )
    return [_with_summary(finding)]


def attention_modules(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` of every attention module with ``q_proj`` and ``k_proj`` linear layers, in order."""
    return [
        (name, m)
        for name, m in module.named_modules()
        if isinstance(getattr(m, "q_proj", None), nn.Linear)
        and isinstance(getattr(m, "k_proj", None), nn.Linear)
    ]


def _pairing(text: Any) -> str:
    return "interleaved" if getattr(text, "rope_interleave", False) else "half"


def _inv_freq(module: nn.Module, layer_type: str | None) -> Tensor:
    """The model's inverse frequencies for ``layer_type``: the buffer ``{layer_type}_inv_freq`` of its
    rotary embedding, else its ``inv_freq``."""
    wanted = [f"{layer_type}_inv_freq"] if layer_type else []
    buffers = dict(module.named_buffers())
    for suffix in (*wanted, "inv_freq"):
        for name, buffer in buffers.items():
            if name.split(".")[-1] == suffix:
                return buffer.detach().double().cpu()
    raise InspectError(
        f"{type(module).__name__}: its config holds RoPE parameters but no rotary embedding buffer named "
        f"{' or '.join((*wanted, 'inv_freq'))} was found; posenc inspect reads the frequencies from it"
    )


def _normed(attention: nn.Module, which: str, out: Tensor, head_dim: int) -> Tensor:
    """The projection ``out`` ``[B, T, heads x head_dim]`` as ``[B, T, heads, head_dim]``, through the
    module's ``q_norm`` / ``k_norm`` (per head, or over the whole projection: OLMo 2) when it has one."""
    norm = getattr(attention, f"{which}_norm", None)
    heads = out.reshape(*out.shape[:-1], -1, head_dim)
    if not isinstance(norm, nn.Module):
        return heads
    width = getattr(norm, "weight", None)
    if width is not None and width.numel() == out.shape[-1] and width.numel() != head_dim:
        return norm(out).reshape(heads.shape)
    return norm(heads)


def capture(
    module: nn.Module,
    attention: list[tuple[str, nn.Module]],
    ids: Tensor,
    head_dim: int,
    pairing: str,
    inv_freq: dict[str | None, Tensor],
    layer_types: tuple[str | None, ...],
) -> tuple[Tensor, Tensor]:
    """Run ``module`` on ``ids`` and return ``(q, k)`` pair norms ``[layers, heads, P]`` (float64),
    each the mean over the tokens of :func:`pair_norms` of the pre-rotation query or key."""
    found: dict[tuple[int, str], Tensor] = {}
    handles = []
    for index, (_, attn) in enumerate(attention):
        rotary = 2 * len(inv_freq[layer_types[index]])
        for which in ("q", "k"):

            def hook(
                _mod: nn.Module, _args: Any, out: Tensor, index=index, which=which, attn=attn, rotary=rotary
            ):
                states = _normed(attn, which, out.detach(), head_dim)  # [B, T, H, D]
                found[(index, which)] = pair_norms(states, rotary, pairing).mean(dim=(0, 1))  # [H, P]

            handles.append(getattr(attn, f"{which}_proj").register_forward_hook(hook))
    try:
        with torch.no_grad():
            module(input_ids=ids)
    finally:
        for handle in handles:
            handle.remove()
    q = torch.stack([found[(i, "q")] for i in range(len(attention))])
    k = torch.stack([found[(i, "k")] for i in range(len(attention))])
    return q, k


def _describe(
    text: Any,
    attention: list[tuple[str, nn.Module]],
    layer_types: tuple[str | None, ...],
    inv_freq: dict[str | None, Tensor],
    head_dim: int,
    parameters: Any,
    windows: dict[str, int],
) -> tuple[tuple[Encoding, ...], tuple[Check, ...]]:
    """The encoding of each layer type, and its rotary width and norms checked against the weights."""
    encodings, checks = [], []
    factor = getattr(text, "partial_rotary_factor", None) or 1.0
    for kind, freq in inv_freq.items():
        own = parameters.get(kind, parameters) if isinstance(parameters.get(kind), dict) else parameters
        options = {k: v for k, v in own.items() if v is not None}
        options["pairs"] = len(freq)
        encodings.append(Encoding("model", kind, "RoPE", "rotates q and k", options, windows.get(kind)))
        label = kind or "every layer"
        checks.append(
            Check(
                f"{label}: rotary pairs (the model's inv_freq)",
                f"head_dim {head_dim} x partial_rotary_factor {factor} / 2 = {int(head_dim * factor) // 2}",
                str(len(freq)),
                len(freq) == int(head_dim * factor) // 2,
            )
        )
        if own.get("rope_type", "default") == "default" and own.get("rope_theta"):
            theta, rotary = float(own["rope_theta"]), 2 * len(freq)
            formula = 1.0 / theta ** (torch.arange(0, rotary, 2, dtype=torch.float64) / rotary)
            gap = float((freq - formula).abs().max() / formula.max())
            checks.append(
                Check(
                    f"{label}: inv_freq",
                    f"1 / {theta:g}^(2k/{rotary})",
                    f"max rel. gap {gap:.1e}",
                    gap < 1e-5,
                )
            )
    checks += _norm_checks(attention, head_dim)
    return tuple(encodings), tuple(checks)


def _norm_checks(attention: list[tuple[str, nn.Module]], head_dim: int) -> list[Check]:
    """The widths of the q / k norms applied before rotation, against head_dim (or heads x head_dim)."""
    checks = []
    for which in ("q", "k"):
        widths = {
            int(norm.weight.numel())
            for _, attn in attention
            if isinstance(norm := getattr(attn, f"{which}_norm", None), nn.Module)
            and getattr(norm, "weight", None) is not None
        }
        if widths:
            rows = getattr(attention[0][1], f"{which}_proj").out_features
            checks.append(
                Check(
                    f"{which}_norm width (before RoPE)",
                    f"head_dim {head_dim} (or all {rows} rows)",
                    ", ".join(map(str, sorted(widths))),
                    widths <= {head_dim, rows},
                )
            )
    return checks


def _with_summary(finding: RotaryFinding) -> RotaryFinding:
    """``finding`` with its summary lines: per layer type, the pairs past the context and the largest."""
    lines = [
        f"queries and keys of {len(finding.layer_types)} layers on {finding.tokens} tokens: {finding.how}"
    ]
    for row in finding.table()[1]:
        kind, layers, pairs, lengths, past, ratio, top_q, top_k = row
        window = finding.windows.get(kind)
        lines.append(
            f"{kind} ({'layer' if layers.isdigit() else 'layers'} {layers}"
            f"{f', window {window}' if window else ''}): {pairs} pairs, wavelengths "
            f"{lengths}; past the context {finding.context}: {past}; mean |q| there / elsewhere {ratio}; "
            f"largest |q| at pairs {top_q}, |k| at {top_k}"
        )
    for name, values in (("q", finding.q_norms), ("k", finding.k_norms)):
        zero = {layer: int(n) for layer, n in enumerate((values.mean(axis=1) == 0).sum(axis=1)) if n}
        if zero:
            where = ", ".join(f"{layer} ({n})" for layer, n in zero.items())
            lines.append(
                f"pairs of {name} with norm zero on every token (switched off before RoPE), by layer: {where}"
            )
    return replace(finding, summary=tuple(lines))


def figures(finding: RotaryFinding, label: str) -> list[tuple[str, Figure, str]]:
    """``[(file stem, figure, caption)]``: the layer x pair heatmaps of mean |q| and |k|, and each
    layer type's wavelengths against the context."""
    return [
        (
            "rotary_pair_norms",
            _heatmaps(finding, label),
            "mean norm of each rotated pair of q and k, per layer (pairs past the context right of the dashed "
            "line; black: norm zero)",
        ),
        (
            "rotary_wavelengths",
            _wavelengths(finding, label),
            "each pair's wavelength 2π/θ_k against the training context (and window)",
        ),
    ]


def _heatmaps(finding: RotaryFinding, label: str) -> Figure:
    layers = len(finding.layer_types)
    fig = new_figure(12.0, 1.6 + 0.16 * max(layers, 12))
    axes = fig.subplots(1, 2, sharey=True)
    kinds = finding.types()
    ticks = [f"{i} {kind[0].upper() if kind else ''}".strip() for i, kind in enumerate(finding.layer_types)]
    for ax, values, name in ((axes[0], finding.q_norms, "q"), (axes[1], finding.k_norms, "k")):
        grid = values.mean(axis=1)  # [layers, P]
        positive = grid[grid > 0]
        norm = colors.LogNorm(vmin=positive.min(), vmax=positive.max()) if positive.size else None
        cmap = colormaps[SEQUENTIAL].with_extremes(bad="black")  # a pair of norm zero: black
        image = ax.imshow(grid, aspect="auto", cmap=cmap, norm=norm, interpolation="nearest")
        for row, kind in enumerate(finding.layer_types):  # each layer's own context boundary
            past = finding.beyond(kind)
            if len(past):
                ax.plot([past.min() - 0.5] * 2, [row - 0.5, row + 0.5], color="white", ls="--", lw=1)
        ax.set_ylim(layers - 0.5, -0.5)
        ax.set_xlabel("pair k (0: highest frequency)")
        ax.set_title(f"mean |{name}| per pair ({'kv heads' if name == 'k' else 'heads'} averaged)")
        fig.colorbar(image, ax=ax, shrink=0.9)
    axes[0].set_yticks(range(layers), ticks if len(kinds) > 1 else range(layers), fontsize=7)
    axes[0].set_ylabel("layer" + (" (type initial)" if len(kinds) > 1 else ""))
    fig.suptitle(f"{label}: queries and keys before rotation, {finding.tokens} tokens of text")
    return fig


def _wavelengths(finding: RotaryFinding, label: str) -> Figure:
    fig = new_figure(9.0, 4.2)
    ax = fig.add_subplot()
    for kind, freq in finding.inv_freq.items():
        lengths = wavelengths(torch.as_tensor(freq)).numpy()
        past = lengths > (finding.context or math.inf)
        line = ax.plot(np.arange(len(lengths)), lengths, marker=".", lw=1, label=kind or "every layer")[0]
        ax.scatter(
            np.nonzero(past)[0], lengths[past], s=40, facecolors="none", edgecolors=line.get_color(), zorder=3
        )
    if finding.context:
        ax.axhline(finding.context, color="#a33", ls="--", lw=1, label=f"context {finding.context}")
    for kind, window in finding.windows.items():
        ax.axhline(window, color="#888", ls=":", lw=1, label=f"window {window} ({kind})")
    ax.set_yscale("log")
    ax.set_xlabel("pair k")
    ax.set_ylabel("wavelength 2π/θ_k (tokens)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8, loc="upper left")
    ax.set_title(f"{label}: wavelengths (circled: longer than the context)")
    return fig
