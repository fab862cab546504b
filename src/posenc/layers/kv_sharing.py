"""KV-shared layers (Gemma 4's ``num_kv_shared_layers``): a layer that computes no keys or values of
its own and attends with those of an earlier layer of its type, its *donor*.

Semantics (HF ``Gemma4TextConfig.kv_sharing_modes`` and ``Gemma4TextAttention``): the donor of a
shared layer is the last unshared layer before it of the same type; the shared layer projects and
rotates its own queries, and attends over exactly the keys and values its donor attended to in the
same forward (the cached ones and the new ones, before a windowed cache trims them), with its own
mask of the same shape. A layer's *type* here is what fixes its keys and its mask: its encoding
spec, window, chunk, key sizes and K = V (HF's ``sliding_attention`` / ``full_attention``; HF's
``attention_k_eq_v`` marks every full layer, shared or not). Query-side options (sinks, query
temperature, softcap) stay the shared layer's own. A K = V donor hands over its values, the copy of its
keys before the encoding acted, and the shared layer attends with them.

Cache: only the donor writes (one entry per donor, none for the layers that share it); a shared
layer reads the donor's entry through this declared link only, checked to come from the same
:class:`~posenc.KVCache` in the same forward. The donor hands its keys over through a
:class:`KVHandoff` the model clears after every forward.

Refused, naming ``kv_shared_layers``: a count outside ``[0, num_layers)``; a shared layer with no
earlier unshared layer of its type; an encoding that computes its logits or keys from the layer's
own projections or input (CONTENT and input-dependent kinds: the donor's keys cannot serve it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from torch import Tensor

from ..cache.kv_cache import KVCache, KVCacheEntry
from ..encodings.base import Kind
from .attention import AttentionInputs, MultiheadAttention
from .patterns import LayerSpec, mark_kv_shared
from .positions import embed_positions

__all__ = [
    "KVDonorAttention",
    "KVHandoff",
    "KVSharedAttention",
    "kv_donors",
    "link_kv_sharing",
    "mark_kv_shared",
]


def kv_donors(layers: Sequence[LayerSpec], encodings: Sequence[str | None]) -> dict[int, int]:
    """``{shared layer: donor}``: for each layer marked ``kv_shared``, the last unshared layer before
    it with the same encoding spec (``encodings[i]``), window, chunk, head size, KV heads and K = V."""
    donors: dict[int, int] = {}
    last: dict[tuple, int] = {}
    for i, (layer, encoding) in enumerate(zip(layers, encodings, strict=True)):
        kind = (encoding, layer.window, layer.chunk, layer.head_dim, layer.num_kv_heads, layer.value_from_key)
        if not layer.kv_shared:
            last[kind] = i
            continue
        if kind not in last:
            raise ValueError(
                f"kv_shared_layers: layer {i} reuses the keys and values of the last unshared layer of its type, "
                f"but no earlier unshared layer has encoding={encoding!r}, window={layer.window}, "
                f"chunk={layer.chunk}, head_dim={layer.head_dim}, num_kv_heads={layer.num_kv_heads}, "
                f"value_from_key={layer.value_from_key}; share "
                "fewer layers or keep one layer of that type unshared"
            )
        donors[i] = last[kind]
    return donors


class KVHandoff:
    """What a donor attended to in the current forward: the cache and its entry before the call,
    and the keys, values and key positions (and, under a streaming cache, the query positions)."""

    def __init__(self, donor_idx: int) -> None:
        self.donor_idx = donor_idx
        self.clear()

    def clear(self) -> None:
        self.filled = False
        self.cache: KVCache | None = None
        self.entry: KVCacheEntry | None = None
        self.kv: tuple[Tensor, ...] = ()

    def fill(self, cache: KVCache | None, entry: KVCacheEntry | None, *kv: Tensor) -> None:
        self.filled, self.cache, self.entry, self.kv = True, cache, entry, kv

    def taken(self, reader: MultiheadAttention, cache: KVCache | None) -> KVHandoff:
        """This handoff, checked to be filled in this forward for ``reader``'s ``cache``."""
        where = f"layer {reader.layer_idx} shares the keys and values of layer {self.donor_idx} (kv_shared_layers)"
        if not self.filled:
            raise ValueError(
                f"{where}, which has not run in this forward: run the layers through their model"
            )
        if cache is not self.cache:
            raise ValueError(f"{where}, which ran with another cache: pass both the same KVCache (or none)")
        return self


class KVDonorAttention(MultiheadAttention):
    """A layer whose keys and values later layers share: an ordinary layer that also hands what it
    attended to over to :attr:`handoff` (set by :func:`link_kv_sharing`)."""

    handoff: KVHandoff | None = None

    def _new_keys(self, x, q_pos, entry, cache, step, states, *, prefix):
        q, k, v, k_pos = super()._new_keys(x, q_pos, entry, cache, step, states, prefix=prefix)
        if self.handoff is not None:
            self.handoff.fill(cache, entry, k, v, k_pos)
        return q, k, v, k_pos

    def _streaming_inputs(self, x, entry, cache):
        inputs = super()._streaming_inputs(x, entry, cache)
        if self.handoff is not None:
            self.handoff.fill(cache, entry, inputs.k, inputs.v, inputs.q_pos, inputs.k_pos)
        return inputs


