"""A layer's own head size (``MultiheadAttention(head_dim=D)``, ``LayerSpec.head_dim``; Gemma 4's
global layers): ``q_proj`` ``E -> H·D``, ``out_proj`` ``H·D -> E``, logits scaled by ``1/sqrt(D)``.

References: the attention written out here in float64 (projections, softmax, GQA by repeating the
key heads); the layer's full call for cached decoding and for the compiled-style decode step.
(Shapes against HF Gemma 4: tests/test_model_patterns.py.)
"""

from __future__ import annotations

import math

import pytest
import torch

import posenc
from posenc.layers.decode import StaticDecodeStep
from posenc.layers.patterns import LayerSpec

E, H, HKV, D = 24, 4, 2, 10  # D * H = 40 != E


def _layer(**options) -> posenc.MultiheadAttention:
    torch.manual_seed(0)
    return posenc.MultiheadAttention(
        E, H, "nope", causal=True, num_kv_heads=HKV, head_dim=D, **options
    ).double()


def test_wide_heads_equal_attention_written_out():
    layer = _layer()
    assert layer.q_proj.weight.shape == (H * D, E) and layer.k_proj.weight.shape == (HKV * D, E)
    assert layer.out_proj.weight.shape == (E, H * D)
    x = torch.randn(2, 7, E, dtype=torch.float64)
    q = layer.q_proj(x).view(2, 7, H, D).transpose(1, 2)
    k = layer.k_proj(x).view(2, 7, HKV, D).transpose(1, 2).repeat_interleave(H // HKV, dim=1)
    v = layer.v_proj(x).view(2, 7, HKV, D).transpose(1, 2).repeat_interleave(H // HKV, dim=1)
    logits = q @ k.transpose(-1, -2) / math.sqrt(D)
    logits = logits.masked_fill(torch.ones(7, 7, dtype=torch.bool).triu(1), float("-inf"))
    want = layer.out_proj((logits.softmax(-1) @ v).transpose(1, 2).reshape(2, 7, H * D))
    torch.testing.assert_close(layer(x), want, rtol=1e-12, atol=1e-12)


def test_wide_heads_decode_as_the_full_call_and_the_decode_step():
    layer = posenc.MultiheadAttention(E, H, "rope", causal=True, num_kv_heads=HKV, head_dim=D).double().eval()
    x = torch.randn(2, 9, E, dtype=torch.float64)
    with torch.no_grad():
        full = layer(x)
        cache = posenc.KVCache(max_length=12)
        steps = [layer(x[:, :5], cache=cache)]
        step = StaticDecodeStep(layer, cache)
        steps += [step(x[:, t : t + 1], step.next_position()) for t in range(5, 9)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-10, atol=1e-10)


def test_a_model_gives_each_layer_its_head_size():
    pattern = [LayerSpec("rope"), LayerSpec("rope", head_dim=D, num_kv_heads=1), LayerSpec("rope")]
    model = posenc.TransformerLM(11, E, 3, H, num_kv_heads=HKV, pattern=pattern)
    assert [(b.attn.head_dim, b.attn.num_kv_heads) for b in model.blocks] == [(6, 2), (D, 1), (6, 2)]
    assert model.blocks[1].attn.encoding.head_dim == D  # the rotation is built for the layer's head
    tokens = torch.randint(0, 11, (2, 8))
    with torch.no_grad():
        full = model(tokens)
        cache = posenc.KVCache()
        steps = [model(tokens[:, :4], cache=cache)] + [
            model(tokens[:, t : t + 1], cache=cache) for t in range(4, 8)
        ]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    ("build", "needle"),
    [
        (lambda: posenc.MultiheadAttention(E, H, head_dim=0), "head_dim must be positive"),
        (lambda: posenc.MultiheadAttention(E, 5, "nope"), "pass head_dim= for another head size"),
        (lambda: posenc.MultiheadAttention(E, H, head_dim=2.5), "head_dim must be an int"),
        (
            lambda: posenc.MultiheadAttention(E, H, "rope", pattern=LayerSpec("rope", head_dim=8)),
            "pattern: head_dim and num_kv_heads are the layer's sizes",
        ),
    ],
)
def test_bad_head_sizes_are_refused_by_name(build, needle):
    with pytest.raises(ValueError) as err:
        build()
    assert needle in str(err.value)
