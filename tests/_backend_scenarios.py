"""The request scenarios the backend tests share (tests/test_backends.py runs every backend on them,
tests/backends/test_segments.py the segment split): one token, 37 causal tokens with grouped-query heads,
key padding, 113 x 203 cross-attention, user masks with rows that see no key, windows, documents, image
groups and chunks; the example layer of an encoding, its request for a scenario, and a run's output and
gradients."""

from __future__ import annotations

import torch

import posenc
from posenc.backends import AttentionRequest, get_backend
from posenc.backends.flex import flex_bias_attention
from posenc.encodings.base import TokenStates
from posenc.examples import build_example
from posenc.masks.attention_mask import AttentionMask

HEADS, HEAD_DIM = 2, 8


SCENARIOS = {
    # name: (batch, q_len, k_len, causal, kv_heads, padded, mask); causal-only encodings run the
    # self-attention scenarios causally (padded37 then has query rows that see no key).
    "single": (2, 1, 1, True, HEADS, False, None),
    "causal37_gqa": (2, 37, 37, True, 1, False, None),
    "padded37": (2, 37, 37, False, HEADS, True, None),
    "cross113x203": (2, 113, 203, False, HEADS, False, None),
    "masked29": (2, 29, 29, True, HEADS, False, "bool_and_minus_inf"),
    "sinks_gqa29": (2, 29, 29, True, 1, True, "sinks"),
    # A sliding window and packed documents (blocked skips keys outside each block's range).
    "window_documents41": (2, 41, 41, True, HEADS, False, "window_documents"),
    # Issue 36's masks: a bidirectional window over a left-padded batch, Gemma 3's image groups
    # under a sliding window, Llama 4's chunks counted from each row's first real token.
    "band_padded37": (2, 37, 37, False, HEADS, True, "band"),
    "groups_window29": (2, 29, 29, True, HEADS, True, "groups_window"),
    "chunks_padded33": (2, 33, 33, True, 1, True, "chunks"),
}


#: The group ids of the ``groups_window`` scenario: two images in the first row, one in the second.
_GROUPS = torch.tensor([[-1] * 3 + [0] * 6 + [-1] * 4 + [1] * 9 + [-1] * 7, [-1] * 12 + [0] * 11 + [-1] * 6])


def _example(name: str, causal: bool):
    """The example encoding for a layer of the test's size, or None where the layer refuses it."""
    enc = build_example(name, num_heads=HEADS, head_dim=HEAD_DIM)
    return None if enc.causal_only and not causal else enc


def _scenario_fits(name: str, scenario: str) -> bool:
    _, q_len, k_len, causal, *_ = SCENARIOS[scenario]
    enc = _example(name, causal) or (_example(name, True) if q_len == k_len else None)
    if enc is not None and enc.self_attention_only and scenario.startswith("cross"):
        return False
    return enc is not None and (enc.max_positions is None or max(q_len, k_len) <= enc.max_positions)


def _layer(name: str, causal: bool, kv_heads: int, dtype: torch.dtype) -> posenc.MultiheadAttention:
    enc = build_example(name, num_heads=HEADS, head_dim=HEAD_DIM)
    layer = posenc.MultiheadAttention(
        HEADS * HEAD_DIM, HEADS, encoding=enc, causal=causal, num_kv_heads=kv_heads
    )
    with torch.no_grad():  # zero-initialised tables would hide position terms
        for param in layer.encoding.parameters():
            if param.numel() and bool((param == 0).all()):
                param.normal_(0.0, 0.5)
    return layer.to(dtype)


def _user_mask(batch: int, q_len: int, k_len: int, dtype: torch.dtype) -> torch.Tensor:
    """A float mask with random values, keys hidden by -inf, and rows that see no key."""
    mask = torch.randn(batch, HEADS, q_len, k_len, dtype=dtype)
    mask[torch.rand(batch, HEADS, q_len, k_len) > 0.7] = float("-inf")
    mask[0, 1, 4] = float("-inf")  # a whole row hidden
    mask[1, :, 11] = float("-inf")
    return mask


