"""M-RoPE (posenc.encodings.mrope): layouts, scaling and rotations against HF Qwen2-VL, Qwen2.5-VL and
Qwen3-VL (transformers 5.23); the general form (any axes, any map of pairs to axes) against GLM-4V,
ERNIE-4.5-VL, HunyuanVL and the three-axis M-RoPE it replaced; VideoRoPE's rotation against its own code.

Tiny configs built here; nothing is downloaded. docs/conventions.md §9.2-§9.4.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLTextConfig
from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLRotaryEmbedding
from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLTextConfig
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRotaryEmbedding, apply_rotary_pos_emb

import posenc
from _videorope_reference import reference_ids, reference_rotate, video_sequence
from posenc import functional as F
from posenc.encodings.rope_scaling import rope_scaled_inv_freq
from posenc.kernels.rope import RotaryTables, rotary


def _ids(batch: int = 2) -> torch.Tensor:
    """3-axis ids ``[3, B, 14]``: 3 text tokens, a 2x3 image block, then text, rows shifted per batch."""
    text = torch.arange(3)
    vision = F.mrope_grid_ids(3, 1, 2, 3)
    after = torch.arange(5) + int(vision.max()) + 1
    ids = torch.cat([text[None].expand(3, -1), vision, after[None].expand(3, -1)], dim=1)
    return torch.stack([ids + 7 * row for row in range(batch)], dim=1)


def _config(cls, head_dim: int, rope_parameters: dict, max_pos: int = 128):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return cls(
            hidden_size=4 * head_dim,
            num_attention_heads=4,
            head_dim=head_dim,
            max_position_embeddings=max_pos,
            rope_parameters=dict(rope_parameters),
        )


def _hf(rotary_cls, config_cls, head_dim, rope_parameters, ids, q, k, max_pos=128):
    rotary = rotary_cls(_config(config_cls, head_dim, rope_parameters, max_pos))
    cos, sin = rotary(q, ids)
    return cos, sin, *apply_rotary_pos_emb(q, k, cos, sin)


def _ours(enc, ids, q, k):
    plain = ids[0]
    with enc.position_ids(ids):
        return enc.rotate(q, k, plain, plain)


# ---------------------------------------------------------------------------- interleaved (Qwen3-VL)


@pytest.mark.parametrize(("head_dim", "section"), [(16, [4, 2, 2]), (32, [6, 5, 5]), (128, [24, 20, 20])])
def test_interleaved_matches_hf_qwen3_vl(head_dim, section):
    ids = _ids()
    q, k = torch.randn(2, 4, ids.shape[-1], head_dim), torch.randn(2, 2, ids.shape[-1], head_dim)
    params = {"rope_type": "default", "rope_theta": 5e5, "mrope_section": section}
    cos, sin, want_q, want_k = _hf(Qwen3VLTextRotaryEmbedding, Qwen3VLTextConfig, head_dim, params, ids, q, k)
    enc = posenc.build("mrope", head_dim=head_dim, base=5e5, mrope_section=section, layout="interleaved")
    got_cos, got_sin = F.mrope_cos_sin(ids, enc.inv_freq, section, "interleaved")
    torch.testing.assert_close(torch.cat([got_cos, got_cos], -1), cos, rtol=0, atol=1e-6)
    torch.testing.assert_close(torch.cat([got_sin, got_sin], -1), sin, rtol=0, atol=1e-6)
    got_q, got_k = _ours(enc, ids, q, k)
    torch.testing.assert_close(got_q, want_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_k, want_k, rtol=1e-5, atol=1e-5)
    # The layouts differ on vision tokens.
    sectioned = posenc.build("mrope", head_dim=head_dim, base=5e5, mrope_section=section)
    assert not torch.allclose(_ours(sectioned, ids, q, k)[0], want_q, atol=1e-3)


def test_partial_interleaved_matches_hf_qwen3_5():
    """Qwen3.5: interleaved M-RoPE on the first int(head_dim · partial_rotary_factor) channels only."""
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextRotaryEmbedding
    from transformers.models.qwen3_5.modeling_qwen3_5 import apply_rotary_pos_emb as qwen3_5_apply

    ids = _ids()
    q, k = torch.randn(2, 4, ids.shape[-1], 32), torch.randn(2, 2, ids.shape[-1], 32)
    params = {
        "rope_type": "default",
        "rope_theta": 1e6,
        "mrope_section": [4, 2, 2],
        "partial_rotary_factor": 0.5,
    }
    rotary = Qwen3_5TextRotaryEmbedding(_config(Qwen3_5TextConfig, 32, params))
    cos, sin = rotary(q, ids)
    want_q, want_k = qwen3_5_apply(q, k, cos, sin)
    from_dict = posenc.build("mrope", head_dim=32, layout="interleaved", rope_parameters=params)
    from_spec = posenc.build(
        "mrope:layout=interleaved,rotary_dim=16,base=1000000,mrope_section=4|2|2", head_dim=32
    )
    for enc in (from_dict, from_spec, posenc.build(from_dict.spec())):
        got_q, got_k = _ours(enc, ids, q, k)
        torch.testing.assert_close(got_q, want_q, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got_k, want_k, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_q[..., 16:], q[..., 16:], rtol=0, atol=0)


def test_interleaved_default_section_and_axis_map():
    """docs/conventions.md §9.3: HF's [24, 20, 20] at d = 128; [4, 2, 2] at d = 16 with axes t h w t h w t t."""
    assert posenc.build("mrope:layout=interleaved", head_dim=128).mrope_section == [24, 20, 20]
    enc = posenc.build("mrope:layout=interleaved", head_dim=16)
    assert enc.mrope_section == [4, 2, 2]
    assert enc.axis_map.tolist() == [0, 1, 2, 0, 1, 2, 0, 0]
    assert F.mrope_axis_map([2, 3, 3], "section").tolist() == [0, 0, 1, 1, 1, 2, 2, 2]


