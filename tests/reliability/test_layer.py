"""Nothing silent in ``MultiheadAttention``'s arguments and the model around it.

* Arguments of the wrong type or value (``embed_dim=64.0``, a ``scale`` that is nan, inf, zero or
  negative, ``prefix_len="3"``, token ids outside the vocabulary): a ValueError naming the argument.
* Positions: M-RoPE refuses negative 3-axis ids as plain positions are refused.
* Devices: an argument on another device than ``x`` (positions, masks, document ids, prefix_len,
  context), and ``x``, the layer, the cache and the model on different devices: the error names
  both devices and the move.
* An empty sequence gives an empty output on every registered encoding.
* ``torch.compile``: the layer compiles in one graph for every kind of encoding and follows
  positions, padding and float masks; the model compiles in one graph; a backend that cannot be
  traced is refused by name.

Expected values come from the same layer or model run eagerly.
"""

from __future__ import annotations

import pytest
import torch

import posenc

from ._helpers import E, H, _layer

# ---------------------------------------------------------------------------- arguments


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"embed_dim": 64.0, "num_heads": 4}, "embed_dim must be an int, got 64.0"),
        ({"embed_dim": 64, "num_heads": "4"}, "num_heads must be an int, got '4'"),
        ({"embed_dim": 64, "num_heads": 4, "num_kv_heads": 2.0}, "num_kv_heads must be an int"),
    ],
)
def test_layer_sizes_of_the_wrong_type_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        posenc.MultiheadAttention(**kwargs)


@pytest.mark.parametrize("scale", [float("nan"), float("inf"), -float("inf"), 0.0, -0.5, "0.5", True])
def test_layer_refuses_a_scale_that_is_not_finite_and_positive(scale):
    """A nan or inf scale made every row output the same vector (accepted before)."""
    with pytest.raises(ValueError, match=r"^scale must be"):
        posenc.MultiheadAttention(16, 2, "rope", scale=scale)
    with pytest.raises(ValueError, match=r"^scale must be"):
        posenc.MultiLatentAttention(32, 2, kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4,
                                    v_head_dim=8, scale=scale)  # fmt: skip


def test_layer_keeps_a_valid_scale():
    assert posenc.MultiheadAttention(16, 2, "rope", scale=1).scale == 1.0
    assert posenc.MultiheadAttention(16, 2, "rope").scale == pytest.approx(8**-0.5)


@pytest.mark.parametrize("prefix_len", ["3", 2.0, True, ["3", "1"], object()])
def test_prefix_len_of_another_type_names_prefix_len(prefix_len):
    """``prefix_len="3"`` raised torch's TypeError from torch.as_tensor."""
    attn = posenc.MultiheadAttention(16, 2, "rope", causal=True)
    with pytest.raises(ValueError, match=r"^prefix_len must be an int or an integer tensor"):
        attn(torch.randn(2, 5, 16), prefix_len=prefix_len)
    assert attn(torch.randn(2, 5, 16), prefix_len=[1, 3]).shape == (2, 5, 16)  # a list of ints works


def test_token_ids_outside_the_vocabulary_name_vocab_size():
    model = posenc.TransformerLM(10, 16, 1, 2)
    with pytest.raises(ValueError, match=r"ids in \[0, vocab_size=10\), got values from 0 to 10"):
        model(torch.tensor([[0, 3, 10]]))
    with pytest.raises(ValueError, match="got values from -1"):
        model(torch.tensor([[-1, 3]]))


