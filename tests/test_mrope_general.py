"""The general M-RoPE (any number of axes, any map of pairs to axes, either pairing, real-valued ids)
against HF's rotary embeddings of GLM-4V, ERNIE-4.5-VL and HunyuanVL (tiny configs, nothing
downloaded) and against a frozen copy of the three-axis M-RoPE it replaced (docs/conventions.md §9.7).
"""

from __future__ import annotations

import warnings

import pytest
import torch

import posenc
from posenc import functional as F
from posenc.encodings.rope_scaling import rope_scaled_inv_freq
from posenc.kernels.rope import RotaryTables, rotary

# ---------------------------------------------------------------------------- today's M-RoPE, frozen


def _old_axis_map(section: list[int], layout: str) -> torch.Tensor:
    """``mrope_axis_map`` as it was before the general M-RoPE (three axes, two layouts)."""
    if layout == "section":
        axes = torch.tensor([index % 3 for index in range(len(section))], dtype=torch.int64)
        return axes.repeat_interleave(torch.tensor(section, dtype=torch.int64))
    axis = torch.zeros(sum(section), dtype=torch.int64)
    for which in (1, 2):
        axis[which : 3 * section[which] : 3] = which
    return axis


def _old_rotate(x, ids, head_dim, rotary_dim, base, section, layout, scaling):
    """The replaced ``MRoPE.rotate`` on one tensor: cached tables, gathered by axis, rotate_half pairing."""
    config = {"rope_theta": base, **scaling, "head_dim": head_dim, "rotary_dim": rotary_dim}
    inv_freq, scale = rope_scaled_inv_freq(config)
    cos, sin = RotaryTables(inv_freq, scale).tables(ids)  # [3, B, T, P]
    index = _old_axis_map(section, layout).view(1, 1, 1, -1).expand(1, *cos.shape[1:])
    return rotary(x, cos.gather(0, index)[0], sin.gather(0, index)[0], pairing="half")