def test_interleaved_text_tokens_reduce_to_rope_and_cache_equals_full_pass():
    q, k = torch.randn(1, 2, 7, 16), torch.randn(1, 2, 7, 16)
    pos = torch.arange(7)[None] + 11
    got = posenc.build("mrope:layout=interleaved", head_dim=16).rotate(q, k, pos, pos)
    want = posenc.build("rope", head_dim=16).rotate(q, k, pos, pos)
    torch.testing.assert_close(got[0], want[0], rtol=1e-6, atol=1e-6)
    layer = posenc.MultiheadAttention(32, 2, encoding="mrope:layout=interleaved", causal=True).eval()
    ids = torch.cat(
        [torch.arange(2)[None].expand(3, -1), F.mrope_grid_ids(2, 1, 2, 2), torch.full((3, 1), 4)], 1
    )
    x = torch.randn(1, 7, 32)
    with layer.encoding.position_ids(ids):
        full = layer(x)
    cache, steps = posenc.KVCache(), []
    for start, stop in [(0, 2), (2, 6), (6, 7)]:
        with layer.encoding.position_ids(ids[:, start:stop]):
            steps.append(layer(x[:, start:stop], cache=cache))
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-5, atol=1e-5)
    assert layer.encoding.spec() == "mrope:head_dim=16,base=10000.0,layout=interleaved"


# ---------------------------------------------------------------------------- M-RoPE with YaRN

YARN = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "original_max_position_embeddings": 32}


