"""SSMax over the keys a query sees (Nakanishi 2025; axolotl's ``scaled_softmax_attn``, ``score · (s · log n
+ b)``): ``n`` is the number of keys the query attends to, counted from its mask (``p + 1`` causal,
restarting at each packed document, ``min(p + 1, W)`` in a window, the real keys of a padded row),
not the query's position.

The reference is written here in float64: the layer's projections, the mask built with loops over
(query, key) pairs, each row's count of allowed keys, the logits of each head multiplied by
``s_h · ln n + b_h``, softmax, values, output projection.
"""

from __future__ import annotations

import math

import pytest
import torch

import posenc
from posenc.layers.patterns import LayerSpec
from posenc.layers.temperature import SSMaxTemperature, VisibleKeysScaling

E, H, D = 32, 4, 8


def _layer(**options) -> posenc.MultiheadAttention:
    torch.manual_seed(0)
    layer = posenc.MultiheadAttention(E, H, "nope", causal=True, **options).double()
    with torch.no_grad():  # a scale and bias per head that differ, so a wrong head or count shows
        layer.query_temperature.scale.copy_(torch.tensor([0.3, 0.9, 1.5, 2.0], dtype=torch.float64))
        if layer.query_temperature.bias is not None:
            layer.query_temperature.bias.copy_(torch.tensor([0.5, -0.2, 0.1, 0.0], dtype=torch.float64))
    return layer


def _allowed(batch, length, window=None, documents=None, padding=None) -> torch.Tensor:
    """``[B, T, T]`` True where query ``i`` may attend key ``j``, written pair by pair."""
    allowed = torch.zeros(batch, length, length, dtype=torch.bool)
    for b in range(batch):
        for i in range(length):
            for j in range(length):
                ok = j <= i
                ok = ok and (window is None or i - j < window)
                ok = ok and (documents is None or documents[b, i] == documents[b, j])
                ok = ok and (padding is None or not padding[b, j])
                allowed[b, i, j] = ok
    return allowed


def _reference(layer, x, allowed) -> torch.Tensor:
    batch, length, _ = x.shape
    q = layer.q_proj(x).view(batch, length, H, D).transpose(1, 2)
    k = layer.k_proj(x).view(batch, length, H, D).transpose(1, 2)
    v = layer.v_proj(x).view(batch, length, H, D).transpose(1, 2)
    counts = allowed.sum(-1).double()  # [B, T]: the keys each query sees
    s = layer.query_temperature.scale.detach()
    b = layer.query_temperature.bias
    b = torch.zeros(H, dtype=torch.float64) if b is None else b.detach()
    factor = s[None, :, None] * torch.log(counts.clamp_min(1))[:, None, :] + b[None, :, None]  # [B, H, T]
    logits = (q @ k.transpose(-1, -2)) / math.sqrt(D) * factor[..., None]
    logits = logits.masked_fill(~allowed[:, None], float("-inf"))
    out = torch.nan_to_num(logits.softmax(-1)) @ v  # a padded query row sees no key
    return layer.out_proj(out.transpose(1, 2).reshape(batch, length, E))


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("case", ["causal", "window", "documents", "documents+window", "padding"], ids=str)
def test_ssmax_scales_each_query_by_the_log_of_the_keys_it_sees(case, bias):
    torch.manual_seed(1)
    window = 3 if "window" in case else None
    layer = _layer(window=window, query_temperature=SSMaxTemperature(bias=bias))
    x = torch.randn(2, 9, E, dtype=torch.float64)
    documents = (
        torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2, 2], [0, 0, 0, 0, 0, 0, 1, 1, 1]]) if "doc" in case else None
    )
    padding = torch.tensor([[True, True] + [False] * 7, [False] * 9]) if case == "padding" else None
    with torch.no_grad():
        got = layer(x, document_ids=documents, key_padding_mask=padding)
        want = _reference(layer, x, _allowed(2, 9, window, documents, padding))
    rows = slice(None) if padding is None else (slice(None), slice(2, None))
    if padding is not None:
        torch.testing.assert_close(got[1], want[1], rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(got[0, 2:], want[0, 2:], rtol=1e-10, atol=1e-10)
    else:
        torch.testing.assert_close(got[rows], want[rows], rtol=1e-10, atol=1e-10)


def test_the_count_is_not_the_position():
    """At given positions far from 0 (a shifted prompt) the count stays the keys seen, 1..T."""
    layer = _layer(query_temperature=SSMaxTemperature())
    x = torch.randn(1, 6, E, dtype=torch.float64)
    with torch.no_grad():
        at_zero = layer(x)
        far = layer(x, positions=torch.arange(1000, 1006))
    torch.testing.assert_close(far, at_zero, rtol=1e-12, atol=1e-12)  # NoPE: only n could differ


@pytest.mark.parametrize("window", [None, 3])
def test_cached_decoding_equals_the_full_pass(window):
    layer = _layer(window=window, query_temperature=SSMaxTemperature(bias=True))
    x = torch.randn(2, 10, E, dtype=torch.float64)
    with torch.no_grad():
        full = layer(x)
        cache = posenc.KVCache()
        steps = [layer(x[:, :4], cache=cache)] + [layer(x[:, t : t + 1], cache=cache) for t in range(4, 10)]
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-12, atol=1e-12)


def test_the_scale_and_bias_learn_and_each_layer_of_a_model_has_its_own():
    layer = _layer(query_temperature=SSMaxTemperature(bias=True))
    layer(torch.randn(1, 5, E, dtype=torch.float64)).sum().backward()
    assert (
        layer.query_temperature.scale.grad.abs().sum() > 0 and layer.query_temperature.bias.grad is not None
    )
    pattern = [LayerSpec("rope", temperature=SSMaxTemperature())] * 2
    model = posenc.TransformerLM(17, E, 2, H, pattern=pattern)
    first, second = (block.attn.query_temperature for block in model.blocks)
    assert isinstance(first, VisibleKeysScaling) and first is not second
    assert model.blocks[0].attn.pattern.temperature == SSMaxTemperature()
    assert torch.equal(first.scale, torch.full((H,), 0.43))  # the paper's initial s


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: SSMaxTemperature(scale_init=math.nan), "scale_init must be finite"),
        (lambda: SSMaxTemperature(scale_init="1"), "scale_init must be a number"),
        (lambda: SSMaxTemperature(bias=1), "bias must be True or False"),
        (lambda: VisibleKeysScaling(H).factors(torch.arange(3)[None]), "number of keys each query sees"),
        (
            lambda: posenc.MultiLatentAttention(
                64,
                4,
                kv_lora_rank=8,
                qk_nope_head_dim=8,
                qk_rope_head_dim=8,
                v_head_dim=8,
                query_temperature=SSMaxTemperature(),
            ),
            "served by posenc.MultiheadAttention",
        ),
    ],
)
def test_bad_forms_are_refused_by_name(make, message):
    with pytest.raises(ValueError, match=message):
        make()
