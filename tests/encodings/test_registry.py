"""Registry and spec strings (posenc.encodings.registry): building from a spec or keywords, round trips,
names and duplicates refused, and ``@register`` refusing a class that misses its hook, lies outside the
kind bases or derives buffers without ``reset_buffers``."""

from __future__ import annotations

from typing import Literal

import pytest
from hypothesis import given
from hypothesis import strategies as st

import posenc
from posenc.encodings.base import BiasEncoding, Kind, PositionalEncoding, RotaryEncoding
from posenc.encodings.registry import format_spec, parse_spec, register


def test_spec_string_and_keywords_build_the_same_encoding():
    a = posenc.build("t5:num_buckets=16,max_distance=64,bidirectional=false", num_heads=4)
    b = posenc.build("t5", num_heads=4, num_buckets=16, max_distance=64, bidirectional=False)
    assert a.config() == b.config()
    assert a.config()["bidirectional"] is False and a.config()["num_buckets"] == 16


def test_option_given_twice_in_spec_and_keywords():
    with pytest.raises(ValueError, match="both in the spec string and as keywords"):
        posenc.build("t5:num_buckets=16", num_heads=4, num_buckets=8)


def test_built_encoding_passes_through():
    enc = posenc.build("alibi", num_heads=4)
    assert posenc.build(enc) is enc
    with pytest.raises(ValueError, match="already built"):
        posenc.build(enc, num_heads=2)


_keys = st.from_regex(r"[a-z][a-z_]{0,8}", fullmatch=True)

_values = st.one_of(st.integers(-(10**6), 10**6).map(str), st.sampled_from(["true", "false", "None", "half"]))


@given(st.dictionaries(_keys, _values, max_size=5))
def test_parse_format_round_trip(options):
    name, raw = parse_spec(format_spec("enc", options))
    assert name == "enc" and raw == options


def test_register_rejects_bad_names_and_duplicates():
    with pytest.raises(ValueError, match="invalid encoding name"):
        register("Bad:Name")
    with pytest.raises(ValueError, match="already registered"):

        @register("t5")
        class Other(PositionalEncoding):
            kind = Kind.BIAS


def test_a_new_family_is_one_class_and_one_decorator():
    @register("test-zero-bias")
    class ZeroBias(BiasEncoding):
        """A test-only bias that is zero everywhere."""

        def __init__(self, num_heads: int, mode: Literal["a", "b"] = "a") -> None:
            super().__init__()
            self.num_heads = num_heads

        def bias_at(self, head, q_pos, k_pos):
            return (head * 0 + q_pos * 0 + k_pos * 0).float()

    try:
        assert "test-zero-bias" in posenc.available()
        enc = posenc.build("test-zero-bias:mode=b", num_heads=3)
        assert enc.config() == {"num_heads": 3, "mode": "b"}
        assert enc.bias(4, 5).shape == (3, 4, 5)
        with pytest.raises(ValueError, match="must be one of 'a', 'b'"):
            posenc.build("test-zero-bias:mode=c", num_heads=3)
    finally:
        from posenc.encodings import registry

        registry._REGISTRY.pop("test-zero-bias")


def _float_options():
    import typing

    for name in posenc.available():
        cls = posenc.get_class(name)
        init = getattr(cls.__init__, "__wrapped__", cls.__init__)
        hints = typing.get_type_hints(init)
        for option, hint in hints.items():
            if option != "return" and (hint is float or float in typing.get_args(hint)):
                yield pytest.param(name, option, id=f"{name}-{option}")


@pytest.mark.parametrize("name,option", list(_float_options()))
@pytest.mark.parametrize("bad", ["nan", "inf", "-inf"])
def test_non_finite_float_options_are_refused_by_name(name, option, bad):
    """Every float option of every encoding: nan/inf is a ValueError naming the option (spec or keyword)."""
    with pytest.raises(ValueError, match=rf"{name}: option '{option}' must be a finite number"):
        posenc.build(f"{name}:{option}={bad}")
    with pytest.raises(ValueError, match=rf"option '{option}' must be a finite number"):
        posenc.build(name, **{option: float(bad)})


# ----------------------------------------------------------------------------
# One contract per kind: the kind bases checked by ``@register``, the LayerContext a layer hands its
# encoding, derived float32 buffers that survive casts, ``to_empty()`` and meta-device construction, the one
# RoPE cos/sin cache, the scaling registry's examples and the parsed :class:`Spec`.


# ---------------------------------------------------------------------------- kinds and @register


def test_register_refuses_a_class_that_misses_its_hook():
    with pytest.raises(TypeError, match=r"BiasEncoding but does not implement bias_at\(\)"):

        @register("test-no-hook")
        class NoHook(BiasEncoding):
            def __init__(self, num_heads: int) -> None:
                super().__init__()

    assert "test-no-hook" not in posenc.available()


def test_register_refuses_a_class_outside_the_kind_bases():
    with pytest.raises(TypeError, match="must derive from exactly one of AbsoluteEncoding"):

        @register("test-no-base")
        class NoBase(PositionalEncoding):
            kind = posenc.Kind.ROTARY

            def rotate(self, q, k, q_pos, k_pos):
                return q, k

    assert "test-no-base" not in posenc.available()


def test_register_refuses_derived_buffers_without_reset_buffers():
    with pytest.raises(TypeError, match=r"does not implement reset_buffers\(\)"):

        @register("test-no-reset")
        class NoReset(RotaryEncoding):
            derived_buffers = ("inv_freq",)

            def rotate(self, q, k, q_pos, k_pos):
                return q, k

    assert "test-no-reset" not in posenc.available()