@pytest.mark.parametrize(
    ("layout", "rotary_cls", "config_cls", "section"),
    [
        ("section", Qwen2VLRotaryEmbedding, Qwen2VLTextConfig, [2, 3, 3]),
        ("interleaved", Qwen3VLTextRotaryEmbedding, Qwen3VLTextConfig, [4, 2, 2]),
    ],
)
def test_yarn_matches_hf_qwen_vl(layout, rotary_cls, config_cls, section):
    ids = _ids() * 5  # positions past the original length
    q, k = torch.randn(2, 4, ids.shape[-1], 16), torch.randn(2, 2, ids.shape[-1], 16)
    params = {**YARN, "mrope_section": section}
    cos, _, want_q, want_k = _hf(rotary_cls, config_cls, 16, params, ids, q, k)
    assert float(cos[0, 0, 0]) != pytest.approx(1.0)  # YaRN's attention scale reaches cos
    from_spec = posenc.build(
        f"mrope:layout={layout},mrope_section={'|'.join(map(str, section))},scaling=yarn,factor=4,"
        "original_max_position_embeddings=32",
        head_dim=16,
    )
    from_dict = posenc.build("mrope", head_dim=16, layout=layout, rope_parameters=params)
    for enc in (from_spec, from_dict, posenc.build(from_dict.spec())):
        got_q, got_k = _ours(enc, ids, q, k)
        torch.testing.assert_close(got_q, want_q, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got_k, want_k, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------- bad input


def test_errors_name_the_option():
    with pytest.raises(ValueError, match="mrope_section"):
        posenc.build("mrope:mrope_section=2|3|4", head_dim=16)
    with pytest.raises(ValueError, match="mrope_section"):
        posenc.build("mrope:layout=interleaved,mrope_section=2|3|3", head_dim=16)  # w would need pair 8
    with pytest.raises(ValueError, match="mrope_section"):
        posenc.build(
            "mrope", head_dim=16, rope_parameters={"rope_type": "default", "mrope_section": [4, 4, 4]}
        )
    with pytest.raises(ValueError, match="rotary_dim"):
        posenc.build("mrope:rotary_dim=18", head_dim=16)
    with pytest.raises(ValueError, match="mrope_section"):
        posenc.build("mrope:rotary_dim=8,mrope_section=2|3|3", head_dim=16)  # sums to 8, not 4
    with pytest.raises(ValueError, match="layout"):
        posenc.build("mrope:layout=diagonal", head_dim=16)
    with pytest.raises(ValueError, match="scaling"):
        posenc.build("mrope:scaling=dynamic,factor=2,original_max_position_embeddings=8", head_dim=16)
    with pytest.raises(ValueError, match="original_max_position_embeddings"):
        posenc.build("mrope:scaling=yarn,factor=2", head_dim=16)
    types_ = torch.tensor([0, 1, 1, 1, 0])
    with pytest.raises(ValueError, match="image_grid_thw"):
        F.mrope_position_ids(types_, [[1, 4, 4]], spatial_merge_size=2)  # 3 tokens, grid has 4
    with pytest.raises(ValueError, match="image_grid_thw"):
        F.mrope_position_ids(types_, None)


def test_repr_shows_the_base_and_bands_from_rope_parameters():
    """Issue 49 item 14, as for RoPE: built from rope_parameters, M-RoPE printed base=10000.0 and
    mrope_section=None while it computed with 1e6 and [2, 3, 3]."""
    params = {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 3, 3]}
    text = repr(posenc.build("mrope", head_dim=16, rope_parameters=params))
    assert "base=1000000.0" in text and "mrope_section=[2, 3, 3]" in text, text
    assert "None" not in text, text


@pytest.mark.parametrize(
    ("head_dim", "section", "spacing"), [(32, None, 2), (64, [4, 14, 14], 0.5), (16, [2, 3, 3], 2)]
)
def test_rotation_equals_videorope_code(head_dim, section, spacing):
    tokens, types, images, videos = video_sequence(lead_text=5)
    ids, _ = F.videorope_position_ids(types, images, videos, temporal_spacing=spacing)
    want_ids, _ = reference_ids(tokens, images, videos, merge=2, scale_factor=spacing)
    options = {} if section is None else {"mrope_section": section}
    enc = posenc.build("mrope", head_dim=head_dim, layout="videorope", **options)
    used = section or [4, 6, 6]  # HF Qwen2-VL default at d = 32: [d/8, rest//2, rest - rest//2]
    assert enc.mrope_section == used  # the default is Qwen2-VL's [d/8, ...] (VideoRoPE keeps it)
    gen = torch.Generator().manual_seed(head_dim)
    q, k = torch.randn(2, 1, 3, len(tokens), head_dim, generator=gen)
    positions = torch.arange(len(tokens))[None]
    with enc.position_ids(ids):
        rq, rk = enc.rotate(q, k, positions, positions)
    torch.testing.assert_close(
        rq.double(), reference_rotate(q, want_ids[:, None], used, 10000.0), atol=1e-5, rtol=0
    )
    torch.testing.assert_close(
        rk.double(), reference_rotate(k, want_ids[:, None], used, 10000.0), atol=1e-5, rtol=0
    )


