"""Nothing silent in the encodings' options.

* **Option ranges, generated from the registry**: every encoding with numeric options declares
  their ranges, and for each declared range a value just outside is a ValueError naming the option
  and the range, whether the encoding is built from a spec or constructed directly; hand-written
  spec cases and a layer size out of range too.
* **Sizes up front**: a table too large (learned, Shaw, RoPE's cache) fails before anything is
  allocated, naming the memory; xPos past the float32 range of its scale is a clear error.
* **RoPE's pairing switch** (``switch_rope_pairing_``) on part of a model whose RoPE object another
  layer shares: refused, naming that layer, with nothing changed; a module holding every user is
  switched consistently (a deep copy shares only with its own layers).
* **p-RoPE's fraction form**: a spec takes HF's ``partial_rotary_factor`` (and ``rotary_dim=0``),
  equal to HF's ``ROPE_INIT_FUNCTIONS["proportional"]``; ``--eval-variants prope:P`` at a small
  head size builds.

Expected values come from HF's functions, the outputs before the call under test, or the declared
ranges themselves.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

import posenc

from ._helpers import E, H, _layer

# ---------------------------------------------------------------------------- option ranges


def _declared_ranges():
    for name in posenc.available():
        for option, allowed in posenc.get_class(name).option_ranges.items():
            yield pytest.param(name, option, allowed, id=f"{name}-{option}")


def _outside(allowed) -> list[float]:
    """Values just outside a declared range: the excluded bound itself, or one step past it."""
    values = []
    if allowed.low is not None:
        values.append(allowed.low - 1 if allowed.low_inclusive else allowed.low)
    if allowed.high is not None:
        values.append(allowed.high + 1 if allowed.high_inclusive else allowed.high)
    return values


def test_every_encoding_with_numeric_options_declares_their_ranges():
    families = [n for n in posenc.available() if n != "nope"]
    assert all(posenc.get_class(n).option_ranges for n in families)


@pytest.mark.parametrize("name,option,allowed", list(_declared_ranges()))
def test_an_option_outside_its_declared_range_is_refused_naming_it(name, option, allowed):
    """Generated from every encoding's ``option_ranges``: a value outside is a ValueError naming
    the option and the range, whether the encoding is built from a spec or constructed directly."""
    import re

    from posenc.examples import build_example

    cls = posenc.get_class(name)
    good = build_example(name, num_heads=H, head_dim=8).config()
    for bad in _outside(allowed):
        is_list = isinstance(good.get(option), list) or option in ("short_factor", "long_factor")
        value = [bad] if is_list else bad
        pattern = rf"{name}: option '{option}' must be {re.escape(str(allowed))}, got {option}="
        with pytest.raises(ValueError, match=pattern):
            cls(**{**good, option: value})


@pytest.mark.parametrize(
    "spec,match",
    [
        (
            "deberta:layer_norm_eps=-1",
            r"deberta: option 'layer_norm_eps' must be > 0, got layer_norm_eps=-1\.0",
        ),
        ("deberta:pos_dropout=1", r"option 'pos_dropout' must be in \[0, 1\), got pos_dropout=1\.0"),
        ("rope:base=0", r"rope: option 'base' must be > 1, got base=0\.0"),
        ("rope:base=-5", r"option 'base' must be > 1"),
        ("rope:scaling=linear,factor=0", r"option 'factor' must be > 0, got factor=0\.0"),
        ("rope:scaling=yarn,factor=-2,original_max_position_embeddings=8", r"option 'factor' must be > 0"),
        (
            "rope:scaling=yarn,factor=2,original_max_position_embeddings=0",
            r"'original_max_position_embeddings' must be >= 1",
        ),
        (
            "rope:scaling=yarn,factor=2,original_max_position_embeddings=8,attention_factor=0",
            r"'attention_factor' must be > 0",
        ),
        ("t5:max_distance=0", r"t5: option 'max_distance' must be >= 1, got max_distance=0"),
        ("t5:num_buckets=0", r"t5: option 'num_buckets' must be >= 2"),
        ("xpos:gamma=-0.5", r"xpos: option 'gamma' must be in \(0, 1000\]"),
        ("fire:eps=0", r"fire: option 'eps' must be > 0"),
        ("sinusoidal:base=-1", r"sinusoidal: option 'base' must be > 0"),
        ("mrope:factor=0,scaling=linear", r"mrope: option 'factor' must be > 0"),
    ],
)
def test_out_of_range_spec_options_are_refused_at_build_time(spec, match):
    from posenc.examples import build_example

    with pytest.raises(ValueError, match=match):
        build_example(spec, num_heads=H, head_dim=8)


def test_a_layer_size_out_of_range_is_refused_naming_it():
    with pytest.raises(ValueError, match=r"alibi: option 'num_heads' must be >= 1, got num_heads=0"):
        posenc.build("alibi:num_heads=0")


# ---------------------------------------------------------------------------- sizes up front


@pytest.mark.parametrize(
    "spec,match",
    [
        ("learned:max_len=10000000000,dim=64", r"learned: max_len=10000000000 needs a table of 2384\.2 GiB"),
        ("shaw:max_len=1000000000,head_dim=16,num_heads=2,k=None", r"shaw: max_len=1000000000 needs a table"),
        ("rope:cache_size=10000000000", r"rope: cache_size=10000000000 needs a table of 74\.5 GiB"),
    ],
)
def test_huge_tables_fail_up_front_naming_the_memory(spec, match):
    with pytest.raises(ValueError, match=match):
        posenc.build(spec)


def test_xpos_past_its_float32_range_is_a_clear_error():
    """ζ^(-p/B) overflows float32 near p = 36,000 with the defaults: refuse, naming the fix."""
    layer = _layer("xpos", causal=True)
    limit = layer.encoding.max_offset
    zeta = float(layer.encoding.zeta.min())
    assert torch.isfinite(torch.tensor(zeta, dtype=torch.float32) ** torch.tensor(-limit / 512.0))
    assert not torch.isfinite(
        torch.tensor(zeta, dtype=torch.float32) ** torch.tensor(-(limit * 1.02) / 512.0)
    )
    x = torch.randn(1, 3, E)
    layer(x, positions=torch.arange(3) + limit - 2)  # at the edge: served
    with pytest.raises(ValueError, match="past the float32 range of its scale"):
        layer(x, positions=torch.arange(3) + limit)


# ---------------------------------------------------------------------------- RoPE's pairing switch


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
