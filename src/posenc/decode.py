"""A decode step ``torch.compile`` traces whole: :class:`StaticDecodeStep`.

:class:`~posenc.MultiheadAttention` decides per call (shapes, masks, checks for nan, the backend), and
its :class:`~posenc.KVCache` hands the kernel keys that grow by one each step. That suits any request
but costs Python on every token. A generation loop asks the same question thousands of times: one
query, the same layer, the next position. :class:`StaticDecodeStep` answers it with fixed shapes, as
HF's ``StaticCache`` does for ``torch.compile``:

* the keys and values live in the ``[B, Hkv, N, D]`` buffers of a ``KVCache(max_length=N)`` (the
  prompt goes through the layer as usual, then the step takes over the same cache);
* each step writes its key and value at ``position`` with ``index_copy_`` and attends over all ``N``
  slots, the unwritten ones hidden by a mask built from ``position`` (a tensor, not a Python int);
* the token is encoded at the position after the cached token before it (the prompt's positions,
  whatever they were, continued), the slot only decides where it is written and what it sees;
* nothing reads a tensor's value in Python, so ``torch.compile(step, fullgraph=True)`` traces one graph
  and reuses it for every position.

Attention is written out (``q k^T``, softmax, ``p v``) in float32 or wider, so nan and inf propagate as
in the eager reference backend; a fused kernel may turn them into finite numbers. The step serves
rotary, absolute and position-only bias encodings (and none) in causal layers without windows, chunks,
sinks, a query temperature or padding; any other layer is refused with the reason. After the steps,
:meth:`StaticDecodeStep.sync` tells the cache how many tokens it holds, so the layer can go on eagerly.

Example (``docs/decoding.md`` has the measured speed)::

    layer = posenc.MultiheadAttention(256, 8, "rope", causal=True).eval()
    cache = posenc.KVCache(max_length=512)
    with torch.no_grad():
        out = layer(prompt, cache=cache)                  # the prompt, eagerly
        step = StaticDecodeStep(layer, cache)
        compiled = torch.compile(step, fullgraph=True)
        for i in range(new_tokens):
            out = compiled(x_i, step.next_position())     # [B, 1, E]
        step.sync()                                        # the cache now holds every token
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .base import Kind
from .cache import KVCache

__all__ = ["StaticDecodeStep"]


class StaticDecodeStep(nn.Module):
    """One-token decode steps of ``layer`` on the preallocated buffers of ``cache``, in fixed shapes.

    Args:
        layer: a causal :class:`~posenc.MultiheadAttention` (no window, chunk, sinks, query
            temperature; a rotary, absolute, position-only bias encoding, or none).
        cache: a ``KVCache(max_length=N)`` that ``layer`` has written (the prompt), without padding or
            document ids.

    Call: ``step(x [B, 1, E], position)`` with ``position`` a 0-d int64 tensor, the token's slot in the
    buffers (:meth:`next_position`), returns ``[B, 1, E]``: the layer's output for that token, its key
    and value written into the slot. The token is encoded at the position after the cached token
    before it: a prompt run at ``positions=arange(100, 105)`` is continued at 105, 106, ...
    """

    def __init__(self, layer: nn.Module, cache: KVCache) -> None:
        super().__init__()
        problems = _unsupported(layer, cache)
        if problems:
            raise ValueError("StaticDecodeStep cannot serve this layer: " + "; ".join(problems))
        entry = cache.get(layer.layer_idx)
        entry.check_reader(
            layer,
            what=f"the self-attention entry of layer_idx={layer.layer_idx}",
            batch=entry.k.shape[0],
            device=layer.q_proj.weight.device,
            fresh="KVCache",
        )
        self.layer, self.cache, self.entry = layer, cache, entry
        axes = entry.axes
        self.k_buffer, self.v_buffer, self.pos_buffer = (axes[n].buffer for n in ("k", "v", "k_pos"))
        self.max_length = self.k_buffer.shape[2]
        # the step at slot s encodes position s + offset (per row), the position after the last
        # cached token's: the prompt may sit at any positions
        self._offset = self.pos_buffer.new_zeros(self.pos_buffer.shape[0], 1)
        self._continue_from(axes["k"].length)

    def next_position(self) -> Tensor:
        """The slot of the next token, as the 0-d int64 tensor the step takes."""
        if self._written >= self.max_length:
            raise ValueError(
                f"StaticDecodeStep: the cache's max_length={self.max_length} tokens are written; "
                "build the cache with a larger max_length"
            )
        position = torch.tensor(self._written, device=self.k_buffer.device)
        self._written += 1
        return position

    def rewind(self, length: int) -> None:
        """Forget the tokens after the first ``length`` (a rejected speculative draft, a benchmark's
        next repeat): the next step writes at slot ``length``."""
        if isinstance(length, bool) or not isinstance(length, int) or not 0 <= length <= self._written:
            raise ValueError(
                f"StaticDecodeStep.rewind: length must be an int in [0, {self._written}], got {length!r}"
            )
        self._continue_from(length)

    def sync(self) -> None:
        """Record in the cache the tokens the steps wrote, so the layer (eager) continues after them."""
        written = self._written
        for axis in self.entry.axes.values():
            axis.length = written
        self.entry.refresh_views()
        self.entry.finite.finite = False  # the steps checked nothing: the next eager call checks all

    def _continue_from(self, length: int) -> None:
        """Write the next token at slot ``length``, at the position after the token in slot ``length - 1``."""
        self._written = length
        before = self.pos_buffer[:, length - 1 : length] + 1 - length if length else self.pos_buffer[:, :1]
        self._offset.copy_(before)  # in place: a compiled graph reads this tensor

    def forward(self, x: Tensor, position: Tensor) -> Tensor:
        layer = self.layer
        batch = x.shape[0]
        pos = position.reshape(1, 1) + self._offset  # [B, 1]: the token's position, not its slot
        encoding = layer.encoding
        if encoding.kind is Kind.ABSOLUTE:
            x = encoding.embed(x, pos.expand(batch, 1))
        q = layer._heads(layer.q_proj(x), layer.num_heads)
        k = layer._heads(layer.k_proj(x), layer.num_kv_heads)
        v = layer._heads(layer.v_proj(x), layer.num_kv_heads)
        if encoding.kind is Kind.ROTARY:
            q, k = encoding.rotate(q, k, pos, pos)
        if k.dtype != self.k_buffer.dtype:  # a dtype, not a value: compiled graphs check it too
            raise ValueError(
                f"StaticDecodeStep: the cache holds {self.k_buffer.dtype} keys but the layer now makes "
                f"{k.dtype}; keep the layer's dtype, or prefill a fresh KVCache(max_length=...)"
            )
        index = position.reshape(1)
        self.k_buffer.index_copy_(2, index, k)
        self.v_buffer.index_copy_(2, index, v)
        self.pos_buffer.index_copy_(1, index, pos.expand(batch, 1))
        out = self._attend(q, position, pos)
        return layer.out_proj(out.transpose(1, 2).reshape(batch, 1, layer.embed_dim))

    def _attend(self, q: Tensor, position: Tensor, pos: Tensor) -> Tensor:
        """Softmax attention of ``q [B, H, 1, D]`` (at positions ``pos [B, 1]``) over every slot, those
        after ``position`` hidden."""
        layer = self.layer
        slots = torch.arange(self.max_length, device=q.device)
        wide = torch.promote_types(q.dtype, torch.float32)
        hidden = torch.zeros(self.max_length, dtype=wide, device=q.device)
        hidden = hidden.masked_fill(slots > position.reshape(()), float("-inf"))
        groups = layer.num_heads // layer.num_kv_heads
        batch = q.shape[0]
        # [B, Hkv, G, 1, D] against [B, Hkv, 1, N, D]: grouped-query heads without copying keys
        qg = q.reshape(batch, layer.num_kv_heads, groups, 1, q.shape[-1]).to(wide)
        logits = torch.matmul(qg, self.k_buffer.to(wide).unsqueeze(2).transpose(-1, -2)) * layer.scale
        logits = logits + hidden
        if layer.encoding.kind is Kind.BIAS:
            # the keys' positions as written: the prompt's may be any, not their slots
            bias = layer.encoding.bias_for_positions(pos, self.pos_buffer)  # [B, H, 1, N]
            logits = logits + bias.to(wide).reshape(batch, layer.num_kv_heads, groups, 1, self.max_length)
        probs = torch.softmax(logits, dim=-1)
        out = torch.matmul(probs, self.v_buffer.to(wide).unsqueeze(2))
        return out.reshape(batch, layer.num_heads, 1, -1).to(q.dtype)


def _unsupported(layer: nn.Module, cache: KVCache) -> list[str]:
    """Why :class:`StaticDecodeStep` cannot serve ``layer`` with ``cache`` (empty: it can)."""
    problems = []
    if not isinstance(cache, KVCache) or cache.max_length is None:
        problems.append("cache must be a posenc.KVCache(max_length=N) (preallocated buffers)")
        return problems
    if cache.streaming:
        problems.append("a streaming cache (recent_tokens) re-rotates its keys every step")
    if not getattr(layer, "causal", False):
        problems.append("the layer must be causal (each step sees the tokens before it)")
    for name in ("window", "chunk", "sinks", "query_temperature"):
        if getattr(layer, name, None) is not None:
            problems.append(f"layers with {name} are not served (use the layer itself)")
    encoding = layer.encoding
    if encoding.kind is Kind.CONTENT or encoding.input_dependent:
        problems.append(f"{encoding.name!r} computes logits from q/k or the input; use the layer itself")
    entry = cache.get(layer.layer_idx)
    if entry is None or entry.axes is None:
        problems.append(
            f"the cache holds no entry of layer_idx={layer.layer_idx}: run the prompt through the layer first"
        )
    elif entry.padding is not None or entry.document_ids is not None:
        problems.append("the cache holds padding or document ids (the step attends to every written slot)")
    elif entry.axes["k"].start != 0 or entry.evicted:
        problems.append("the cache's keys do not start at its first slot")
    return problems