def test_time_takes_the_lowest_frequencies():
    # [16, 24, 24] at d = 128 (VideoRoPE's config): 48 pairs alternate h, w; the last 16 (lowest) are t.
    axes = F.mrope_axis_map([16, 24, 24], "videorope")
    assert axes[:48].tolist() == [1, 2] * 24 and axes[48:].tolist() == [0] * 16
    assert F.mrope_axis_map([2, 3, 3], "videorope").tolist() == [1, 2, 1, 2, 1, 2, 0, 0]


def test_text_only_is_1d_rope():
    types = torch.zeros(2, 9, dtype=torch.int64)
    ids, deltas = F.videorope_position_ids(types, temporal_spacing=2)
    assert torch.equal(ids, torch.arange(9).expand(3, 2, 9)) and deltas.tolist() == [0, 0]
    enc = posenc.build("mrope:layout=videorope", head_dim=32)
    gen = torch.Generator().manual_seed(1)
    q, k = torch.randn(2, 2, 3, 9, 32, generator=gen)
    positions = torch.arange(9)[None].expand(2, 9)
    with enc.position_ids(ids):
        rq, _ = enc.rotate(q, k, positions, positions)
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, 32, 2, dtype=torch.float64) / 32)
    angle = torch.arange(9, dtype=torch.float64)[:, None] * inv_freq
    cos, sin = torch.cat((angle, angle), -1).cos(), torch.cat((angle, angle), -1).sin()
    x = q.double()
    want = x * cos + torch.cat((-x[..., 16:], x[..., :16]), -1) * sin  # 1-D RoPE, rotate_half pairs
    torch.testing.assert_close(rq.double(), want, atol=1e-5, rtol=0)
    plain_q, _ = enc.rotate(q, k, positions, positions)  # plain positions: every axis the same id
    torch.testing.assert_close(plain_q, rq, atol=0, rtol=0)


def test_bad_input_names_the_parameter():
    with pytest.raises(ValueError, match="mrope_section"):
        posenc.build("mrope", head_dim=16, layout="videorope", mrope_section=[2, 3, 2])  # 7 pairs, not 8
    with pytest.raises(ValueError, match="three"):
        posenc.build("mrope", head_dim=16, layout="videorope", mrope_section=[4, 4])
    for spacing in (0, -1.0, float("nan"), True):
        with pytest.raises(ValueError, match="temporal_spacing"):
            F.videorope_position_ids(torch.zeros(3, dtype=torch.int64), temporal_spacing=spacing)
    with pytest.raises(ValueError, match="videorope_position_ids: a run of 5 video tokens"):
        F.videorope_position_ids(torch.tensor([0, 2, 2, 2, 2, 2]), video_grid_thw=[[1, 4, 4]])
    with pytest.raises(ValueError, match="videorope_position_ids: more video runs"):
        F.videorope_position_ids(torch.tensor([0, 2, 2, 2, 2]))


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


# ---------------------------------------------------------------------------- HF models


def _general_config(cls, head_dim: int, params: dict):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return cls(
            hidden_size=2 * head_dim, num_attention_heads=2, head_dim=head_dim, rope_parameters=dict(params)
        )


def _general_ours(enc, ids, q, k):
    with enc.position_ids(ids):
        return enc.rotate(q, k, ids[0], ids[0])


def _general_ids(axes: int, batch: int = 2, length: int = 11, seed: int = 0) -> torch.Tensor:
    """Text positions 0..3 on every axis, then vision tokens with different ids per axis."""
    gen = torch.Generator().manual_seed(seed)
    text = torch.arange(4).expand(axes, batch, -1)
    vision = 4 + torch.randint(0, 40, (axes, batch, length - 4), generator=gen)
    return torch.cat([text, vision], dim=-1)


# ---------------------------------------------------------------------------- relative property


