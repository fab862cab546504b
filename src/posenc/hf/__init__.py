"""posenc inside HF transformers models: an attention implementation, ``attn_implementation="posenc"``.

:func:`register` adds posenc's attention to HF's ``AttentionInterface`` (and its mask builder to
``AttentionMaskInterface``) under the name ``"posenc"``. A model loaded or switched to it
(``model.set_attn_implementation("posenc")``) then runs every attention call through posenc's
backends (:mod:`posenc.backends`): the dispatcher picks the fastest one that can serve the call, and
attention sinks (gpt-oss's ``s_aux``) and logit soft-capping (Gemma 2's ``softcap``, by the backends
that form each logit: blocked, eager, flex) are served exactly.

What HF hands the attention function: ``query [B, H, Tq, D]`` and ``key``/``value [B, Hkv, Tk, D]``,
already rotated by the model's own rotary embedding (so posenc adds no position term: the request's
encoding is NoPE), and the mask HF's ``sdpa_mask`` builds from the model's own mask functions (causal,
sliding window, chunks, packed sequences, padding), a bool ``[B, 1, Tq, Tk]`` (True = attend) or None for
a plain causal mask. The rules for None follow HF's sdpa implementation: causal when ``Tq > 1`` (keys
past the first ``Tq`` are empty static-cache slots), no mask for a single query. posenc's mask builder
(``hf/_masks.py``) also leaves a plain sliding window unbuilt (a fresh, unpadded, unpacked prefill of
a model whose attention calls were seen to carry ``sliding_window``: from its second forward on; PhiMoE's
carry none and always get the window built): the layer gets None, and its ``sliding_window`` keyword
(HF's, as HF's flash attention reads it) makes the call causal with that window, which posenc's window
backends serve without a dense mask. A model whose own attention adds the mask to its scores (MPNet:
not routed through ``AttentionInterface``) gets HF's eager mask and a warning: it runs as with
``attn_implementation="eager"``, until :func:`use_posenc_attention` serves it. Cached generation over a right-padded ``attention_mask`` is warned of
(pad on the left); a swapped layer refuses 3-D ``position_ids`` (M-RoPE's axes are never guessed). T5's relative bias
arrives as ``position_bias`` (dense, trainable) and is added to the logits as a float mask; for
T5's structured path (no dense bias) use :func:`use_posenc_attention`.

transformers is optional (``pip install posenc[hf]``): importing this module does not import it;
:func:`register` does, and says how to install it when it is missing.

Not served (a ValueError naming it): HF's paged cache (continuous batching).

:func:`swap_encoding` replaces the rotary embedding of a Llama-family model (a decoder with one
``rotary_emb`` and layers whose ``self_attn`` rotates q and k with it) by any posenc encoding, one
spec for every layer or one per layer: the model's own rotation becomes the identity, and each
layer's attention applies its posenc encoding inside :func:`attention_forward` (rotations of q and
k, biases, relative terms) at the positions HF gives (``position_ids``). Keys then sit in HF's cache
unrotated; the layer keeps their positions beside the cache and places the keys of each call by the
cache's length, so a cropped cache (assisted generation's rejected drafts) and a sliding window
continue at the right positions; a static cache is refused. It also serves BERT and MPNet encoders:
an in-attention spec acts in every layer (MPNet: in place of its relative bias) and the learned table
is removed unless ``keep_absolute=True``; an ABSOLUTE spec replaces BERT's table; a warning says
what changed. :func:`set_rope_scaling` changes the RoPE scaling
of a loaded model in place, as if it had been loaded with those ``rope_parameters``;
:func:`switch_rope_pairing_` moves a swapped model's RoPE to the interleaved pairing (q/k rows
permuted, logits unchanged).

:func:`use_posenc_attention` serves bias models whose bias HF computes outside the attention
function, BLOOM (ALiBi), T5 / mT5 and MPNet (relative buckets), through posenc's own encodings: the
bias is never a dense ``[B, H, L, L]`` tensor, and T5's and MPNet's tables stay HF's parameters.
"""

from __future__ import annotations

from ._attention import ATTN_IMPLEMENTATION, attention_forward, register
from ._bias_models import use_posenc_attention
from ._common import last_backend
from ._swap import rope_layer_types, set_rope_scaling, swap_encoding, switch_rope_pairing_

__all__ = [
    "ATTN_IMPLEMENTATION",
    "attention_forward",
    "last_backend",
    "register",
    "rope_layer_types",
    "set_rope_scaling",
    "swap_encoding",
    "switch_rope_pairing_",
    "use_posenc_attention",
]