@pytest.mark.parametrize("name", posenc.available())
def test_an_empty_sequence_gives_an_empty_output_on_every_encoding(name):
    from posenc.examples import build_example

    layer = posenc.MultiheadAttention(E, H, build_example(name, num_heads=H, head_dim=E // H), causal=True)
    out = layer(torch.randn(2, 0, E))
    assert out.shape == (2, 0, E)


# ---------------------------------------------------------------------------- positions


def test_mrope_refuses_negative_3_axis_ids_as_plain_positions_are_refused():
    layer = _layer("mrope", causal=True)
    x = torch.randn(1, 3, E)
    with pytest.raises(ValueError, match="positions must be non-negative, got minimum -1"):
        layer(x, positions=torch.tensor([-1, 0, 1]))
    ids = torch.tensor([[0, 1, 2], [0, -3, 1], [0, 1, 1]])
    with (
        pytest.raises(ValueError, match=r"mrope: position ids must be non-negative, got minimum -3"),
        layer.encoding.position_ids(ids),
    ):
        layer(x)
    with layer.encoding.position_ids(ids.abs()):  # the same ids, non-negative: served
        assert torch.isfinite(layer(x)).all()


# ---------------------------------------------------------------------------- devices


@pytest.mark.parametrize(
    "argument",
    ["positions", "key_padding_mask", "attn_mask", "document_ids", "prefix_len", "context"],
)
def test_an_argument_on_another_device_than_x_is_named(argument):
    layer = _layer("nope" if argument == "context" else "rope", causal=argument != "context")
    x = torch.randn(1, 4, E)
    meta = {
        "positions": torch.arange(4, device="meta"),
        "key_padding_mask": torch.zeros(1, 4, dtype=torch.bool, device="meta"),
        "attn_mask": torch.ones(4, 4, dtype=torch.bool, device="meta"),
        "document_ids": torch.zeros(1, 4, dtype=torch.long, device="meta"),
        "prefix_len": torch.tensor([2], device="meta"),
        "context": torch.randn(1, 3, E, device="meta"),
    }[argument]
    with pytest.raises(
        ValueError, match=rf"{argument} is on device meta but x is on cpu; move {argument} to cpu"
    ):
        layer(x, **{argument: meta})


def test_x_the_layer_the_cache_and_the_model_on_other_devices_are_named():
    layer = _layer(causal=True)
    with pytest.raises(ValueError, match=r"x is on device meta but the layer's parameters are on cpu"):
        layer(torch.randn(1, 4, E, device="meta"))
    cache = posenc.KVCache()
    layer(torch.randn(1, 4, E), cache=cache)
    with torch.device("meta"):
        on_meta = _layer(causal=True)
    with pytest.raises(ValueError, match=r"entry of layer_idx=0 is on device cpu but the layer is on meta"):
        on_meta(torch.randn(1, 1, E, device="meta"), cache=cache)
    model = posenc.TransformerLM(10, E, 1, H)
    with pytest.raises(ValueError, match=r"tokens are on device meta but the model is on cpu"):
        model(torch.zeros(1, 3, dtype=torch.long, device="meta"))


# ---------------------------------------------------------------------------- torch.compile


@pytest.mark.parametrize("encoding", ["sinusoidal", "rope", "alibi", "shaw"])  # one per kind
def test_the_layer_compiles_in_one_graph_for_every_kind(encoding):
    """Value checks (negative positions, nan) stay out of the traced path, so fullgraph=True holds;
    aot_eager traces forward and backward like inductor without needing a C++ compiler."""
    torch._dynamo.reset()
    layer = _layer(encoding, causal=True)
    x = torch.randn(2, 7, E)
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(x), layer(x))


@pytest.mark.slow
@pytest.mark.parametrize("encoding", ["sinusoidal", "rope", "alibi", "shaw"])
def test_the_compiled_layer_follows_positions_padding_and_float_masks(encoding):
    torch._dynamo.reset()
    layer = _layer(encoding, causal=True)
    x = torch.randn(2, 7, E)
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    positions = torch.arange(3, 10)
    torch.testing.assert_close(compiled(x, positions=positions), layer(x, positions=positions))
    padding = torch.zeros(2, 7, dtype=torch.bool)
    padding[1, :2] = True  # left padding: two rows of the second sequence see no key
    torch.testing.assert_close(compiled(x, key_padding_mask=padding), layer(x, key_padding_mask=padding))
    float_mask = torch.zeros(7, 7).masked_fill(torch.eye(7, dtype=torch.bool).roll(1, 1), float("-inf"))
    torch.testing.assert_close(compiled(x, attn_mask=float_mask), layer(x, attn_mask=float_mask))


def test_the_model_compiles_in_one_graph():
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = posenc.TransformerLM(32, E, 2, H, encoding="rope").eval()
    tokens = torch.randint(0, 32, (2, 9))
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(tokens), model(tokens))


def test_a_compiled_layer_refuses_a_backend_it_cannot_trace():
    torch._dynamo.reset()
    layer = _layer("alibi", causal=True, backend="blocked")
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    with pytest.raises(Exception, match=r"backend 'blocked' cannot be traced by torch\.compile"):
        compiled(torch.randn(1, 4, E))