def _general_matrix(enc, ids: list[float], head_dim: int) -> torch.Tensor:
    """The map x -> R(ids) x of one token (float64 input), read off the basis vectors."""
    basis = torch.eye(head_dim, dtype=torch.float64)[None, None]
    tensor = torch.tensor(ids, dtype=torch.float64)[:, None, None].expand(-1, 1, head_dim)
    with enc.position_ids(tensor):
        rotated, _ = enc.rotate(basis, basis, tensor[0].long(), tensor[0].long())
    return rotated[0, 0].T


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
    ids = _general_ids(3)
    q, k = torch.randn(2, 2, 11, 32), torch.randn(2, 2, 11, 32)
    cos, sin = Glm4vTextRotaryEmbedding(_general_config(Glm4vTextConfig, 32, params))(q, ids)
    want_q, want_k = apply_rotary_pos_emb(q, k, cos, sin)
    from_spec = posenc.build("mrope:pairing=interleaved,rotary_dim=16,mrope_section=2|3|3", head_dim=32)
    from_dict = posenc.build("mrope", head_dim=32, pairing="interleaved", rope_parameters=params)
    for enc in (from_spec, from_dict, posenc.build(from_dict.spec())):
        got_q, got_k = _general_ours(enc, ids, q, k)
        torch.testing.assert_close(got_q, want_q, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got_k, want_k, rtol=1e-5, atol=1e-5)
    # the pairing matters: half pairing on the same map differs
    half = posenc.build("mrope:rotary_dim=16,mrope_section=2|3|3", head_dim=32)
    assert not torch.allclose(_general_ours(half, ids, q, k)[0], want_q, atol=1e-3)


def test_matches_hf_ernie4_5_vl_alternating():
    """ERNIE-4.5-VL: ``[h, w, t]``; the first h + w pairs alternate h, w; the last t pairs use t; interleaved pairing."""
    from transformers.models.ernie4_5_vl_moe.configuration_ernie4_5_vl_moe import Ernie4_5_VLMoeTextConfig
    from transformers.models.ernie4_5_vl_moe.modeling_ernie4_5_vl_moe import (
        Ernie4_5_VLMoeTextRotaryEmbedding,
        apply_rotary_pos_emb,
    )

    params = {"rope_type": "default", "rope_theta": 5e5, "mrope_section": [6, 6, 4]}
    ids = _general_ids(3, seed=1)
    q, k = torch.randn(2, 2, 11, 32), torch.randn(2, 2, 11, 32)
    cos, sin = Ernie4_5_VLMoeTextRotaryEmbedding(_general_config(Ernie4_5_VLMoeTextConfig, 32, params))(
        q, ids
    )
    want_q, want_k = apply_rotary_pos_emb(q, k, cos, sin)
    enc = posenc.build(
        "mrope:layout=alternating,pairing=interleaved,base=500000,mrope_section=6|6|4", head_dim=32
    )
    got_q, got_k = _general_ours(enc, ids, q, k)
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
    ids = _general_ids(len(section), seed=2)
    q, k = torch.randn(2, 2, 11, 32), torch.randn(2, 2, 11, 32)
    if len(section) < 3:  # HF's config refuses fewer than 3 axes; the rotary class itself accepts them
        config = _general_config(HunYuanVLTextConfig, 32, {**params, "mrope_section": [4, 4, 4, 4]})
        config.rope_parameters["mrope_section"] = section
    else:
        config = _general_config(HunYuanVLTextConfig, 32, params)
    cos, sin = HunYuanVLRotaryEmbedding(config)(q, ids)
    want_q, want_k = apply_rotary_pos_emb(q, k, cos, sin)
    spec = f"mrope:layout=doubled,mrope_section={'|'.join(map(str, section))}"
    enc = posenc.build(spec, head_dim=32)
    assert enc.num_axes == len(section)
    got_q, got_k = _general_ours(enc, ids, q, k)
    torch.testing.assert_close(got_q, want_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_k, want_k, rtol=1e-5, atol=1e-5)


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
    lhs = _general_matrix(enc, a, 16).T @ _general_matrix(enc, b, 16)
    torch.testing.assert_close(
        lhs, _general_matrix(enc, [y - x for x, y in zip(a, b)], 16), rtol=0, atol=1e-5
    )


