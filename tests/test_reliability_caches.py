"""Reliability of the seams around caches (issue 22, items 1, 4, 5, 9 and p-RoPE's fraction form).

* A windowed layer's KV cache after eviction, with a ``key_padding_mask`` passed (the HF habit of
  passing it every step): cached decoding equals the full uncached forward, for
  ``MultiheadAttention`` and a ``TransformerLM`` with the ``gemma3`` window pattern.
* ``switch_rope_pairing_`` on part of a model whose RoPE object another layer shares: refused,
  naming that layer, with nothing changed; a module holding every user is switched consistently.
* ``LatentCache`` (MLA) refuses what ``KVCache`` refuses: another layer's entry, another batch.
* ``rope:drop_rotation=eval``: an entry written in training mode is refused in eval mode.
* p-RoPE in a spec string takes HF's ``partial_rotary_factor`` (and ``rotary_dim=0``), equal to HF's
  ``ROPE_INIT_FUNCTIONS["proportional"]``; ``--eval-variants prope:P`` at a small head size builds.

Expected values come from an independent source: the full uncached forward, a fresh cache, the
outputs before the call under test, or HF's functions.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

import posenc

# ---------------------------------------------------------------------------- item 1: window + padding


def _no_padding(batch: int, length: int) -> torch.Tensor:
    return torch.zeros(batch, length, dtype=torch.bool)


def test_issue_snippet_windowed_cache_then_a_padding_mask_equals_the_full_forward():
    """11 steps without a mask evict 8 keys; the 12th step, with an all-False mask, is at position 11."""
    attn = posenc.MultiheadAttention(32, 4, "rope", causal=True, window=4).eval()
    x = torch.randn(2, 12, 32)
    full = attn(x)[:, 11]
    cache = posenc.KVCache()
    for t in range(11):
        attn(x[:, t : t + 1], cache=cache)
    assert cache.get(0).evicted == 8  # the case under test: keys were evicted
    got = attn(x[:, 11:], cache=cache, key_padding_mask=_no_padding(2, 1))[:, 0]
    torch.testing.assert_close(got, full, rtol=1e-5, atol=1e-5)


def test_default_positions_after_eviction_count_the_evicted_tokens_whatever_the_mask():
    attn = posenc.MultiheadAttention(32, 4, "rope", causal=True, window=4).eval()
    cache = posenc.KVCache()
    x = torch.randn(2, 11, 32)
    for t in range(11):
        attn(x[:, t : t + 1], cache=cache)
    want = torch.tensor([[11], [11]])  # the 12th token of each sequence
    for mask in (None, _no_padding(2, 1), _no_padding(2, 4)):  # none, the new token's, every held key's
        got = attn.default_positions(2, 1, mask, cache)
        assert torch.equal(got.expand(2, 1), want), mask


@pytest.mark.parametrize("mask_from", [0, 6])
def test_windowed_layer_decoding_with_a_padding_mask_every_step_equals_the_full_forward(mask_from):
    """The mask passed at every step (with left padding from step 0; all False from step 6, after
    the cache has evicted keys): each step equals the uncached forward with the whole mask."""
    attn = posenc.MultiheadAttention(32, 4, "rope", causal=True, window=4).eval()
    length = 12
    x = torch.randn(2, length, 32)
    padding = _no_padding(2, length)
    if mask_from == 0:
        padding[1, :3] = True  # row 1 is left-padded by 3
    full = attn(x, key_padding_mask=padding)
    cache = posenc.KVCache()
    for t in range(length):
        mask = padding[:, t : t + 1] if t >= mask_from else None
        got = attn(x[:, t : t + 1], cache=cache, key_padding_mask=mask)
        real = ~padding[:, t]
        torch.testing.assert_close(got[real, 0], full[real, t], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mask_from", [0, 6])
def test_gemma3_window_pattern_decoding_with_a_padding_mask_equals_the_full_forward(mask_from):
    model = posenc.TransformerLM(50, 32, 6, 4, pattern="gemma3:window=4").eval()
    assert [block.attn.window for block in model.blocks] == [4, 4, 4, 4, 4, None]
    length = 12
    tokens = torch.randint(0, 50, (2, length))
    padding = _no_padding(2, length)
    if mask_from == 0:
        padding[1, :2] = True
    full = model(tokens, key_padding_mask=padding)
    cache = posenc.KVCache()
    for t in range(length):
        mask = padding[:, t : t + 1] if t >= mask_from else None
        got = model(tokens[:, t : t + 1], cache=cache, key_padding_mask=mask)
        real = ~padding[:, t]
        torch.testing.assert_close(got[real, 0], full[real, t], rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------- item 4: shared RoPE, pairing switch


def _shared_pair():
    enc = posenc.build("rope")
    first = posenc.MultiheadAttention(32, 4, enc, causal=True, layer_idx=0).double()
    second = posenc.MultiheadAttention(32, 4, enc, causal=True, layer_idx=1).double()
    return first, second


def test_switching_one_of_two_layers_sharing_a_rope_is_refused_naming_the_other():
    first, second = _shared_pair()
    x = torch.randn(2, 7, 32, dtype=torch.float64)
    want_first, want_second = first(x), second(x)
    with pytest.raises(
        ValueError, match=r"also serves another layer, MultiheadAttention\(layer_idx=1.*whole model"
    ):
        posenc.switch_rope_pairing_(first)
    assert first.encoding.pairing == "half"  # nothing changed
    torch.testing.assert_close(first(x), want_first, rtol=0, atol=0)
    torch.testing.assert_close(second(x), want_second, rtol=0, atol=0)


def test_switching_part_of_a_stack_built_on_one_rope_object_is_refused_and_the_stack_switches():
    """Three layers on one RoPE object (TransformerLM builds one per layer; a hand-built stack may share)."""
    enc = posenc.build("rope")
    stack = torch.nn.Sequential(
        *(posenc.MultiheadAttention(32, 4, enc, causal=True, layer_idx=i) for i in range(3))
    ).double()
    x = torch.randn(2, 9, 32, dtype=torch.float64)
    want = stack(x)
    with pytest.raises(
        ValueError, match=r"layer '0' also serves another layer, MultiheadAttention\(layer_idx=2"
    ):
        posenc.switch_rope_pairing_(stack[:2])  # a sub-part: layer 2 shares the encoding from outside
    torch.testing.assert_close(stack(x), want, rtol=0, atol=0)
    assert posenc.switch_rope_pairing_(stack) == 3  # every user inside: all switched, one encoding
    assert enc.pairing == "interleaved"
    torch.testing.assert_close(stack(x), want, rtol=1e-12, atol=1e-12)


def test_switching_a_module_that_holds_every_user_keeps_each_output():
    first, second = _shared_pair()
    x = torch.randn(2, 7, 32, dtype=torch.float64)
    want_first, want_second = first(x), second(x)
    assert posenc.switch_rope_pairing_(torch.nn.Sequential(first, second)) == 2
    torch.testing.assert_close(first(x), want_first, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(second(x), want_second, rtol=1e-12, atol=1e-12)


def test_a_deep_copy_shares_its_rope_with_its_own_layers_only():
    first, second = _shared_pair()
    original = torch.nn.Sequential(first, second)
    copied = copy.deepcopy(original)
    x = torch.randn(2, 7, 32, dtype=torch.float64)
    want = original(x)
    with pytest.raises(ValueError, match="also serves another layer"):
        posenc.switch_rope_pairing_(copied[0])  # the copy's second layer shares the copied RoPE
    assert posenc.switch_rope_pairing_(copied) == 2
    torch.testing.assert_close(copied(x), want, rtol=1e-12, atol=1e-12)
    assert first.encoding.pairing == "half"
    torch.testing.assert_close(original(x), want, rtol=0, atol=0)  # the original is untouched


# ---------------------------------------------------------------------------- item 5: LatentCache writer checks

MLA = dict(kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=4)


def _mla(**overrides):
    return posenc.MultiLatentAttention(16, 2, **{**MLA, **overrides}).eval()


def test_latent_cache_refuses_another_layer_with_the_same_layer_idx():
    writer, reader = _mla(), _mla()
    x = torch.randn(2, 5, 16)
    cache = posenc.LatentCache()
    writer(x[:, :4], cache=cache)
    with pytest.raises(
        ValueError,
        match=r"layer_idx=0 was written by MultiLatentAttention\(layer_idx=0, heads=2, kv_lora_rank=8.*own layer_idx",
    ):
        reader(x[:, 4:], cache=cache)
    # The reader with its own cache equals its full forward: the entry it was refused was not its own.
    own = posenc.LatentCache()
    reader(x[:, :4], cache=own)
    torch.testing.assert_close(reader(x[:, 4:], cache=own), reader(x)[:, 4:], rtol=1e-5, atol=1e-5)


def test_latent_cache_refuses_a_layer_with_another_kv_lora_rank_and_a_batch_change():
    writer = _mla()
    cache = posenc.LatentCache()
    writer(torch.randn(2, 4, 16), cache=cache)
    with pytest.raises(
        ValueError, match=r"written by MultiLatentAttention\(.*kv_lora_rank=8.*kv_lora_rank=6"
    ):
        _mla(kv_lora_rank=6)(torch.randn(2, 1, 16), cache=cache)
    with pytest.raises(ValueError, match=r"holds a batch of 2, this call has 3; use a fresh LatentCache"):
        writer(torch.randn(3, 1, 16), cache=cache)


# ---------------------------------------------------------------------------- item 9: drop_rotation=eval and the cache


def test_a_cache_written_in_training_mode_is_refused_in_eval_mode_with_drop_rotation():
    layer = posenc.MultiheadAttention(16, 2, "rope:drop_rotation=eval", causal=True)
    x = torch.randn(2, 5, 16)
    cache = posenc.KVCache()
    layer.train()(x[:, :4], cache=cache)
    layer.eval()
    with pytest.raises(ValueError, match=r"written with rotation.*drop_rotation='eval'.*fresh KVCache"):
        layer(x[:, 4:], cache=cache)
    fresh = posenc.KVCache()  # written and read in eval mode: equals the full eval forward
    layer(x[:, :4], cache=fresh)
    torch.testing.assert_close(layer(x[:, 4:], cache=fresh), layer(x)[:, 4:], rtol=1e-5, atol=1e-5)
    layer.train()
    with pytest.raises(ValueError, match="written without rotation"):
        layer(x[:, 4:], cache=fresh)


def test_a_latent_cache_written_in_training_mode_is_refused_in_eval_mode_with_drop_rotation():
    layer = _mla(rope="rope:drop_rotation=eval")
    cache = posenc.LatentCache()
    layer.train()(torch.randn(1, 4, 16), cache=cache)
    with pytest.raises(ValueError, match=r"written with rotation.*fresh LatentCache"):
        layer.eval()(torch.randn(1, 1, 16), cache=cache)


def test_a_streaming_cache_keeps_keys_unrotated_so_a_mode_change_is_served():
    """StreamingLLM stores keys unrotated and rotates them at every step in the current mode."""
    layer = posenc.MultiheadAttention(16, 2, "rope:drop_rotation=eval", causal=True)
    x = torch.randn(1, 6, 16)
    mixed, evaluated = (
        posenc.KVCache(recent_tokens=3, sink_tokens=1),
        posenc.KVCache(recent_tokens=3, sink_tokens=1),
    )
    layer.train()
    for t in range(5):
        layer(x[:, t : t + 1], cache=mixed)
    layer.eval()
    for t in range(5):
        layer(x[:, t : t + 1], cache=evaluated)
    torch.testing.assert_close(layer(x[:, 5:], cache=mixed), layer(x[:, 5:], cache=evaluated), rtol=0, atol=0)


# ---------------------------------------------------------------------------- p-RoPE's fraction form


def _hf_proportional(head_dim: int, params: dict) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = LlamaConfig(
            hidden_size=2 * head_dim,
            num_attention_heads=2,
            head_dim=head_dim,
            rope_parameters={"rope_type": "proportional", "rope_theta": 10000.0, **params},
        )
    return ROPE_INIT_FUNCTIONS["proportional"](config)[0]


@pytest.mark.parametrize("fraction", [0.0, 0.1, 0.25, 0.5, 0.75, 1.0])
def test_p_rope_spec_takes_hfs_partial_rotary_factor(fraction):
    want = _hf_proportional(8, {"partial_rotary_factor": fraction})
    enc = posenc.build(f"rope:scaling=proportional,partial_rotary_factor={fraction}", head_dim=8)
    torch.testing.assert_close(enc.inv_freq, want, rtol=1e-6, atol=0)
    torch.testing.assert_close(posenc.build(enc.spec()).inv_freq, want, rtol=1e-6, atol=0)  # round trip


def test_p_rope_with_no_rotating_pair_builds_from_rotary_dim_zero_and_the_prope_variant():
    from posenc.experiments.variants import VariantContext, parse_eval_variants, variant_encoding

    want = _hf_proportional(8, {"partial_rotary_factor": 0.1})  # int(0.1 * 8 // 2) = 0 pairs
    assert not want.any()
    assert torch.equal(posenc.build("rope:scaling=proportional,rotary_dim=0", head_dim=8).inv_freq, want)
    (prope,) = parse_eval_variants(["prope:0.1"])
    spec = variant_encoding("rope", prope, VariantContext(train_tokens=8, eval_tokens=16, head_dim=8))
    model = posenc.TransformerLM(20, 16, 1, 2, spec)  # head size 8, as in the issue
    torch.testing.assert_close(model.blocks[0].attn.encoding.inv_freq, want, rtol=0, atol=0)


def test_partial_rotary_factor_on_plain_rope_equals_hf_and_bad_forms_say_what_to_pass():
    # HF's linear scaling at factor 1 is its default RoPE over int(head_dim * partial_rotary_factor) channels.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = LlamaConfig(
            hidden_size=32,
            num_attention_heads=2,
            head_dim=16,
            rope_parameters={
                "rope_type": "linear",
                "rope_theta": 10000.0,
                "factor": 1.0,
                "partial_rotary_factor": 0.5,
            },
        )
    want = ROPE_INIT_FUNCTIONS["linear"](config)[0]
    enc = posenc.build("rope:partial_rotary_factor=0.5", head_dim=16)
    torch.testing.assert_close(enc.inv_freq, want, rtol=1e-6, atol=0)
    assert enc.rotary_dim == 8
    with pytest.raises(ValueError, match=r"only scaling='proportional' \(p-RoPE\) may rotate no pair"):
        posenc.build("rope:rotary_dim=0", head_dim=8)
    with pytest.raises(ValueError, match="give rotary_dim or partial_rotary_factor"):
        posenc.build("rope:scaling=proportional,partial_rotary_factor=0.5,rotary_dim=4", head_dim=8)
    with pytest.raises(ValueError, match=r"'partial_rotary_factor' must be in \[0, 1\]"):
        posenc.build("rope:partial_rotary_factor=1.5", head_dim=8)
    with pytest.raises(ValueError, match="partial_rotary_factor inside rope_parameters or as an option"):
        posenc.build("rope", head_dim=8, partial_rotary_factor=0.5, rope_parameters={"rope_type": "default"})
