"""Example encodings built on their own (posenc.examples.build_example), as ``posenc show``, ``posenc plot``
and the registry-wide tests build them: layer options written in the spec win over the arguments, a spec
with options still gets the example values of the required options it leaves out, and a bad size is named.

Expected values are the spec's own numbers and the class's ``example_options`` (sinusoidal2d's
``grid_width`` 4), read off the spec and the class, not off the builder."""

from __future__ import annotations

import pytest

import posenc
from posenc.examples import EXAMPLE_LAYER, build_example


def test_layer_options_in_the_spec_win_over_the_arguments():
    assert build_example("sinusoidal:dim=512").config()["dim"] == 512
    twelve = build_example("alibi:num_heads=12", num_heads=2)
    assert twelve.config()["num_heads"] == 12 and twelve.slopes.shape == (12,)
    assert build_example("rope:head_dim=32").config()["head_dim"] == 32


def test_the_arguments_size_an_encoding_whose_spec_names_no_size():
    assert build_example("alibi", num_heads=3).config()["num_heads"] == 3
    assert build_example("rope", head_dim=8).config()["head_dim"] == 8
    width = EXAMPLE_LAYER["num_heads"] * EXAMPLE_LAYER["head_dim"]
    assert build_example("sinusoidal").config()["dim"] == width  # the example layer's width, 8 x 16


def test_a_spec_with_options_still_gets_the_required_options_it_leaves_out():
    example = posenc.get_class("sinusoidal2d").example_options["grid_width"]
    config = build_example("sinusoidal2d:base=100").config()
    assert config["base"] == 100.0 and config["grid_width"] == example == 4
    assert build_example("sinusoidal2d:grid_width=8").config()["grid_width"] == 8


def test_a_size_that_is_no_int_or_not_positive_is_named():
    with pytest.raises(ValueError, match=r"alibi: option 'num_heads' must be an int, got 'x'"):
        build_example("alibi:num_heads=x")
    with pytest.raises(ValueError, match=r"num_heads, head_dim and dim must be positive, got 0, 16, 0"):
        build_example("rope", num_heads=0)
