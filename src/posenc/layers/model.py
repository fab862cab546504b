"""A small pre-LN Transformer in which every layer takes any positional encoding.

:class:`TransformerLM` is a decoder-only language model (causal, untied output head) and
:class:`TransformerEncoder` its bidirectional sibling. Both are the vehicle for the
length-generalization experiments (:mod:`posenc.experiments`) and for hybrids.

Encodings
---------
``encoding`` is one spec string (``"alibi"``, ``"rope:base=500000"``), a built encoding, or a list
with one spec per layer (a *hybrid*). How each entry acts follows its kind:

* **ABSOLUTE** (``sinusoidal``, ``learned``, ``nope``): added to the token embeddings **once, at the
  input**, before the first layer. In a hybrid list every *distinct* absolute spec is built once
  and summed at the input; the layers that list an absolute spec get no in-attention encoding
  (they see position only through the residual stream). So
  ``["t5", "t5", "sinusoidal", "sinusoidal"]`` means: T5 biases in layers 0-1, one sinusoidal
  table added at the input, layers 2-3 plain dot-product attention.
* **ROTARY / BIAS / CONTENT**: act inside the attention of the layers that list them. An encoding
  whose class sets ``shared_across_layers`` (T5's bias table, DeBERTa's relative embeddings) is built
  once per distinct spec and shared by all layers listing that spec; any other encoding gets one
  instance per layer.

Each spec string is parsed once (:func:`posenc.encodings.registry.resolve`). The model hands every encoding
a :class:`~posenc.encodings.base.LayerContext` (the layer sizes, ``causal`` and ``max_len``); each class
declares the options it takes from it (learned and unclipped Shaw size their table by ``max_len``,
T5 sets ``bidirectional = not causal``). Without a causal mask, options the spec leaves out get the
class's ``noncausal_options`` (ALiBi's symmetric form).

Positions default to ``arange(T)`` (continuing from the cache length when decoding, or counted from
the padding mask for left padding) and are computed once per forward and passed to every layer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..cache.kv_cache import KVCache
from ..encodings.base import Kind, LayerContext, PositionalEncoding, checks_values
from ..encodings.registry import build_for_layer, resolve
from ..encodings.spec import Spec
from .attention import MultiheadAttention
from .generate import greedy
from .kv_sharing import KVDonorAttention, KVSharedAttention, kv_donors, link_kv_sharing
from .patterns import LayerSpec, layer_pattern, mark_kv_shared
from .positions import embed_positions, step_positions

__all__ = ["TransformerBlock", "TransformerEncoder", "TransformerLM"]

EncodingSpec = str | PositionalEncoding | None


class FeedForward(nn.Module):
    """``Linear(d_model, d_ff) -> GELU -> Linear(d_ff, d_model)`` with dropout on the output."""

    def __init__(self, d_model: int, d_ff: int, dropout: float) -> None:
        super().__init__()
        self.up = nn.Linear(d_model, d_ff)
        self.down = nn.Linear(d_ff, d_model)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.dropout(self.down(F.gelu(self.up(x))))


class TransformerBlock(nn.Module):
    """Pre-LN block: ``x + attn(LN(x))`` then ``x + ffn(LN(x))``.

    ``layer`` carries the attention pattern of this layer (window, chunk, sinks, query temperature).
    """

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        encoding: PositionalEncoding,
        *,
        d_ff: int,
        dropout: float,
        causal: bool,
        num_kv_heads: int | None,
        backend: str,
        layer_idx: int,
        layer: LayerSpec | None = None,
        attention: type[MultiheadAttention] = MultiheadAttention,
    ) -> None:
        super().__init__()
        self.norm_attn = nn.LayerNorm(d_model)
        head_dim = None  # a layer's own head size and KV heads (Gemma 4's global layers) go as arguments
        if layer is not None:
            head_dim, num_kv_heads = layer.head_dim, layer.num_kv_heads or num_kv_heads
            layer = replace(layer, head_dim=None, num_kv_heads=None)
        self.attn = attention(
            d_model,
            num_heads,
            encoding,
            causal=causal,
            pattern=layer,
            backend=backend,
            num_kv_heads=num_kv_heads,
            dropout=dropout,
            layer_idx=layer_idx,
            head_dim=head_dim,
        )
        self.norm_ffn = nn.LayerNorm(d_model)
        self.ffn = FeedForward(d_model, d_ff, dropout)
        self.dropout = nn.Dropout(dropout)

    def forward(
        self,
        x: Tensor,
        *,
        positions: Tensor,
        key_padding_mask: Tensor | None,
        cache: KVCache | None,
        document_ids: Tensor | None = None,
        group_ids: Tensor | None = None,
    ) -> Tensor:
        attended = self.attn(
            self.norm_attn(x),
            positions=positions,
            key_padding_mask=key_padding_mask,
            cache=cache,
            document_ids=document_ids,
            group_ids=group_ids,
        )
        x = x + self.dropout(attended)
        return x + self.ffn(self.norm_ffn(x))


ParsedSpec = Spec | PositionalEncoding | None


def _kind_of(spec: ParsedSpec) -> Kind:
    if spec is None:
        return Kind.ABSOLUTE
    if isinstance(spec, PositionalEncoding):
        return spec.kind
    return spec.cls.kind


class _Stack(nn.Module):
    """Token embedding, input (absolute) encodings, blocks, final LayerNorm and an untied head.

    The one constructor of :class:`TransformerLM` and :class:`TransformerEncoder` (their docstrings
    document the arguments); they differ only in :attr:`default_causal`, what ``causal=None`` means.
    """

    #: Whether attention is causal when the caller leaves ``causal`` out.
    default_causal: ClassVar[bool]

    def __init__(
        self,
        vocab_size: int,
        d_model: int,
        num_layers: int,
        num_heads: int,
        encoding: EncodingSpec | Sequence[EncodingSpec] = "nope",
        *,
        d_ff: int | None = None,
        ffn_mult: float = 4.0,
        dropout: float = 0.0,
        causal: bool | None = None,
        max_len: int | None = None,
        num_kv_heads: int | None = None,
        backend: str = "auto",
        pattern: str | Sequence[LayerSpec] | None = None,
        kv_shared_layers: int = 0,
    ) -> None:
        super().__init__()
        causal = self.default_causal if causal is None else causal
        for label, value in (
            ("vocab_size", vocab_size),
            ("d_model", d_model),
            ("num_layers", num_layers),
            ("num_heads", num_heads),
        ):
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{label} must be a positive int, got {value!r}")
        if d_model % num_heads:
            raise ValueError(f"d_model={d_model} is not divisible by num_heads={num_heads}")
        if max_len is not None and max_len <= 0:
            raise ValueError(f"max_len must be positive or None, got {max_len}")
        d_ff = round(ffn_mult * d_model) if d_ff is None else d_ff
        if d_ff <= 0:
            raise ValueError(f"d_ff must be positive, got {d_ff} (ffn_mult={ffn_mult})")
        self.vocab_size, self.d_model, self.num_layers, self.num_heads = (
            vocab_size,
            d_model,
            num_layers,
            num_heads,
        )
        self.causal, self.max_len = causal, max_len
        self.head_dim = d_model // num_heads

        self.layers = mark_kv_shared(self._layer_specs(pattern, encoding, num_layers), kv_shared_layers)
        given = [layer.encoding for layer in self.layers] if pattern is not None else None
        given = given or self._per_layer_specs(encoding, num_layers)
        self.encoding_specs = [s if isinstance(s, str) or s is None else s.spec() for s in given]
        donors = kv_donors(self.layers, self.encoding_specs)  # {shared layer: donor}, Gemma 4
        parsed = {s: resolve(s) for s in dict.fromkeys(given) if isinstance(s, str)}  # once per string
        specs = [parsed[s] if isinstance(s, str) else s for s in given]
        self.token_embedding = nn.Embedding(vocab_size, d_model)
        self.input_encodings = nn.ModuleList(self._input_encodings(specs))
        layer_encodings = self._layer_encodings(
            specs, [layer.head_dim or self.head_dim for layer in self.layers]
        )
        self.blocks = nn.ModuleList(
            TransformerBlock(
                d_model,
                num_heads,
                enc,
                d_ff=d_ff,
                dropout=dropout,
                causal=causal,
                num_kv_heads=num_kv_heads,
                backend=backend,
                layer_idx=i,
                layer=self.layers[i],
                attention=self._attention_class(i, donors),
            )
            for i, enc in enumerate(layer_encodings)
        )
        self._kv_handoffs = link_kv_sharing([block.attn for block in self.blocks], donors)
        self.input_dropout = nn.Dropout(dropout)
        self.final_norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)

    # ------------------------------------------------------------------ construction
    @staticmethod
    def _layer_specs(
        pattern: str | Sequence[LayerSpec] | None, encoding: object, num_layers: int
    ) -> list[LayerSpec]:
        """One :class:`LayerSpec` per layer: from ``pattern`` (a preset or a list), else plain layers."""
        if pattern is None:
            return [LayerSpec()] * num_layers
        if encoding != "nope":
            raise ValueError("give either encoding or pattern: a pattern sets every layer's encoding")
        layers = layer_pattern(pattern, num_layers) if isinstance(pattern, str) else list(pattern)
        if len(layers) != num_layers or not all(isinstance(layer, LayerSpec) for layer in layers):
            raise ValueError(
                f"pattern must give one posenc.layers.patterns.LayerSpec per layer ({num_layers})"
            )
        return layers

    @staticmethod
    def _attention_class(index: int, donors: dict[int, int]) -> type[MultiheadAttention]:
        """The attention layer of block ``index``: a KV-shared one, a donor, or an ordinary one."""
        if index in donors:
            return KVSharedAttention
        return KVDonorAttention if index in donors.values() else MultiheadAttention

    @staticmethod
    def _per_layer_specs(
        encoding: EncodingSpec | Sequence[EncodingSpec], num_layers: int
    ) -> list[EncodingSpec]:
        if isinstance(encoding, (list, tuple)):
            if len(encoding) != num_layers:
                raise ValueError(
                    f"encoding list has {len(encoding)} entries but num_layers={num_layers}; give one spec per layer"
                )
            return list(encoding)
        if (
            isinstance(encoding, PositionalEncoding)
            and encoding.kind is not Kind.ABSOLUTE
            and not encoding.shared_across_layers
        ):
            raise ValueError(
                f"encoding: one built {encoding.name!r} instance cannot serve {num_layers} layers (its class is not "
                "shared_across_layers); pass a spec string so that each layer builds its own"
            )
        return [encoding] * num_layers

    def _build(self, spec: Spec | PositionalEncoding, head_dim: int | None = None) -> PositionalEncoding:
        context = LayerContext(
            self.num_heads, head_dim or self.head_dim, self.d_model, causal=self.causal, max_len=self.max_len
        )
        extra = {}
        if isinstance(spec, Spec) and not self.causal:  # e.g. ALiBi's symmetric form for an encoder
            extra = {k: v for k, v in spec.cls.noncausal_options.items() if k not in spec.options}
        return build_for_layer(spec, context, **extra)

    def _input_encodings(self, specs: list[ParsedSpec]) -> list[PositionalEncoding]:
        built: dict[object, PositionalEncoding] = {}
        for spec in specs:
            if spec is None or _kind_of(spec) is not Kind.ABSOLUTE:
                continue
            key = str(spec) if isinstance(spec, Spec) else id(spec)
            if key not in built:
                built[key] = self._build(spec)
        return list(built.values())

    def _layer_encodings(
        self, specs: list[ParsedSpec], head_dims: list[int]
    ) -> list[PositionalEncoding | None]:
        shared: dict[object, PositionalEncoding] = {}
        layers: list[PositionalEncoding | None] = []
        for spec, head_dim in zip(specs, head_dims, strict=True):
            if spec is None or _kind_of(spec) is Kind.ABSOLUTE:
                layers.append(None)  # position arrives through the residual stream
                continue
            if isinstance(spec, PositionalEncoding):
                layers.append(spec)
                continue
            if spec.cls.shared_across_layers:
                key = (str(spec), head_dim)
                if key not in shared:
                    shared[key] = self._build(spec, head_dim)
                layers.append(shared[key])
            else:
                layers.append(self._build(spec, head_dim))
        return layers

    # ------------------------------------------------------------------ forward
    def _positions(
        self,
        tokens: Tensor,
        positions: Tensor | None,
        key_padding_mask: Tensor | None,
        cache: KVCache | None,
        document_ids: Tensor | None,
    ) -> Tensor:
        """Positions ``[B or 1, T]`` of the new tokens (explicit, from padding, or after the cache)."""
        batch, length = tokens.shape
        if positions is not None:
            if positions.dim() == 1:
                positions = positions[None]
            if positions.dim() != 2 or positions.shape[-1] != length or positions.shape[0] not in (1, batch):
                raise ValueError(
                    f"positions must have shape [{length}] or [{batch}, {length}], got {tuple(positions.shape)}"
                )
            return positions.to(tokens.device)
        if cache is None:
            return step_positions(None, batch, length, key_padding_mask, document_ids, tokens.device)
        if not isinstance(cache, KVCache):
            raise ValueError(f"cache must be a posenc.KVCache, got {type(cache).__name__}")
        state = cache.slot_state(self.blocks[0].attn.layer_idx)
        if state is not None and length == 1 and key_padding_mask is None and document_ids is None:
            return state.positions()  # fixed shapes: the slot's position, read from tensors only
        # every layer's entry has seen the same tokens (a window evicts, and counts what it evicted)
        entry = cache.read(self.blocks[0].attn, cross=False, batch=batch, device=tokens.device)
        return step_positions(
            entry, batch, length, key_padding_mask, document_ids, tokens.device, streaming=cache.streaming
        )

    def hidden_states(
        self,
        tokens: Tensor,
        *,
        cache: KVCache | None = None,
        positions: Tensor | None = None,
        key_padding_mask: Tensor | None = None,
        document_ids: Tensor | None = None,
        group_ids: Tensor | None = None,
    ) -> Tensor:
        """The final (normalised) hidden states ``[B, T, d_model]`` for ``tokens [B, T]``.

        ``document_ids [B, T]``: packed documents (every layer attends within a document, and
        positions restart at each document's first token unless ``positions`` are given).
        ``group_ids [B, T]`` (causal layers): tokens with one non-negative id also see each other's
        later keys (Gemma 3's image tokens; -1 for none).
        """
        if not isinstance(tokens, Tensor) or tokens.dim() != 2 or tokens.dtype.is_floating_point:
            shape = tuple(tokens.shape) if isinstance(tokens, Tensor) else type(tokens).__name__
            raise ValueError(f"tokens must be an integer tensor [B, T], got {shape}")
        if tokens.device != self.token_embedding.weight.device:
            raise ValueError(
                f"tokens are on device {tokens.device} but the model is on {self.token_embedding.weight.device}; "
                "move one of them"
            )
        if (
            tokens.numel()
            and checks_values()
            and (int(tokens.min()) < 0 or int(tokens.max()) >= self.vocab_size)
        ):
            raise ValueError(
                f"tokens must be ids in [0, vocab_size={self.vocab_size}), got values from "
                f"{int(tokens.min())} to {int(tokens.max())}"
            )
        pos = self._positions(tokens, positions, key_padding_mask, cache, document_ids)
        x = self.token_embedding(tokens)
        for enc in self.input_encodings:
            x = embed_positions(enc, x, pos)
        x = self.input_dropout(x)
        try:
            for block in self.blocks:
                x = block(
                    x,
                    positions=pos,
                    key_padding_mask=key_padding_mask,
                    cache=cache,
                    document_ids=document_ids,
                    group_ids=group_ids,
                )
        finally:
            for handoff in self._kv_handoffs:  # the donors' keys serve this forward only
                handoff.clear()
        return self.final_norm(x)


class TransformerLM(_Stack):
    """Decoder-only pre-LN Transformer language model with any encoding per layer.

    Args:
        vocab_size: number of token ids ``V``.
        d_model: width ``E``.
        num_layers: number of blocks.
        num_heads: attention heads (``E`` divisible by it).
        encoding: one spec string / built encoding, or a list with one spec per layer (hybrid; see
            the module docstring for how absolute entries work). Default ``"nope"``.
        d_ff: feed-forward width; default ``ffn_mult * d_model``.
        ffn_mult: feed-forward multiplier used when ``d_ff`` is None.
        dropout: dropout on embeddings, attention probabilities and residual branches.
        causal: causal self-attention; None (the default) means True for a language model.
        max_len: size of position tables (learned absolute); encodings without a table ignore it.
        num_kv_heads: key/value heads for grouped-query attention.
        backend: attention backend for every layer (``"auto"`` picks per call).
        pattern: a per-layer recipe instead of ``encoding``: a preset string (``"gemma3"``,
            ``"llama4:chunk=64"``, see :mod:`posenc.layers.patterns`) or one
            :class:`~posenc.layers.patterns.LayerSpec` per layer (encoding, window, chunk, sinks, query
            temperature).
        kv_shared_layers: the last ``N`` layers compute no keys or values and attend with those of
            the last unshared layer before them of their type (encoding, window, chunk): Gemma 4's
            ``num_kv_shared_layers`` (:mod:`posenc.layers.kv_sharing`); a :class:`KVCache` holds the
            donors' entries only. ``0 <= N < num_layers``; a pattern may mark the layers instead
            (``"gemma4:kv_shared_layers=N"``).

    ``forward(tokens [B, T], cache=None, positions=None, key_padding_mask=None, document_ids=None)
    -> logits [B, T, V]``.
    """

    default_causal = True

    def forward(
        self,
        tokens: Tensor,
        cache: KVCache | None = None,
        positions: Tensor | None = None,
        key_padding_mask: Tensor | None = None,
        document_ids: Tensor | None = None,
        group_ids: Tensor | None = None,
    ) -> Tensor:
        """Logits ``[B, T, V]`` for ``tokens [B, T]`` (new tokens only when ``cache`` holds the past;
        ``group_ids [B, T]``: Gemma 3's image groups, see :meth:`hidden_states`)."""
        hidden = self.hidden_states(
            tokens,
            cache=cache,
            positions=positions,
            key_padding_mask=key_padding_mask,
            document_ids=document_ids,
            group_ids=group_ids,
        )
        return self.head(hidden)

    @torch.no_grad()
    def generate(
        self,
        prompt: Tensor,
        max_new_tokens: int,
        *,
        use_cache: bool = True,
        eos_token: int | None = None,
        compiled: bool = False,
    ) -> Tensor:
        """Greedy decoding: ``prompt [B, T0]`` -> ``[B, T0 + max_new_tokens]`` (argmax at every step).

        With ``use_cache`` each step feeds only the new token and reads keys/values from a
        :class:`KVCache` preallocated for ``T0 + max_new_tokens`` tokens; without it every step
        recomputes the whole sequence. Runs under ``torch.no_grad()``. Both give the same
        tokens. When every row has produced ``eos_token`` the loop stops early (rows are then
        shorter than ``T0 + max_new_tokens``).

        ``compiled=True`` runs the prompt eagerly, then every new token through the model's own
        forward in fixed shapes (``KVCache.fixed_shapes()``: each token written at its slot of the
        preallocated cache, every slot attended, the unwritten ones masked), that forward under
        ``torch.compile(fullgraph=True)`` (:func:`~posenc.layers.step.compiled_next_logits`): the
        first call compiles (seconds for a small model, minutes for a deep one), later calls reuse the graph, with
        batch and length dynamic after the first change. The same tokens as the eager path. A model
        the fixed shapes cannot serve (windows, chunks, sinks, KV sharing, content encodings) is
        refused with the reasons and ``compiled=False`` to pass; past torch's recompile limit
        (many models in one process) it warns once and decodes the same steps eagerly.
        """
        return greedy(
            self, prompt, max_new_tokens, use_cache=use_cache, eos_token=eos_token, compiled=compiled
        )


class TransformerEncoder(_Stack):
    """Bidirectional pre-LN Transformer encoder with any encoding per layer.

    Same arguments as :class:`TransformerLM`, except that ``causal`` defaults to False. ``forward(tokens,
    positions=None, key_padding_mask=None)`` returns per-token logits ``[B, T, V]`` from an untied
    head (masked-token prediction, tagging); :meth:`hidden_states` gives ``[B, T, d_model]``.
    Encodings that take ``bidirectional`` (T5) get ``bidirectional=True``.
    """

    default_causal = False

    def forward(
        self,
        tokens: Tensor,
        positions: Tensor | None = None,
        key_padding_mask: Tensor | None = None,
        document_ids: Tensor | None = None,
    ) -> Tensor:
        """Logits ``[B, T, V]``; padded keys (``key_padding_mask`` True) are never attended to."""
        hidden = self.hidden_states(
            tokens, positions=positions, key_padding_mask=key_padding_mask, document_ids=document_ids
        )
        return self.head(hidden)