class KVSharedAttention(MultiheadAttention):
    """A layer that attends with its donor's keys and values: its own queries (projection, encoding,
    temperature), no ``k_proj`` or ``v_proj``, no cache entry of its own.

    Takes :class:`~posenc.MultiheadAttention`'s arguments; its ``pattern`` may be marked
    ``kv_shared``. Serves self-attention inside a model that links it (:func:`link_kv_sharing`).
    """

    handoff: KVHandoff | None = None

    def __init__(self, *args, pattern: LayerSpec | None = None, **kwargs) -> None:
        super().__init__(
            *args, pattern=None if pattern is None else replace(pattern, kv_shared=False), **kwargs
        )
        if self.encoding.kind is Kind.CONTENT or self.encoding.input_dependent:
            raise ValueError(
                f"kv_shared_layers: layer {self.layer_idx}'s encoding {self.encoding.name!r} computes its "
                "logits or keys from the layer's own projections or input, which another layer's keys cannot "
                "serve; share only layers with a rotary, bias or absolute encoding (or none)"
            )
        self.k_proj = None  # HF's shared layers have no k/v projections (nor norms) either
        self.v_proj = None

    @property
    def pattern(self) -> LayerSpec:
        return replace(super().pattern, kv_shared=True)

    def describe(self) -> str:
        return super().describe()[:-1] + ", kv_shared=True)"

    def _handoff(self, cache: KVCache | None) -> KVHandoff:
        if self.handoff is None:
            raise ValueError(
                f"layer {self.layer_idx} is KV-shared but linked to no donor: build it through "
                "TransformerLM(..., kv_shared_layers=N) or posenc.layers.kv_sharing.link_kv_sharing"
            )
        return self.handoff.taken(self, cache)

    def _cache_entry(self, cache, *, cross, batch, context=None):
        if cross:
            raise ValueError(
                f"layer {self.layer_idx} is KV-shared (kv_shared_layers): it serves self-attention only"
            )
        return self._handoff(
            cache
        ).entry  # the donor's entry before its call: the same past, padding, documents

    def _new_keys(self, x, q_pos, entry, cache, step, states, *, prefix):
        k, v, k_pos = self._handoff(cache).kv
        return self._queries(x, q_pos, k, k_pos), k, v, k_pos

    def _streaming_inputs(self, x, entry, cache):
        k, v, q_pos, k_pos = self._handoff(cache).kv
        past = 0 if entry is None else entry.k.shape[2]
        return AttentionInputs(self._queries(x, q_pos, k, k_pos), k, v, q_pos, k_pos, past, entry=entry)

    def _queries(self, x: Tensor, q_pos: Tensor, k: Tensor, k_pos: Tensor) -> Tensor:
        """This layer's queries ``[B, H, T, D]``, encoded at ``q_pos`` (the keys are the donor's)."""
        if self.encoding.kind is Kind.ABSOLUTE:
            x = embed_positions(self.encoding, x, q_pos)
        q = self._heads(self.q_proj(x), self.num_heads)
        if self.encoding.kind is Kind.ROTARY:  # the queries alone: no key is rotated
            q, _ = self.encoding.rotate(q, k[:, :, :0], q_pos, k_pos[..., :0])
        return q

    def key_values(self, x: Tensor) -> tuple[Tensor, Tensor]:
        raise ValueError(
            f"layer {self.layer_idx} is KV-shared (kv_shared_layers): it has no key or value projection; "
            "its keys and values are its donor's"
        )


def link_kv_sharing(layers: Sequence[MultiheadAttention], donors: dict[int, int]) -> list[KVHandoff]:
    """Give each shared layer ``layers[i]`` its donor ``layers[donors[i]]``'s handoff; returns the
    handoffs (one per donor), which the owner clears after every forward."""
    handoffs: dict[int, KVHandoff] = {}
    for reader_idx, donor_idx in donors.items():
        donor, reader = layers[donor_idx], layers[reader_idx]
        if not isinstance(donor, KVDonorAttention) or not isinstance(reader, KVSharedAttention):
            raise ValueError(
                f"kv_shared_layers: layer {reader_idx} must be a KVSharedAttention and its donor, layer "
                f"{donor_idx}, a KVDonorAttention"
            )
        if (reader.num_kv_heads, reader.head_dim) != (donor.num_kv_heads, donor.head_dim):
            raise ValueError(
                f"kv_shared_layers: layer {reader_idx} has num_kv_heads={reader.num_kv_heads}, "
                f"head_dim={reader.head_dim} but its donor, layer {donor_idx}, "
                f"{donor.num_kv_heads} and {donor.head_dim}: a shared layer reads keys of its own shape"
            )
        if donor_idx not in handoffs:
            handoffs[donor_idx] = donor.handoff = KVHandoff(donor_idx)
        reader.handoff = handoffs[donor_idx]
    return list(handoffs.values())