def test_hunyuan_doubled_layout_is_not_relative_at_vision_tokens():
    """With half pairing HunyuanVL's bands give channels k and k + d/2 different axes: not a rotation when ids differ."""
    enc = posenc.build("mrope:layout=doubled,mrope_section=2|2|2|2", head_dim=16)
    assert not enc.pair_consistent
    a, b = [3.0, 7.0, 1.0, 4.0], [10.0, 12.0, 9.0, 13.0]
    lhs = _general_matrix(enc, a, 16).T @ _general_matrix(enc, b, 16)
    assert (lhs - _general_matrix(enc, [y - x for x, y in zip(a, b)], 16)).abs().max() > 0.1
    same = [5.0] * 4  # text tokens (every axis equal) stay a rotation
    m = _general_matrix(enc, same, 16)
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
    ids = _general_ids(4, batch=1, length=9, seed=3).float() * 0.5
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


# ---------------------------------------------------------------------------- M-RoPE


def _hf_mrope(head_dim: int, section: list[int], ids: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
    from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLTextConfig
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLRotaryEmbedding, apply_rotary_pos_emb

    config = Qwen2VLTextConfig(
        hidden_size=4 * head_dim,
        num_attention_heads=4,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": section},
    )
    cos, sin = Qwen2VLRotaryEmbedding(config)(q, ids)
    return apply_rotary_pos_emb(q, k, cos, sin)


def test_mrope_matches_hf_qwen2_vl_with_three_axis_ids():
    head_dim, section = 16, [2, 3, 3]
    text = torch.arange(3)
    vision = F.mrope_grid_ids(3, 1, 2, 3)  # one image after three text tokens
    after = torch.arange(3) + int(vision.max()) + 1
    ids = torch.cat([text[None].expand(3, -1), vision, after[None].expand(3, -1)], dim=1)  # [3, 12]
    ids = torch.stack([ids, ids + 2], dim=1)  # [3, B=2, 12]
    q, k = torch.randn(2, 4, 12, head_dim), torch.randn(2, 2, 12, head_dim)
    want_q, want_k = _hf_mrope(head_dim, section, ids, q, k)
    enc = posenc.build("mrope", head_dim=head_dim, mrope_section=section)
    plain = ids[0]
    with enc.position_ids(ids):
        got_q, got_k = enc.rotate(q, k, plain, plain)
    torch.testing.assert_close(got_q, want_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_k, want_k, rtol=1e-5, atol=1e-5)
    assert (
        enc.mrope_section == posenc.build("mrope", head_dim=16).mrope_section
    )  # default [2, 3, 3] at d = 16


def test_mrope_text_tokens_reduce_to_rope():
    q, k = torch.randn(1, 2, 7, 16), torch.randn(1, 2, 7, 16)
    pos = torch.arange(7)[None] + 11
    got = posenc.build("mrope", head_dim=16).rotate(q, k, pos, pos)
    want = posenc.build("rope", head_dim=16).rotate(q, k, pos, pos)
    torch.testing.assert_close(got[0], want[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got[1], want[1], rtol=1e-6, atol=1e-6)


def test_mrope_cached_decoding_with_three_axis_ids_equals_full_pass():
    layer = posenc.MultiheadAttention(32, 2, encoding="mrope", causal=True).eval()
    ids = torch.cat(
        [torch.arange(2)[None].expand(3, -1), F.mrope_grid_ids(2, 1, 2, 2), torch.tensor([[4], [4], [4]])],
        dim=1,
    )
    x = torch.randn(1, 7, 32)
    with layer.encoding.position_ids(ids):
        full = layer(x)
    cache = posenc.KVCache()
    steps = []
    for start, stop in [(0, 2), (2, 6), (6, 7)]:
        with layer.encoding.position_ids(ids[:, start:stop]):
            steps.append(layer(x[:, start:stop], cache=cache))
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(full, layer(x), atol=1e-4)  # the 3-axis ids matter


def test_mrope_errors():
    with pytest.raises(ValueError, match="mrope_section"):
        posenc.build("mrope:mrope_section=2|3|4", head_dim=16)
    enc = posenc.build("mrope", head_dim=16)
    q = torch.randn(1, 1, 4, 16)
    with pytest.raises(ValueError, match="3-axis"), enc.position_ids(torch.zeros(3, 5, dtype=torch.long)):
        enc.rotate(q, q, torch.arange(4)[None], torch.arange(4)[None])
    with pytest.raises(ValueError, match="head_dim"):
        posenc.build("axial_rope", head_dim=6, grid_width=2)