@pytest.mark.parametrize("seed", range(12))
def test_general_equals_the_replaced_three_axis_mrope_bit_for_bit(seed):
    gen = torch.Generator().manual_seed(seed)
    layout = ["section", "interleaved"][seed % 2]
    head_dim = [16, 32, 64][seed % 3]
    rotary_dim = head_dim if seed % 4 else head_dim // 2
    pairs = rotary_dim // 2
    if layout == "interleaved":
        side = int(torch.randint(0, (pairs + 1) // 3 + 1, (1,), generator=gen))
        side = min(side, (pairs - 1) // 3 + 0) if 3 * side - 1 >= pairs else side
        section = [pairs - 2 * side, side, side]
    else:
        cuts = sorted(torch.randint(0, pairs + 1, (2,), generator=gen).tolist())
        section = [cuts[0], cuts[1] - cuts[0], pairs - cuts[1]]
    scaling = {} if seed % 3 else {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
    ids = torch.randint(0, 300, (3, 2, 9), generator=gen)
    q = torch.randn(2, 4, 9, head_dim, generator=gen)
    options = dict(head_dim=head_dim, base=5e5, mrope_section=section, layout=layout, rotary_dim=rotary_dim)
    if scaling:
        options.update(scaling="yarn", factor=4.0, original_max_position_embeddings=32)
    enc = posenc.build("mrope", **options)
    with enc.position_ids(ids):
        got, _ = enc.rotate(q, q, ids[0], ids[0])
    want = _old_rotate(q, ids, head_dim, rotary_dim, 5e5, section, layout, scaling)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert enc.axis_map.tolist() == _old_axis_map(section, layout).tolist()
    # text tokens (plain positions): the same as before too
    pos = ids[1]
    got_text, _ = enc.rotate(q, q, pos, pos)
    want_text = _old_rotate(
        q, pos[None].expand(3, -1, -1), head_dim, rotary_dim, 5e5, section, layout, scaling
    )
    torch.testing.assert_close(got_text, want_text, rtol=0, atol=0)


# ---------------------------------------------------------------------------- HF models


def _config(cls, head_dim: int, params: dict):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return cls(
            hidden_size=2 * head_dim, num_attention_heads=2, head_dim=head_dim, rope_parameters=dict(params)
        )


def _ours(enc, ids, q, k):
    with enc.position_ids(ids):
        return enc.rotate(q, k, ids[0], ids[0])


def _ids(axes: int, batch: int = 2, length: int = 11, seed: int = 0) -> torch.Tensor:
    """Text positions 0..3 on every axis, then vision tokens with different ids per axis."""
    gen = torch.Generator().manual_seed(seed)
    text = torch.arange(4).expand(axes, batch, -1)
    vision = 4 + torch.randint(0, 40, (axes, batch, length - 4), generator=gen)
    return torch.cat([text, vision], dim=-1)


def test_matches_hf_glm4v_interleaved_partial():
    """GLM-4V: sections ``[t, h, w]`` over a half-width RoPE (partial_rotary_factor 0.5), interleaved pairing."""
    from transformers.models.glm4v.configuration_glm4v import Glm4vTextConfig
    from transformers.models.glm4v.modeling_glm4v import Glm4vTextRotaryEmbedding, apply_rotary_pos_emb

    params = {
        "rope_type": "default",
        "rope_theta": 1e4,
        "mrope_section": [2, 3, 3],
        "partial_rotary_factor": 0.5,
    }
    ids = _ids(3)
    q, k = torch.randn(2, 2, 11, 32), torch.randn(2, 2, 11, 32)
    cos, sin = Glm4vTextRotaryEmbedding(_config(Glm4vTextConfig, 32, params))(q, ids)
    want_q, want_k = apply_rotary_pos_emb(q, k, cos, sin)
    from_spec = posenc.build("mrope:pairing=interleaved,rotary_dim=16,mrope_section=2|3|3", head_dim=32)
    from_dict = posenc.build("mrope", head_dim=32, pairing="interleaved", rope_parameters=params)
    for enc in (from_spec, from_dict, posenc.build(from_dict.spec())):
        got_q, got_k = _ours(enc, ids, q, k)
        torch.testing.assert_close(got_q, want_q, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got_k, want_k, rtol=1e-5, atol=1e-5)
    # the pairing matters: half pairing on the same map differs
    half = posenc.build("mrope:rotary_dim=16,mrope_section=2|3|3", head_dim=32)
    assert not torch.allclose(_ours(half, ids, q, k)[0], want_q, atol=1e-3)


def test_matches_hf_ernie4_5_vl_alternating():
    """ERNIE-4.5-VL: ``[h, w, t]``; the first h + w pairs alternate h, w; the last t pairs use t; interleaved pairing."""
    from transformers.models.ernie4_5_vl_moe.configuration_ernie4_5_vl_moe import Ernie4_5_VLMoeTextConfig
    from transformers.models.ernie4_5_vl_moe.modeling_ernie4_5_vl_moe import (
        Ernie4_5_VLMoeTextRotaryEmbedding,
        apply_rotary_pos_emb,
    )

    params = {"rope_type": "default", "rope_theta": 5e5, "mrope_section": [6, 6, 4]}
    ids = _ids(3, seed=1)
    q, k = torch.randn(2, 2, 11, 32), torch.randn(2, 2, 11, 32)
    cos, sin = Ernie4_5_VLMoeTextRotaryEmbedding(_config(Ernie4_5_VLMoeTextConfig, 32, params))(q, ids)
    want_q, want_k = apply_rotary_pos_emb(q, k, cos, sin)
    enc = posenc.build(
        "mrope:layout=alternating,pairing=interleaved,base=500000,mrope_section=6|6|4", head_dim=32
    )
    got_q, got_k = _ours(enc, ids, q, k)
    torch.testing.assert_close(got_q, want_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_k, want_k, rtol=1e-5, atol=1e-5)
    assert enc.axis_map.tolist() == [1, 2] * 6 + [0] * 4
    assert F.default_mrope_section(128, "alternating") == [22, 22, 20]  # HF's default at d = 128


@pytest.mark.parametrize("section", [[4, 4, 4, 4], [2, 6, 3, 5], [8, 8]])
def test_matches_hf_hunyuan_vl_doubled(section):
    """HunyuanVL (XD-RoPE): bands of 2·n channels over the doubled table, one per axis (4 axes), half pairing."""
    from transformers.models.hunyuan_vl.configuration_hunyuan_vl import HunYuanVLTextConfig
    from transformers.models.hunyuan_vl.modeling_hunyuan_vl import (
        HunYuanVLRotaryEmbedding,
        apply_rotary_pos_emb,
    )

    params = {"rope_type": "default", "rope_theta": 1e4, "mrope_section": section}
    ids = _ids(len(section), seed=2)
    q, k = torch.randn(2, 2, 11, 32), torch.randn(2, 2, 11, 32)
    if len(section) < 3:  # HF's config refuses fewer than 3 axes; the rotary class itself accepts them
        config = _config(HunYuanVLTextConfig, 32, {**params, "mrope_section": [4, 4, 4, 4]})
        config.rope_parameters["mrope_section"] = section
    else:
        config = _config(HunYuanVLTextConfig, 32, params)
    cos, sin = HunYuanVLRotaryEmbedding(config)(q, ids)
    want_q, want_k = apply_rotary_pos_emb(q, k, cos, sin)
    spec = f"mrope:layout=doubled,mrope_section={'|'.join(map(str, section))}"
    enc = posenc.build(spec, head_dim=32)
    assert enc.num_axes == len(section)
    got_q, got_k = _ours(enc, ids, q, k)
    torch.testing.assert_close(got_q, want_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_k, want_k, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------- relative property


def _matrix(enc, ids: list[float], head_dim: int) -> torch.Tensor:
    """The map x -> R(ids) x of one token (float64 input), read off the basis vectors."""
    basis = torch.eye(head_dim, dtype=torch.float64)[None, None]
    tensor = torch.tensor(ids, dtype=torch.float64)[:, None, None].expand(-1, 1, head_dim)
    with enc.position_ids(tensor):
        rotated, _ = enc.rotate(basis, basis, tensor[0].long(), tensor[0].long())
    return rotated[0, 0].T


@pytest.mark.parametrize(
    "spec",
    [
        "mrope:mrope_section=2|3|3",
        "mrope:layout=interleaved",
        "mrope:layout=alternating,pairing=interleaved,mrope_section=2|2|4",
        "mrope:axis_map=3|0|2|1|1|0|3|2,pairing=interleaved",
        "mrope:layout=doubled,mrope_section=2|2|2|2,pairing=interleaved",
    ],
)
def test_relative_in_every_axis_where_pairs_keep_one_axis(spec):
    """R(a)ᵀ R(b) = R(b − a) with a, b id vectors, for every map whose pairs follow one axis each."""
    enc = posenc.build(spec, head_dim=16)
    axes = enc.num_axes
    a = [3.0, 7.0, 1.0, 4.0][:axes]
    b = [10.0, 12.0, 9.0, 13.0][:axes]
    lhs = _matrix(enc, a, 16).T @ _matrix(enc, b, 16)
    torch.testing.assert_close(lhs, _matrix(enc, [y - x for x, y in zip(a, b)], 16), rtol=0, atol=1e-5)


def test_hunyuan_doubled_layout_is_not_relative_at_vision_tokens():
    """With half pairing HunyuanVL's bands give channels k and k + d/2 different axes: not a rotation when ids differ."""
    enc = posenc.build("mrope:layout=doubled,mrope_section=2|2|2|2", head_dim=16)
    assert not enc.pair_consistent
    a, b = [3.0, 7.0, 1.0, 4.0], [10.0, 12.0, 9.0, 13.0]
    lhs = _matrix(enc, a, 16).T @ _matrix(enc, b, 16)
    assert (lhs - _matrix(enc, [y - x for x, y in zip(a, b)], 16)).abs().max() > 0.1
    same = [5.0] * 4  # text tokens (every axis equal) stay a rotation
    m = _matrix(enc, same, 16)
    torch.testing.assert_close(m.T @ m, torch.eye(16, dtype=torch.float64), rtol=0, atol=1e-6)


# ---------------------------------------------------------------------------- real-valued ids


def test_fractional_ids_follow_the_formula():
    """Fractional video time steps: pair k turns by id[axis(k)]·θ_k, written out in float64."""
    enc = posenc.build("mrope:mrope_section=2|3|3", head_dim=16)
    ids = torch.tensor([[0.0, 0.5, 1.25, 2.75], [1.0, 1.0, 2.0, 2.0], [0.0, 1.0, 0.0, 1.0]])
    q = torch.randn(1, 1, 4, 16, dtype=torch.float64)
    with enc.position_ids(ids):
        got, _ = enc.rotate(q, q, torch.zeros(1, 4, dtype=torch.long), torch.zeros(1, 4, dtype=torch.long))
    want = q.clone()
    for k, axis in enumerate([0, 0, 1, 1, 1, 2, 2, 2]):
        angle = ids[axis].double() * 10000.0 ** (-2 * k / 16)
        x1, x2 = q[0, 0, :, k], q[0, 0, :, k + 8]
        want[0, 0, :, k] = x1 * angle.cos() - x2 * angle.sin()
        want[0, 0, :, k + 8] = x2 * angle.cos() + x1 * angle.sin()
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    with enc.position_ids(ids.round().long()):  # whole-number ids as integers: the cached tables
        whole, _ = enc.rotate(q, q, torch.zeros(1, 4, dtype=torch.long), torch.zeros(1, 4, dtype=torch.long))
    with enc.position_ids(ids.round()):
        floats, _ = enc.rotate(q, q, torch.zeros(1, 4, dtype=torch.long), torch.zeros(1, 4, dtype=torch.long))
    torch.testing.assert_close(floats, whole, rtol=0, atol=1e-6)


def test_four_axes_through_sdpa_with_a_cache():
    layer = posenc.MultiheadAttention(64, 4, "mrope:layout=doubled,mrope_section=2|2|2|2", causal=True).eval()
    ids = _ids(4, batch=1, length=9, seed=3).float() * 0.5
    x = torch.randn(1, 9, 64)
    with layer.encoding.position_ids(ids):
        full = layer(x)
    assert layer.last_backend == "sdpa"
    cache, steps = posenc.KVCache(), []
    for start, stop in [(0, 4), (4, 9)]:
        with layer.encoding.position_ids(ids[..., start:stop]):
            steps.append(layer(x[:, start:stop], cache=cache))
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------- bad input


def test_errors_name_the_parameter():
    with pytest.raises(ValueError, match="mrope_section"):  # does not cover the 8 pairs of head_dim 16
        posenc.build("mrope:layout=doubled,mrope_section=2|2|2", head_dim=16)
    with pytest.raises(ValueError, match="mrope_section"):
        posenc.build("mrope:layout=doubled", head_dim=16)  # no default
    with pytest.raises(ValueError, match="mrope_section"):
        posenc.build("mrope:layout=alternating,mrope_section=3|1|4", head_dim=16)  # h != w
    with pytest.raises(ValueError, match="axis_map"):
        posenc.build("mrope:axis_map=0|1|2", head_dim=16)  # 3 entries for 8 pairs
    with pytest.raises(ValueError, match="axis_map"):
        posenc.build("mrope:axis_map=0|1|2|0|1|2|0|1,mrope_section=2|3|3", head_dim=16)
    with pytest.raises(ValueError, match="num_axes"):
        posenc.build("mrope:axis_map=0|1|2|3|0|1|2|3,num_axes=3", head_dim=16)
    with pytest.raises(ValueError, match="pairing"):
        posenc.build("mrope:pairing=diagonal", head_dim=16)
    enc = posenc.build("mrope:layout=doubled,mrope_section=2|2|2|2", head_dim=16)
    with (
        pytest.raises(ValueError, match="num_axes=4"),
        enc.position_ids(torch.zeros(3, 1, 5, dtype=torch.long)),
    ):
        pass
    with pytest.raises(ValueError, match="non-negative"), enc.position_ids(torch.full((4, 1, 5), -0.5)):
        pass
