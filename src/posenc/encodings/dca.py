"""Dual Chunk Attention (An et al. 2024, "Training-Free Long-Context Scaling of Large Language
Models", arXiv 2402.17463; code: HKUNLP/ChunkLlama, ``chunkllama_attn_replace.py``; the serving form:
SGLang's and vLLM's ``DualChunkRotaryEmbedding``).

The sequence is cut into chunks of ``c = chunk_size - local_size`` positions. Every key sits at its
position within its chunk, ``j mod c``; the query's position depends on the key's chunk:

* **intra-chunk** (the key in the query's chunk): ``i mod c``, so the relative position is ``i - j``;
* **successive-chunk** (the chunk just before): ``min(i mod c + c, chunk_size)``, the true distance
  clamped so that it never passes ``chunk_size``;
* **inter-chunk** (any older chunk): the constant ``min(2c - 1, chunk_size)`` (``qc[c - 1]`` of the
  successive table).

So no relative position exceeds ``chunk_size`` (the pretraining length's 3/4 in ChunkLlama), and
the nearest ``local_size`` positions keep their true distances. One softmax over the three parts
(:mod:`~posenc.encodings._rope_parts`); ChunkLlama's prefill merges the flash attentions of the
parts by their log-sum-exp, the same softmax.

Conventions:

* posenc follows ChunkLlama's three query tables, which are SGLang's ``cos_sin_q_cache``,
  ``cos_sin_qc_cache`` and ``cos_sin_qc_cache[chunk_len - 1]``; SGLang's unclamped "critical" tables
  (``qc_no_clamp``, ``q_inter``), read by its sparse kernels, are not followed.
* Chunks are counted by position (``floor(p / c)``), which is ChunkLlama's chunking by index when
  positions count from 0; a cached decode step finds its chunks from the cache's key positions.
* ChunkLlama's length-dependent ``mscale`` (``0.05·log(L / L_train) + 1`` on cos and sin past the
  pretraining length) is left out: a fixed ``scaling`` (``yarn``'s ``attention_factor``) scales
  every part alike. RoPE's options are those of ``rope``.
* A sequence within one chunk (every position below ``chunk_size - local_size``) is plain RoPE.
* Causal only (a future key takes the intra-chunk part, masked); not shift invariant.

Backends: eager and the query-blocked ``relative`` backend (CONTENT kind), with the KV cache
(unrotated keys and their positions); for square causal self-attention the ``piecewise`` backend
runs each part on its tiles through the CPU flash kernel (:mod:`posenc.backends.piecewise`).
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from ._rope_parts import ROPE_OPTION_RANGES, PartTile, PiecewiseRoPE, PositionMap, as_positions, chunk_tiles
from .registry import at_least, register
from .rope import Pairing
from .rope_scaling import RopeScaling

__functional__ = ["dca_position_maps"]


def dca_position_maps(
    q_pos: Tensor, k_pos: Tensor, chunk_size: int, local_size: int
) -> tuple[Tensor, list[PositionMap]]:
    """``(part, [intra, successive, inter])``: ``part [B|1, Tq, Tk]`` is 0 for a key in the query's
    chunk (or later), 1 in the chunk before, 2 older; every map puts the keys at ``j mod c`` and the
    queries at ``i mod c``, ``min(i mod c + c, chunk_size)`` and ``min(2c - 1, chunk_size)``
    (``c = chunk_size - local_size``)."""
    chunk = chunk_size - local_size
    behind = (q_pos // chunk)[..., :, None] - (k_pos // chunk)[..., None, :]
    part = behind.clamp(0, 2)
    keys = k_pos % chunk
    within = q_pos % chunk
    successive = (within + chunk).clamp(max=chunk_size)
    inter = as_positions(min(2 * chunk - 1, chunk_size), q_pos)
    return part, [(within, keys), (successive, keys), (inter, keys)]


@register("dca")
class DualChunkAttention(PiecewiseRoPE):
    """Dual Chunk Attention (An et al. 2024): keys at their position within a chunk; intra-, successive- and inter-chunk queries."""

    option_ranges = {**ROPE_OPTION_RANGES, "chunk_size": at_least(1), "local_size": at_least(0)}
    example_options: dict[str, Any] = {"chunk_size": 6, "local_size": 2}

    def __init__(
        self,
        head_dim: int | None = None,
        *,
        chunk_size: int,
        local_size: int,
        base: float = 10000.0,
        pairing: Pairing = "half",
        rotary_dim: int | None = None,
        partial_rotary_factor: float | None = None,
        scaling: str | RopeScaling | dict | None = None,
        rope_parameters: dict | None = None,
    ) -> None:
        """
        Args:
            head_dim: per-head size (filled in by the attention layer).
            chunk_size: ``s``, the largest relative position any pair sees (ChunkLlama: 3/4 of the
                pretraining length).
            local_size: ``l < s``; chunks hold ``c = s - l`` positions, and the successive-chunk part
                keeps true distances up to ``s`` (ChunkLlama: 1/8 of the pretraining length).

        ``base``, ``pairing``, ``rotary_dim``, ``partial_rotary_factor``, ``scaling`` and
        ``rope_parameters`` are RoPE's (:class:`~posenc.encodings.rope.RoPE`; fixed-length scalings only).
        """
        if local_size >= chunk_size:
            raise ValueError(
                f"dca: local_size={local_size} must be smaller than chunk_size={chunk_size} (a chunk holds "
                "chunk_size - local_size positions); lower local_size or raise chunk_size"
            )
        super().__init__(
            head_dim, None, base, pairing, rotary_dim, partial_rotary_factor, scaling, rope_parameters
        )
        self.chunk_size, self.local_size = chunk_size, local_size

    @property
    def chunk_len(self) -> int:
        """Positions per chunk, ``chunk_size - local_size``."""
        return self.chunk_size - self.local_size

    def parts(self, q_pos: Tensor, k_pos: Tensor) -> tuple[Tensor, list[PositionMap]]:
        return dca_position_maps(q_pos, k_pos, self.chunk_size, self.local_size)

    def part_tiles(self, first_position: int, length: int) -> list[PartTile]:
        return chunk_tiles(first_position, length, self.chunk_len)

    def preview(self) -> str:
        c, s = self.chunk_len, self.chunk_size
        return (
            f"chunk_size={s}, local_size={self.local_size}: chunks of {c} positions; keys at j mod {c}; "
            f"queries at i mod {c} (same chunk), min(i mod {c} + {c}, {s}) (chunk before), "
            f"{min(2 * c - 1, s)} (older chunks)"
        )