def _request(layer, scenario: str, causal: bool, dtype: torch.dtype, grad: bool) -> AttentionRequest:
    batch, q_len, k_len, _, kv_heads, padded, mask = SCENARIOS[scenario]
    q = torch.randn(batch, HEADS, q_len, HEAD_DIM, dtype=dtype, requires_grad=grad)
    k = torch.randn(batch, kv_heads, k_len, HEAD_DIM, dtype=dtype, requires_grad=grad)
    v = torch.randn(batch, kv_heads, k_len, HEAD_DIM, dtype=dtype, requires_grad=grad)
    padding = None
    if padded:
        padding = torch.zeros(batch, k_len, dtype=torch.bool)
        padding[1, :5] = True  # left padding of the second sequence
    pattern = {}
    if mask == "window_documents":
        docs = torch.tensor([[0] * 17 + [1] * 24, [0] * 3 + [2] * 30 + [5] * 8])
        pattern = {"mask": AttentionMask.build(
            q_len=q_len, k_len=k_len, batch=batch, heads=HEADS, causal=causal, window=6,
            q_document_ids=docs, k_document_ids=docs,
        )}  # fmt: skip
    pattern_masks = {
        "band": {"window": 4},
        "groups_window": {"window": 5, "group_ids": _GROUPS},
        "chunks": {"chunk": 6},
    }
    if mask in pattern_masks:
        pattern = {"mask": AttentionMask.build(
            q_len=q_len, k_len=k_len, batch=batch, heads=HEADS, causal=causal, key_padding_mask=padding,
            **pattern_masks[mask],
        )}  # fmt: skip
    if layer.encoding.input_dependent:  # FoX: the states of one sequence's layer input
        x = torch.randn(batch, q_len, HEADS * HEAD_DIM, dtype=dtype)
        pattern["token_states"] = TokenStates.same_sequence(layer.encoding.token_states(x))
    if "mask" not in pattern:  # a built mask, or the keywords that describe one
        pattern["key_padding_mask"] = padding
        pattern["attn_mask"] = (
            _user_mask(batch, q_len, k_len, dtype) if mask == "bool_and_minus_inf" else None
        )
        pattern["causal"] = causal
    make = AttentionRequest if "mask" in pattern else AttentionRequest.from_keywords
    return make(
        **pattern,
        q=q,
        k=k,
        v=v,
        encoding=layer.encoding,
        q_pos=torch.arange(q_len)[None],
        k_pos=torch.arange(k_len)[None],
        scale=layer.scale,
        layer=layer,
        sinks=torch.randn(HEADS, dtype=dtype, requires_grad=grad) if mask == "sinks" else None,
    )


TOLERANCE = {torch.float64: {"rtol": 1e-6, "atol": 1e-8}, torch.float32: {"rtol": 1e-4, "atol": 1e-5}}


def _run(backend: str, req: AttentionRequest, layer, grads: bool, compiled: bool = True):
    if backend == "flex" and not compiled:
        out = flex_bias_attention(req, compiled=False)
    else:
        out, _ = get_backend(backend).run(req)
    if not grads:
        return out.detach(), []
    inputs = [req.q, req.k, req.v] + [p for p in layer.parameters() if p.requires_grad]
    if req.sinks is not None:
        inputs.append(req.sinks)
    weight = torch.linspace(-1.0, 1.0, out.numel(), dtype=out.dtype).view_as(out)
    # retain_graph: the request's token states (FoX) feed both runs through one graph.
    found = torch.autograd.grad((out * weight).sum(), inputs, allow_unused=True, retain_graph=True)
    return out.detach(), [torch.zeros_like(i) if g is None else g for i, g in zip(inputs, found)]


def _run_fn(fn, req: AttentionRequest, layer):
    out = fn(req)
    inputs = [req.q, req.k, req.v] + [p for p in layer.parameters() if p.requires_grad]
    if req.sinks is not None:
        inputs.append(req.sinks)
    weight = torch.linspace(-1.0, 1.0, out.numel(), dtype=out.dtype).view_as(out)
    found = torch.autograd.grad((out * weight).sum(), inputs, allow_unused=True)
    return out.detach(), [torch.zeros_like(i) if g is None else g for i, g in zip(inputs, found)]
