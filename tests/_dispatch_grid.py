"""The dispatch grid's requests: ``build(case)`` makes the request a case string names and
``EXPECTED`` the engine ``auto`` picks for each (tests/backends/test_dispatch.py asks ``auto``; the memo
tests ask it again through the memo)."""

from __future__ import annotations

import torch

import posenc
from posenc.backends import AttentionRequest

HEADS, DIM = 2, 8


def build(case: str) -> AttentionRequest:
    """The request named ``case``: ``spec|length|options`` with options among causal, padding,
    window=N (a band without causal), documents=N, dropout, nan, sinks, offset=N (cache), bfloat16, float64."""
    spec, length, *options = case.split("|")
    length = int(length)
    opts = dict(o.split("=") if "=" in o else (o, "1") for o in options)
    dtype = {"bfloat16": torch.bfloat16, "float64": torch.float64}.get(
        next((o for o in opts if o in ("bfloat16", "float64")), ""), torch.float32
    )
    causal = "causal" in opts
    layer = posenc.MultiheadAttention(HEADS * DIM, HEADS, spec, causal=causal)
    torch.manual_seed(0)
    offset = int(opts.get("offset", 0))
    q = torch.randn(1, HEADS, length, DIM, dtype=dtype)
    k = torch.randn(1, HEADS, length + offset, DIM, dtype=dtype)
    if "nan" in opts:
        q[0, 0, 3, 0] = float("nan")
    q_pos = torch.arange(offset, offset + length)[None]
    k_pos = torch.arange(length + offset)[None]
    extra = {}
    if "padding" in opts:
        extra["key_padding_mask"] = torch.zeros(1, length + offset, dtype=torch.bool)
        extra["key_padding_mask"][0, :5] = True
    if "window" in opts or "documents" in opts:
        mask_options = {}
        if "window" in opts:
            mask_options["window"] = int(opts["window"])
        else:
            docs = (torch.arange(length) * int(opts["documents"]) // length)[None]
            mask_options = {"q_document_ids": docs, "k_document_ids": docs}
        extra["mask"] = posenc.masks.attention_mask.AttentionMask.build(
            q_len=length, k_len=length, batch=1, heads=HEADS, causal=causal, **mask_options
        )
    make = AttentionRequest  # with the mask built above
    if "mask" not in extra:
        make = AttentionRequest.from_keywords
        extra.update(causal=causal, causal_offset=offset if causal else 0)
    return make(
        q=q,
        k=k,
        v=k.clone(),
        encoding=layer.encoding,
        q_pos=q_pos,
        k_pos=k_pos,
        scale=DIM**-0.5,
        dropout_p=0.1 if "dropout" in opts else 0.0,
        sinks=torch.zeros(HEADS, dtype=dtype) if "sinks" in opts else None,
        layer=layer,
        **extra,
    )


#: request -> the engine that ran before (the rule that decides).
EXPECTED = {
    # BIAS kinds: blocked from 256x256 logits, its near/far split from 1024 square queries.
    "alibi|128|causal": "sdpa",  # blocked declines below 256x256
    "alibi|300|causal": "blocked",  # near/far only from 1024 queries
    "alibi|1100|causal": "near_far",
    "alibi:mode=symmetric|1100": "near_far",  # no mask: both far sides
    "alibi|1100|causal|sinks": "near_far",  # sinks merge through the log-sum-exp
    "alibi|1100|causal|bfloat16": "near_far",  # a CPU flash dtype
    "t5|1100|causal": "near_far",  # far constant
    "t5:bidirectional=true|1100": "near_far",
    "t5|1100|causal|float64": "near_far",
    "t5|1100|causal|padding": "blocked",  # near/far needs a plain causal mask or none
    "t5|1100|causal|offset=100": "blocked",  # not square (a cache)
    "t5|1100|causal|dropout": "sdpa",  # blocked refuses dropout; flex declines on CPU
    "t5|1100|causal|nan": "eager",  # blocked and sdpa refuse nan on CPU
    "kerple|1100|causal": "blocked",  # neither a far constant nor separable terms
    # Kinds without a bias: blocked only where the mask hides most keys; then segments if cheaper.
    "rope|700|causal": "sdpa",  # plain causal: one sdpa call
    "rope|700": "sdpa",  # no mask
    "rope|128|causal|window=16": "sdpa",  # below 256x256
    "rope|700|causal|window=64": "segments",
    "rope|700|causal|window=64|float64": "segments",
    "rope|1024|causal|documents=8": "segments",
    "rope|700|causal|window=64|dropout": "sdpa",  # blocked refuses dropout
    "rope|700|causal|padding": "segments",  # the masked blocks skip enough; segments cost no more
    "nope|2048|causal|window=512": "segments",
    # A window without causal is a band (issue 36): the window engines skip the keys outside it.
    "rope|700|window=64": "segments",
    "rope|2048|window=256": "segments",
    "rope|700|window=64|dropout": "sdpa",  # blocked and segments refuse dropout
    "alibi:mode=symmetric|1100|window=64": "blocked",  # near/far needs a plain causal mask or none
    "t5:bidirectional=true|1100|window=64": "blocked",
    # CONTENT kinds: relative, its clipped split from 512 queries and 8 near blocks.
    "shaw:k=16|600|causal": "clipped",
    "shaw:k=16|600": "clipped",
    "shaw:k=16|300|causal": "relative",  # below 512 queries
    "shaw:k=16|600|causal|padding": "relative",  # clipped needs a plain causal mask or none
    "shaw:k=16|600|causal|bfloat16": "relative",  # clipped runs float32 or float64
    "shaw:k=16|600|causal|sinks": "relative",  # no sinks in the clipped split
    "shaw:k=16|600|causal|nan": "relative",  # nan: the query blocks propagate it
    "shaw:k=16|600|causal|dropout": "eager",  # relative refuses dropout
    "shaw:k=None,max_len=700|600|causal": "relative",  # no clipped tables
    "deberta|1100|causal": "relative",  # near blocks of 505 rows: fewer than 8
    "deberta:position_buckets=-1,max_relative_positions=256|2040|causal": "clipped",
}
