"""A decode step ``torch.compile`` traces whole: :class:`StaticDecodeStep`.

:class:`~posenc.MultiheadAttention` decides per call (shapes, masks, checks for nan, the backend), and
its :class:`~posenc.KVCache` hands the kernel keys that grow by one each step. That suits any request
but costs Python on every token. A generation loop asks the same question thousands of times: one
query, the same layer, the next position. :class:`StaticDecodeStep` answers it with fixed shapes, as
HF's ``StaticCache`` does for ``torch.compile``:

* the keys and values live in the ``[B, Hkv, N, D]`` buffers of a ``KVCache(max_length=N)`` (the
  prompt goes through the layer as usual, then the step takes over the same cache);
* each step projects its token with the layer's :meth:`~posenc.MultiheadAttention.project`, writes
  its key and value at ``position`` (:meth:`~posenc.cache.kv_cache.KVCacheEntry.write_at`, one ``index_copy_``)
  and attends over all ``N`` slots, the unwritten ones hidden by a mask built from ``position`` (a
  tensor, not a Python int);
* the token is encoded at the position after the cached token before it (the prompt's positions,
  whatever they were, continued), the slot only decides where it is written and what it sees;
* a compiled step reads no tensor's value in Python (an eager one checks ``position``'s), so
  ``torch.compile(step, fullgraph=True)`` traces one graph and reuses it for every position.

The attention is an ordinary :class:`~posenc.backends.AttentionRequest` (q, the whole buffers, the
mask of unwritten slots, in float32 or wider) run on :attr:`StaticDecodeStep.backend`, the eager
reference backend, which ``torch.compile`` traces: nan and inf propagate as in the layer's eager path
(a fused kernel may turn them into finite numbers), and soft-capping and biases are the backend's.
The step serves rotary, absolute and position-only bias encodings (and none) in causal layers whose
pattern (:attr:`~posenc.MultiheadAttention.pattern`) sets nothing but the encoding and a softcap: no
window, chunk, sinks or query temperature; and caches without padding. Any other layer is refused
with the reason. After the steps, :meth:`StaticDecodeStep.sync` tells the cache how many tokens it
holds (:meth:`~posenc.cache.kv_cache.KVCacheEntry.set_length`), so the layer can go on eagerly (before it,
the layer refuses to: its call would overwrite the steps' tokens).

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

from dataclasses import fields

import torch
from torch import Tensor, nn

from ..backends import AttentionRequest
from ..backends.run import run_attention
from ..cache.kv_cache import KVCache, check_in_place_write
from ..encodings.base import Kind, checks_values
from ..masks.attention_mask import AttentionMask, WrittenSlotsMask
from .attention import MultiheadAttention
from .patterns import LayerSpec

__all__ = ["ModelDecodeStep", "StaticDecodeStep", "compiled_decode"]


class StaticDecodeStep(nn.Module):
    """One-token decode steps of ``layer`` on the preallocated buffers of ``cache``, in fixed shapes.

    Args:
        layer: a causal :class:`~posenc.MultiheadAttention` whose pattern sets only the fields in
            :attr:`serves_pattern` (no window, chunk, sinks, query temperature), with a rotary,
            absolute or position-only bias encoding, or none.
        cache: a ``KVCache(max_length=N)`` that ``layer`` has written (the prompt), without padding or
            document ids.

    Call: ``step(x [B, 1, E], position)`` with ``position`` a 0-d int64 tensor, the token's slot in the
    buffers (:meth:`next_position`), returns ``[B, 1, E]``: the layer's output for that token, its key
    and value written into the slot. The token is encoded at the position after the cached token
    before it: a prompt run at ``positions=arange(100, 105)`` is continued at 105, 106, ...

    The step keeps the count of written tokens; :meth:`sync` hands it to the cache. Until then the
    layer refuses eager calls on the cache (they would overwrite the steps' tokens); after eager calls
    the next step continues after their tokens. Shapes, the layer's mode and grad mode are checked on
    every call (a compiled graph guards on them); ``position``'s value only in eager calls.
    """

    #: The backend every step's request runs on: one of :data:`~posenc.backends.run.TRACEABLE_BACKENDS`
    #: (the eager reference: its attention written out op by op, nan and inf propagated, soft-capping
    #: and biases served). :func:`~posenc.backends.use_backend` overrides it, as for any call.
    backend = "eager"
    #: The fields of the layer's :attr:`~posenc.MultiheadAttention.pattern` the step serves; a layer whose
    #: pattern sets any other (a window, chunk, sinks, a query temperature, or a field added later) is refused.
    serves_pattern = ("encoding", "softcap", "head_dim", "num_kv_heads", "value_from_key")

    def __init__(self, layer: MultiheadAttention, cache: KVCache) -> None:
        super().__init__()
        problems = _unsupported(layer, cache, self.serves_pattern)
        if problems:
            raise ValueError("StaticDecodeStep cannot serve this layer: " + "; ".join(problems))
        batch = cache.get(layer.layer_idx).k.shape[0]
        # read as the layer would: its writer, form, batch and device, and no other step's unsynced tokens
        entry = cache.read(layer, cross=False, batch=batch, device=layer.q_proj.weight.device)
        self.layer, self.cache, self.entry = layer, cache, entry
        self.k_buffer, self.v_buffer, self.pos_buffer = entry.buffers()
        self.max_length = self.k_buffer.shape[2]
        # the step at slot s encodes position s + offset (per row), the position after the last
        # cached token's: the prompt may sit at any positions
        self._offset = self.pos_buffer.new_zeros(self.pos_buffer.shape[0], 1)
        self._dirty = False  # steps taken (or a rewind) since the last sync(): the cache's count is stale
        self._continue_from(entry.k.shape[2])
        cache.attach_step(layer.layer_idx, self)

    @property
    def axes(self) -> dict:
        """The cache entry's time axes (``entry.axes``), kept for callers that read them; the step
        itself writes through :meth:`~posenc.cache.kv_cache.KVCacheEntry.write_at` and ``set_length``."""
        return self.entry.axes

    def next_position(self) -> Tensor:
        """The slot of the next token, as the 0-d int64 tensor the step takes (after the cache's
        tokens, including any the layer added eagerly since the last :meth:`sync`)."""
        self._follow_cache()
        if self._written >= self.max_length:
            raise ValueError(
                f"StaticDecodeStep: the cache's max_length={self.max_length} tokens are written; "
                "build the cache with a larger max_length"
            )
        position = torch.tensor(self._written, device=self.k_buffer.device)
        self._written += 1
        self._dirty = True
        return position

    def rewind(self, length: int) -> None:
        """Forget the tokens after the first ``length`` (a rejected speculative draft, a benchmark's
        next repeat): the next step writes at slot ``length``."""
        self._follow_cache()
        if isinstance(length, bool) or not isinstance(length, int) or not 0 <= length <= self._written:
            raise ValueError(
                f"StaticDecodeStep.rewind: length must be an int in [0, {self._written}], got {length!r}"
            )
        self._continue_from(length)
        self._dirty = True

    def sync(self) -> None:
        """Record in the cache the tokens the steps wrote, so the layer (eager) continues after them
        (the steps checked nothing for nan: the next eager call checks every key)."""
        entry = self._follow_cache()
        if not self._dirty:
            return  # nothing written since the last sync (the layer may have added tokens since)
        entry.set_length(self._written)
        self._dirty = False

    def unsynced(self) -> str | None:
        """Why the layer must not call the cache eagerly now (steps :meth:`sync` has not recorded), or None."""
        if not self._dirty:
            return None
        return (
            f"a StaticDecodeStep wrote tokens into its buffers since its last sync() (the step holds "
            f"{self._written} tokens, the cache records {self.cache.length(self.layer.layer_idx, cross=False)}); "
            "an eager call would overwrite them"
        )

    def _continue_from(self, length: int) -> None:
        """Write the next token at slot ``length``, at the position after the token in slot ``length - 1``."""
        self._written = length
        before = self.pos_buffer[:, length - 1 : length] + 1 - length if length else self.pos_buffer[:, :1]
        self._offset.copy_(before)  # in place: a compiled graph reads this tensor

    def _follow_cache(self):
        """The cache's current entry of the layer; with no steps since the last sync, the step
        continues after the tokens the layer added eagerly meanwhile."""
        entry = self.cache.get(self.layer.layer_idx)
        buffers = None if entry is None else entry.buffers()
        if buffers is None or buffers[0] is not self.k_buffer:
            raise ValueError(
                f"StaticDecodeStep: the cache's entry of layer_idx={self.layer.layer_idx} was replaced since "
                "this step was built (cache.reset() or another prompt); build a new StaticDecodeStep"
            )
        if not self._dirty and entry.k.shape[2] != self._written:
            self._continue_from(entry.k.shape[2])
        return entry

    def forward(self, x: Tensor, position: Tensor) -> Tensor:
        self._check_call(x, position)
        if checks_values():  # eager calls only: a compiled graph reads no value
            self._check_position_value(position)
            self._dirty = True
        layer = self.layer
        batch = x.shape[0]
        pos = position.reshape(1, 1) + self._offset  # [B, 1]: the token's position, not its slot
        encoding = layer.encoding
        if encoding.kind is Kind.ABSOLUTE:
            x = encoding.embed(x, pos.expand(batch, 1))
        q, k, v = layer.project(x)
        if encoding.kind is Kind.ROTARY:
            q, k = encoding.rotate(q, k, pos, pos)
        if k.dtype != self.k_buffer.dtype:  # a dtype, not a value: compiled graphs check it too
            raise ValueError(
                f"StaticDecodeStep: the cache holds {self.k_buffer.dtype} keys but the layer now makes "
                f"{k.dtype}; keep the layer's dtype, or prefill a fresh KVCache(max_length=...)"
            )
        check_in_place_write("StaticDecodeStep", "the layer with KVCache()", "keys", None, k, v)
        self.entry.write_at(position, k, v, pos.expand(batch, 1))
        out = self._attend(q, position, pos)
        return layer.out_proj(out.transpose(1, 2).reshape(batch, 1, layer.num_heads * layer.head_dim))

    def _check_call(self, x: Tensor, position: Tensor) -> None:
        """Refuse what the step would get wrong, from flags and shapes only (dynamo guards on them:
        the compiled graph stays whole)."""
        layer = self.layer
        if layer.training and layer.dropout > 0:
            raise ValueError(
                f"StaticDecodeStep: the layer is in training mode with dropout={layer.dropout}, which the "
                "step does not apply; call layer.eval() to decode, or train with the layer itself"
            )
        want = (self.k_buffer.shape[0], 1, layer.embed_dim)
        if not isinstance(x, Tensor) or tuple(x.shape) != want:
            raise ValueError(
                f"StaticDecodeStep: x must be [B={want[0]}, 1, E={want[2]}], {_x_problem(x, want)}"
            )
        if not isinstance(position, Tensor) or position.dim() != 0 or position.dtype != torch.int64:
            got = (
                f"shape {tuple(position.shape)} {position.dtype}"
                if isinstance(position, Tensor)
                else type(position).__name__
            )
            raise ValueError(
                f"StaticDecodeStep: position must be a 0-d int64 tensor (step.next_position()), got {got}"
            )

    def _check_position_value(self, position: Tensor) -> None:
        """An eager call's slot lies in what :meth:`next_position` handed out (below ``max_length``)."""
        slot = int(position)
        if not 0 <= slot < self.max_length:
            raise ValueError(
                f"StaticDecodeStep: position={slot} is outside the cache's max_length={self.max_length} "
                "slots; take positions from step.next_position(), or build the cache with a larger max_length"
            )
        if slot >= self._written:
            raise ValueError(
                f"StaticDecodeStep: position={slot} was not handed out by next_position() (the step holds "
                f"{self._written} tokens, and sync() records only those); take it from step.next_position()"
            )

    def _attend(self, q: Tensor, position: Tensor, pos: Tensor) -> Tensor:
        """Attention of ``q [B, H, 1, D]`` (at positions ``pos [B, 1]``) over every slot, those after
        ``position`` hidden (:class:`~posenc.masks.attention_mask.WrittenSlotsMask`): a request in float32 or wider on
        :attr:`backend`."""
        layer, batch = self.layer, q.shape[0]
        wide = torch.promote_types(q.dtype, torch.float32)
        written = (WrittenSlotsMask(position),)  # slots after ``position`` hold no token yet
        mask = AttentionMask(1, self.max_length, batch, layer.num_heads, q.device, written)
        request = AttentionRequest(
            q=q.to(wide),
            k=self.k_buffer.to(wide),
            v=self.v_buffer.to(wide),
            encoding=layer.encoding,
            q_pos=pos,
            k_pos=self.pos_buffer,  # the keys' positions as written: the prompt's may be any, not their slots
            scale=layer.scale,
            mask=mask,
            layer=layer,
            softcap=layer.softcap,
        )
        _, out, _ = run_attention(request, self.backend)
        return out.to(q.dtype)


def _x_problem(x: object, want: tuple[int, int, int]) -> str:
    """What is wrong with a step's ``x`` (not ``want``), and what to do instead."""
    if not isinstance(x, Tensor):
        return f"got {type(x).__name__}"
    got = f"got {tuple(x.shape)}"
    if x.dim() == 3 and x.shape[0] != want[0]:
        return f"{got}: the cache holds a batch of {want[0]}; a new batch needs a fresh KVCache and step"
    if x.dim() == 3 and x.shape[1] != 1:
        return f"{got}: one token per step; run several tokens through the layer itself, after sync()"
    return got


def _unsupported(layer: nn.Module, cache: KVCache, served: tuple[str, ...]) -> list[str]:
    """Why :class:`StaticDecodeStep` cannot serve ``layer`` with ``cache`` (empty: it can); of the
    layer's pattern, it serves the fields named in ``served``."""
    if not isinstance(layer, MultiheadAttention):
        return [f"layer must be a posenc.MultiheadAttention, got {type(layer).__name__}"]
    if not isinstance(cache, KVCache) or cache.max_length is None:
        return ["cache must be a posenc.KVCache(max_length=N) (preallocated buffers)"]
    problems = []
    if cache.streaming:
        problems.append("a streaming cache (recent_tokens) re-rotates its keys every step")
    if not layer.causal:
        problems.append("the layer must be causal (each step sees the tokens before it)")
    pattern, plain = layer.pattern, LayerSpec()
    for name in (f.name for f in fields(LayerSpec) if f.name not in served):
        if getattr(pattern, name) != getattr(plain, name):
            problems.append(
                f"layers with {name}={getattr(pattern, name)!r} are not served (use the layer itself)"
            )
    encoding = layer.encoding
    if encoding.kind is Kind.CONTENT or encoding.input_dependent:
        problems.append(f"{encoding.name!r} computes logits from q/k or the input; use the layer itself")
    if cache.streaming:
        return problems
    entry = cache.get(layer.layer_idx)
    if entry is None:
        problems.append(
            f"the cache holds no entry of layer_idx={layer.layer_idx}: run the prompt through the layer first"
        )
    elif entry.buffers() is None:
        problems.append(f"the cache's entry of layer_idx={layer.layer_idx} holds no preallocated buffers")
    elif entry.padding is not None or entry.document_ids is not None:
        problems.append("the cache holds padding or document ids (the step attends to every written slot)")
    elif entry.first_slot != 0 or entry.evicted:
        problems.append("the cache's keys do not start at its first slot")
    return problems


class ModelDecodeStep(nn.Module):
    """One greedy step of a whole :class:`~posenc.TransformerLM` in fixed shapes: gpt-fast's
    ``decode_one_token`` for posenc's own model, which ``torch.compile(fullgraph=True)`` traces whole.

    Args:
        model: a causal :class:`~posenc.TransformerLM` in eval mode whose every layer
            :class:`StaticDecodeStep` serves (no KV-shared layers).
        cache: the ``KVCache(max_length=N)`` the model has prefilled (the prompt).

    Call: ``step(token [B, 1], position)`` with ``position`` from :meth:`next_position` returns the
    logits ``[B, V]`` of the next token: the token embedded (and the model's absolute encodings added
    at its position), every block run with its layer's :class:`StaticDecodeStep`, the final norm and
    the head. :meth:`sync` records the steps' tokens in the cache.
    """

    def __init__(self, model: nn.Module, cache: KVCache) -> None:
        super().__init__()
        from .model import TransformerLM  # the model module imports this one

        if not isinstance(model, TransformerLM):
            raise ValueError(
                f"ModelDecodeStep: model must be a posenc.TransformerLM, got {type(model).__name__}"
            )
        if model.training:
            raise ValueError("ModelDecodeStep: the model is in training mode; call model.eval() to decode")
        if model._kv_handoffs:
            raise ValueError(
                "ModelDecodeStep: KV-shared layers (kv_shared_layers) are not served; use model.generate()"
            )
        self.model = model
        self.steps = nn.ModuleList(StaticDecodeStep(block.attn, cache) for block in model.blocks)

    def next_position(self) -> Tensor:
        """The slot of the next token (0-d int64), the same in every layer (all hold the prompt)."""
        slots = [step.next_position() for step in self.steps]
        return slots[0]

    def sync(self) -> None:
        """Record the steps' tokens in the cache (see :meth:`StaticDecodeStep.sync`)."""
        for step in self.steps:
            step.sync()

    def forward(self, token: Tensor, position: Tensor) -> Tensor:
        model = self.model
        x = model.token_embedding(token)
        pos = position.reshape(1, 1) + self.steps[0]._offset  # the token's position, not its slot
        for encoding in model.input_encodings:
            x = encoding.embed(x, pos.expand(x.shape[0], 1))
        for block, step in zip(model.blocks, self.steps, strict=True):
            x = x + step(block.norm_attn(x), position)
            x = x + block.ffn(block.norm_ffn(x))
        return model.head(model.final_norm(x))[:, -1]


def _decode_call(step: ModelDecodeStep, token: Tensor, position: Tensor) -> Tensor:
    return step(token, position)


_COMPILED: list = []


def compiled_decode():
    """``torch.compile(fullgraph=True)`` of one :class:`ModelDecodeStep` call, made once per process:
    the step is an argument, so a new step (a new cache, the next ``generate``) of the same shapes
    reuses the graph (its parameters and buffers are the graph's inputs, not constants)."""
    if not _COMPILED:
        _COMPILED.append(torch.compile(_decode_call, fullgraph=True))
    return _COMPILED[0]
