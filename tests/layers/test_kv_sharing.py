"""KV-shared layers in posenc's own model (Gemma 4's ``num_kv_shared_layers``, posenc.layers.kv_sharing).

References: a float64 twin of the model written here (LayerNorm, projections, RoPE from its
formula, an explicit sliding-window mask, softmax), in which the shared layers take the keys and
values of hand-picked donors; HF's ``Gemma4TextAttention`` (``is_kv_shared_layer``,
``store_full_length_kv``) for which layer is the donor; the full forward for cached decoding. (HF's Gemma 4 itself, whose block differs from
posenc's, is compared through ``posenc.hf`` in tests/hf/test_attention.py.)
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

import posenc
from posenc.layers.kv_sharing import KVDonorAttention, KVSharedAttention, link_kv_sharing
from posenc.layers.patterns import LayerSpec, layer_pattern
from posenc.layers.step import layer_problems

V, E, H, HKV, W = 17, 32, 4, 2, 3

D = E // H

# sliding, full, sliding, sliding (shared: donor 2), full (shared: donor 1); hand-picked donors
LAYERS = [
    LayerSpec("rope:base=100.0", window=W),
    LayerSpec("rope:base=1000.0"),
    LayerSpec("rope:base=100.0", window=W),
    LayerSpec("rope:base=100.0", window=W),
    LayerSpec("rope:base=1000.0"),
]

DONORS = {3: 2, 4: 1}


def _model(**options) -> posenc.TransformerLM:
    torch.manual_seed(0)
    options = {"pattern": LAYERS, "kv_shared_layers": 2, **options}
    return posenc.TransformerLM(V, E, len(options["pattern"]), H, num_kv_heads=HKV, **options).double()


def _rope(x: torch.Tensor, base: float) -> torch.Tensor:
    """RoPE from its formula, half pairing: channel ``k`` with ``k + D/2`` at angle ``p * base^(-2k/D)``,
    the angles in float32 (docs/conventions.md §1.6)."""
    positions = torch.arange(x.shape[2], dtype=torch.float32)
    angles = positions[:, None] * (1.0 / base ** (torch.arange(0, D, 2, dtype=torch.float32) / D))
    cos, sin = angles.cos().double(), angles.sin().double()
    first, second = x[..., : D // 2], x[..., D // 2 :]
    return torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1)


def _twin(model: posenc.TransformerLM, tokens: torch.Tensor, layers=LAYERS) -> torch.Tensor:
    """The model's logits computed here: shared layer ``i`` attends with ``DONORS[i]``'s keys and values
    (a K = V layer's values: its key projection before RoPE)."""
    batch, length = tokens.shape
    x = model.token_embedding(tokens)
    keys: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    i, j = torch.arange(length)[:, None], torch.arange(length)[None]
    for index, (block, layer) in enumerate(zip(model.blocks, layers, strict=True)):
        attn, h = block.attn, block.norm_attn(x)
        base = float(layer.encoding.split("=")[1])
        q = _rope(attn.q_proj(h).view(batch, length, H, D).transpose(1, 2), base)
        if index in DONORS:
            k, v = keys[DONORS[index]]
        else:
            k = _rope(attn.k_proj(h).view(batch, length, HKV, D).transpose(1, 2), base)
            values = attn.k_proj if layer.value_from_key else attn.v_proj
            v = values(h).view(batch, length, HKV, D).transpose(1, 2)
            keys[index] = k, v
        k, v = k.repeat_interleave(H // HKV, dim=1), v.repeat_interleave(H // HKV, dim=1)
        allowed = (j <= i) & ((i - j < layer.window) if layer.window else True)
        logits = (q @ k.transpose(-1, -2) / math.sqrt(D)).masked_fill(~allowed, float("-inf"))
        out = (logits.softmax(-1) @ v).transpose(1, 2).reshape(batch, length, E)
        x = x + attn.out_proj(out)
        x = x + block.ffn(block.norm_ffn(x))
    return model.head(model.final_norm(x))


def _tokens(batch: int = 2, length: int = 11) -> torch.Tensor:
    return torch.randint(0, V, (batch, length), generator=torch.Generator().manual_seed(1))


def test_shared_layers_equal_the_twin_with_the_donors_keys_and_gradients():
    model = _model()
    assert [type(b.attn).__name__ for b in model.blocks] == [
        "MultiheadAttention", "KVDonorAttention", "KVDonorAttention", "KVSharedAttention", "KVSharedAttention",
    ]  # fmt: skip
    for index in DONORS:  # HF's shared layers have no k/v projection either
        assert model.blocks[index].attn.k_proj is None and model.blocks[index].attn.v_proj is None
        assert not any(name.startswith(f"blocks.{index}.attn.k_proj") for name in model.state_dict())
    tokens = _tokens()
    got, want = model(tokens), _twin(model, tokens)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    weight = torch.linspace(-1, 1, got.numel(), dtype=got.dtype).view_as(got)
    params = [p for p in model.parameters()]
    got_grads = torch.autograd.grad((got * weight).sum(), params)
    want_grads = torch.autograd.grad((want * weight).sum(), params)
    for (name, _), g, w in zip(model.named_parameters(), got_grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-10, msg=name)
    # the check can fail: the shared layers' own keys (the unshared model) give other logits
    unshared = _model(kv_shared_layers=0)
    assert not torch.allclose(unshared(tokens), want, atol=1e-3)


def test_a_k_eq_v_donor_hands_its_values_to_the_shared_layer():
    """Gemma 4 with ``attention_k_eq_v``: the full layers (donor 1 and shared 4) are K = V; the shared
    layer attends with the donor's values, its key projection before RoPE (the twin's formula)."""
    layers = [replace(layer, value_from_key=layer.window is None) for layer in LAYERS]
    model = _model(pattern=layers)
    assert [b.attn.v_proj is None for b in model.blocks] == [False, True, False, True, True]
    assert model.blocks[4].attn.pattern.value_from_key and model.blocks[4].attn.pattern.kv_shared
    tokens = _tokens()
    got, want = model(tokens), _twin(model, tokens, layers)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    params = [p for p in model.parameters()]
    got_grads = torch.autograd.grad(got.square().sum(), params)
    for (name, _), g, w in zip(
        model.named_parameters(), got_grads, torch.autograd.grad(want.square().sum(), params), strict=True
    ):
        torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-10, msg=name)
    with torch.no_grad():
        cache = posenc.KVCache()
        steps = [model(tokens[:, :6], cache=cache)] + [
            model(tokens[:, t : t + 1], cache=cache) for t in range(6, 11)
        ]
    torch.testing.assert_close(torch.cat(steps, dim=1), want, rtol=1e-10, atol=1e-10)
    # a shared layer whose K = V differs from every earlier layer of its type has no donor
    mixed = [*layers[:4], replace(layers[4], value_from_key=False)]
    with pytest.raises(ValueError, match=r"kv_shared_layers: layer 4 reuses .*value_from_key=False"):
        _model(pattern=mixed)


def _hf_sharing_modes(transformers, config) -> list[str | None]:
    """Each layer's KV sharing as HF's own attention layers state it (``"reuse"``, ``"store"`` or
    None): their ``is_kv_shared_layer`` and ``store_full_length_kv``, which both ends of the
    supported transformers range set (5.24 from ``config.kv_sharing_modes``, 5.21 from the layer
    types before the first shared layer)."""
    attention = transformers.models.gemma4.modeling_gemma4.Gemma4TextAttention
    layers = [attention(config, index) for index in range(config.num_hidden_layers)]
    return [
        "reuse" if layer.is_kv_shared_layer else "store" if layer.store_full_length_kv else None
        for layer in layers
    ]


def test_donor_is_hfs_last_unshared_layer_of_the_type():
    """HF's Gemma 4 sharing: the donor of each shared layer is the ``store`` layer of its type."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("transformers.models.gemma4")
    for num_layers, shared, every in [(8, 3, 3), (12, 4, 6), (9, 2, 3), (6, 1, 3)]:
        config = transformers.Gemma4TextConfig(
            num_hidden_layers=num_layers, num_kv_shared_layers=shared, hidden_size=32, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, global_head_dim=8, intermediate_size=16, vocab_size=V,
            layer_types=[
                "full_attention" if (i + 1) % every == 0 or i == num_layers - 1 else "sliding_attention"
                for i in range(num_layers)
            ],
        )  # fmt: skip
        modes = _hf_sharing_modes(transformers, config)
        store = {config.layer_types[i]: i for i, mode in enumerate(modes) if mode == "store"}
        model = posenc.TransformerLM(
            V, 32, num_layers, 4, pattern=f"gemma4:window=4,global_every={every},kv_shared_layers={shared}"
        )
        for index, (block, mode) in enumerate(zip(model.blocks, modes, strict=True)):
            handoff = getattr(block.attn, "handoff", None)
            if mode == "reuse":
                assert handoff.donor_idx == store[config.layer_types[index]], (num_layers, index)
            else:
                assert not block.attn.pattern.kv_shared


@pytest.mark.parametrize("cache_options", [{}, {"max_length": 24}])
def test_prefill_then_steps_equal_the_full_forward(cache_options):
    """The windowed donor's cache is trimmed to W - 1 keys; the shared layer still sees what its
    donor attended to. Only the donors hold cache entries."""
    model = _model().eval()
    tokens = _tokens(length=14)
    with torch.no_grad():
        full = model(tokens)
        cache = posenc.KVCache(**cache_options)
        steps = [model(tokens[:, :8], cache=cache)]
        steps += [model(tokens[:, t : t + 1], cache=cache) for t in range(8, 14)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-10, atol=1e-10)
    assert [cache.get(i) is not None for i in range(5)] == [True, True, True, False, False]
    assert cache.get(2).k.shape[2] == W - 1  # trimmed after the shared layer took the keys


def test_left_padded_decoding_and_generate_equal_the_full_forward():
    model = _model().eval()
    tokens = _tokens(length=12)
    padding = torch.zeros(2, 12, dtype=torch.bool)
    padding[1, :3] = True
    with torch.no_grad():
        full = model(tokens, key_padding_mask=padding)
        cache = posenc.KVCache()
        steps = [model(tokens[:, :7], cache=cache, key_padding_mask=padding[:, :7])]
        steps += [
            model(tokens[:, t : t + 1], cache=cache, key_padding_mask=padding[:, : t + 1])
            for t in range(7, 12)
        ]
    real = ~padding
    torch.testing.assert_close(torch.cat(steps, dim=1)[real], full[real], rtol=1e-10, atol=1e-10)
    prompt = tokens[:, :5]
    assert torch.equal(model.generate(prompt, 6), model.generate(prompt, 6, use_cache=False))


def test_streaming_cache_serves_linked_layers():
    """A model hands its layers positions, which a streaming cache refuses; two layers linked by hand
    serve it: while the cache keeps every token, prefill and steps equal the full call."""
    torch.manual_seed(0)
    donor = KVDonorAttention(E, H, "rope", causal=True, num_kv_heads=HKV, layer_idx=0).double()
    reader = KVSharedAttention(E, H, "rope", causal=True, num_kv_heads=HKV, layer_idx=1).double()
    link_kv_sharing([donor, reader], {1: 0})
    x, y = torch.randn(2, 2, 10, E, dtype=torch.float64).unbind(0)
    with torch.no_grad():
        full = (donor(x), reader(y))
        cache = posenc.KVCache(recent_tokens=16, sink_tokens=2)
        outs = [(donor(x[:, :6], cache=cache), reader(y[:, :6], cache=cache))]
        outs += [
            (donor(x[:, t : t + 1], cache=cache), reader(y[:, t : t + 1], cache=cache)) for t in range(6, 10)
        ]
    for got, want in zip(zip(*outs, strict=True), full, strict=True):
        torch.testing.assert_close(torch.cat(got, dim=1), want, rtol=1e-10, atol=1e-10)
    assert cache.get(1) is None
    # the reader's output depends on the donor's keys: another donor input changes it
    donor(torch.randn_like(x))
    assert not torch.allclose(reader(y), full[1], atol=1e-3)


def test_gemma4_recipe_shares_and_decodes():
    model = posenc.TransformerLM(
        V, 32, 6, 4, pattern="gemma4:window=3,global_every=3,kv_shared_layers=3"
    ).double()
    assert [layer.kv_shared for layer in model.layers] == [False] * 3 + [True] * 3
    assert [b.attn.handoff.donor_idx for b in model.blocks[3:]] == [1, 1, 2]  # local, local, global
    tokens = _tokens(length=9)
    with torch.no_grad():
        full = model(tokens)
        cache = posenc.KVCache()
        steps = [model(tokens[:, :5], cache=cache)] + [
            model(tokens[:, t : t + 1], cache=cache) for t in range(5, 9)
        ]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-10, atol=1e-10)
    assert layer_pattern("gemma4", 6) == [
        LayerSpec(layer.encoding, window=layer.window)
        for layer in layer_pattern("gemma4:kv_shared_layers=2", 6)
    ]


def test_switch_rope_pairing_keeps_the_shared_model():
    model = _model()
    tokens = _tokens()
    with torch.no_grad():
        before = model(tokens)
        assert posenc.switch_rope_pairing_(model, "interleaved") == 5
        torch.testing.assert_close(model(tokens), before, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize(
    ("options", "needle"),
    [
        ({"kv_shared_layers": -1}, "kv_shared_layers must be in [0, num_layers=5)"),
        ({"kv_shared_layers": 5}, "kv_shared_layers must be in [0, num_layers=5)"),
        ({"kv_shared_layers": True}, "kv_shared_layers must be an int"),
        ({"kv_shared_layers": 4}, "kv_shared_layers: layer 1 reuses"),  # no earlier unshared full layer
        ({"pattern": [LayerSpec("rope")] * 4 + [LayerSpec("alibi")]}, "kv_shared_layers: layer 4 reuses"),
        ({"pattern": [LayerSpec("cope")] * 5}, "kv_shared_layers: layer 3's encoding 'cope'"),
        ({"pattern": "gemma4:kv_shared_layers=1", "kv_shared_layers": 1}, "give the count once"),
    ],
)
def test_bad_sharing_is_refused_naming_the_parameter(options, needle):
    with pytest.raises(ValueError) as err:
        _model(**options)
    assert needle in str(err.value)


def test_gemma4_recipe_without_a_donor_of_the_type_is_refused():
    """4 layers, global every 6: only the last is global; HF refuses sharing it as well."""
    with pytest.raises(ValueError, match="kv_shared_layers: layer 3 reuses"):
        posenc.TransformerLM(V, 32, 4, 4, pattern="gemma4:kv_shared_layers=1")
    with pytest.raises(ValueError, match=r"kv_shared_layers.*must be in"):
        layer_pattern("gemma4:kv_shared_layers=4", 4)


def test_a_shared_layer_reads_only_its_donors_keys_of_this_forward():
    model = _model()
    x = torch.randn(2, 5, E, dtype=torch.float64)
    model(_tokens())
    with pytest.raises(
        ValueError, match=r"shares the keys and values of layer 2.*has not run in this forward"
    ):
        model.blocks[3].attn(x)  # handed nothing outside its model's forward
    with pytest.raises(ValueError, match="kv_shared=True needs a model"):
        posenc.MultiheadAttention(E, H, "rope", causal=True, pattern=LayerSpec("rope", kv_shared=True))
    cache = posenc.KVCache()
    with torch.no_grad():
        model(_tokens(), cache=cache)
        donor = model.blocks[2].attn
        donor(x, cache=posenc.KVCache())  # the donor runs with another cache
        with pytest.raises(ValueError, match="ran with another cache"):
            model.blocks[3].attn(x, cache=cache)
    assert "layers with kv_shared='KVSharedAttention' are not served" in layer_problems(
        model.blocks[3].attn, "slots"
    )
    with pytest.raises(ValueError, match="layer 3: layers with kv_shared='KVSharedAttention'"):
        model.eval().generate(_tokens(), 3, compiled=True)


def test_a_copied_model_links_its_own_layers():
    import copy

    model = _model()
    twin = copy.deepcopy(model)
    assert twin.blocks[3].attn.handoff is twin.blocks[2].attn.handoff is not model.blocks[2].attn.handoff
    tokens = _tokens()
    torch.testing.assert_close(twin(tokens), model(tokens), rtol=0, atol=0)
