"""The ``blocked`` (BIAS) and ``relative`` (CONTENT) backends and the fused RoPE kernel.

References are independent: the attention formula written in the test (``_bias_fixtures``) with
the bias from each test encoding's own closed form, eager attention for the CONTENT blocks, and HF
``apply_rotary_pos_emb`` for RoPE. Block sizes are tiny so that every case spans several blocks.
"""

from __future__ import annotations

import pytest
import torch

import posenc
from posenc.backends import AttentionRequest
from posenc.backends.eager import EagerBackend
from posenc.backends.relative import relative_attention
from posenc.examples import build_example

H, D = 2, 8


def _qkv(batch, q_len, k_len, kv_heads=H, dtype=torch.float64):
    make = lambda heads, length: torch.randn(batch, heads, length, D, dtype=dtype, requires_grad=True)  # noqa: E731
    return make(H, q_len), make(kv_heads, k_len), make(kv_heads, k_len)


# ---------------------------------------------------------------------------- relative (CONTENT)

#: CONTENT encodings of positions and content (an input-dependent transform, PaTH, runs on eager and
#: its own backend: tests/encodings/test_path.py).
CONTENT = [
    name
    for name in posenc.available()
    if posenc.get_class(name).kind is posenc.Kind.CONTENT and not posenc.get_class(name).input_dependent
]


@pytest.mark.parametrize("name", CONTENT)
@pytest.mark.parametrize("padded", [False, True])
def test_relative_blocks_match_eager(name, padded):
    layer = posenc.MultiheadAttention(
        H * D, H, build_example(name, num_heads=H, head_dim=D), causal=True
    ).double()
    q, k, v = _qkv(2, 29, 29)
    padding = None
    if padded:
        padding = torch.zeros(2, 29, dtype=torch.bool)
        padding[1, :3] = True
    req = AttentionRequest.from_keywords(
        q=q,
        k=k,
        v=v,
        encoding=layer.encoding,
        q_pos=torch.arange(29)[None],
        k_pos=torch.arange(29)[None],
        scale=layer.scale,
        causal=True,
        key_padding_mask=padding,
        layer=layer,
    )
    out = relative_attention(req, block=6, use_checkpoint=True)
    ref, _ = EagerBackend().run(req)
    torch.testing.assert_close(out, ref, rtol=1e-9, atol=1e-10)
    inputs = [q, k, v] + [p for p in layer.parameters() if p.requires_grad]
    weight = torch.randn_like(out)
    got = torch.autograd.grad((out * weight).sum(), inputs, allow_unused=True)
    want = torch.autograd.grad((ref * weight).sum(), inputs, allow_unused=True)
    for g, w in zip(got, want):
        if w is None:
            assert g is None or not g.abs().any()
        else:
            torch.testing.assert_close(g, w, rtol=1e-8, atol=1e-10)
