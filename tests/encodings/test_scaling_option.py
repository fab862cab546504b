"""RoPE's and M-RoPE's one scaling option (posenc.encodings._scaling_option): every form (a type name, a
RopeScaling, a dict, flat spec options) builds one encoding with one spec; the options are spelled once,
in rope_scaling.py."""

from __future__ import annotations

import pytest
import torch

import posenc


@pytest.mark.parametrize("name", ["rope", "mrope"])
def test_scaling_is_one_value_and_its_flat_options_are_the_spec_form(name):
    """``scaling`` takes one value (type name, ``RopeScaling`` or a dict of its fields); the flat
    options of spec strings and keywords are gathered into it: one encoding, config and spec."""
    from posenc.encodings.rope_scaling import RopeScaling

    cls = posenc.encodings.registry.get_class(name)
    options = {"factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 16.0}
    flat = posenc.build(
        f"{name}:scaling=yarn,factor=4,original_max_position_embeddings=64,beta_fast=16", head_dim=16
    )
    forms = [
        cls(head_dim=16, scaling=RopeScaling("yarn", **options)),
        cls(head_dim=16, scaling={"type": "yarn", **options}),
        cls(head_dim=16, scaling={"rope_type": "yarn", **options}),
        cls(head_dim=16, scaling="yarn", **options),
        posenc.build(name, head_dim=16, scaling=RopeScaling("yarn", **options)),
        posenc.build(name, head_dim=16, scaling="yarn", **options),
    ]
    q = torch.randn(1, 2, 40, 16)
    pos = torch.arange(40)[None]
    want = flat.rotate(q, q, pos, pos)
    for enc in forms:
        assert enc.scaling == RopeScaling("yarn", **options) == flat.scaling
        assert enc.config() == flat.config() and enc.spec() == flat.spec()
        assert all(torch.equal(a, b) for a, b in zip(enc.rotate(q, q, pos, pos), want))
    assert posenc.build(flat.spec()).config() == flat.config()
    with pytest.raises(ValueError, match="not both"):
        cls(head_dim=16, scaling=RopeScaling("yarn", factor=4.0), original_max_position_embeddings=64)
    with pytest.raises(ValueError, match="unknown option"):
        cls(head_dim=16, scaling={"type": "yarn", "rope_theta": 1e4})
    with pytest.raises(ValueError, match="must be a type name"):
        cls(head_dim=16, scaling=4)
    with pytest.raises(ValueError, match="need a scaling type"):
        cls(head_dim=16, scaling={"factor": 4.0})
    with pytest.raises(ValueError, match="must be > 0"):
        cls(head_dim=16, scaling=RopeScaling("linear", factor=-1.0))  # the declared ranges, every form


def test_mrope_scaling_takes_only_fixed_length_options():
    from posenc.encodings.rope_scaling import RopeScaling

    with pytest.raises(ValueError, match=r"unknown option.*short_factor"):
        posenc.build("mrope", head_dim=16, scaling=RopeScaling("longrope", short_factor=[1.0] * 8))
    with pytest.raises(TypeError, match="short_factor"):
        posenc.encodings.registry.get_class("mrope")(head_dim=16, scaling="longrope", short_factor=[1.0] * 8)


def test_the_scaling_options_are_spelled_in_rope_scaling_only():
    """Issue 34 item 6: RoPE's scaling options are written once, in rope_scaling.py."""
    from pathlib import Path

    folder = Path(posenc.__file__).parent / "encodings"
    spelled = sorted(p.name for p in folder.glob("*.py") if "beta_fast" in p.read_text(encoding="utf-8"))
    assert spelled == ["rope_scaling.py"]
