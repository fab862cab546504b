"""M-RoPE layouts, scaling and position ids against HF Qwen2-VL, Qwen2.5-VL and Qwen3-VL (transformers 5.23).

Tiny configs built here; nothing is downloaded. docs/conventions.md §9.2-§9.4.
"""

from __future__ import annotations

import types
import warnings

import pytest
import torch
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLModel
from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLTextConfig
from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLModel, Qwen2VLRotaryEmbedding
from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLTextConfig
from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRotaryEmbedding, apply_rotary_pos_emb

import posenc
from posenc import functional as F


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


# ---------------------------------------------------------------------------- position ids


def _hf_rope_index(
    model_cls, types_, images, videos, *, merge=2, tokens_per_second=None, seconds=None, mask=None
):
    vision = types.SimpleNamespace(spatial_merge_size=merge, tokens_per_second=tokens_per_second)
    fake = types.SimpleNamespace(config=types.SimpleNamespace(vision_config=vision))
    fake.get_vision_position_ids = lambda *args, **kwargs: model_cls.get_vision_position_ids(
        fake, *args, **kwargs
    )
    extra = {"second_per_grid_ts": seconds} if model_cls is Qwen2_5_VLModel else {}
    return model_cls.get_rope_index(
        fake,
        torch.zeros_like(types_),
        types_,
        image_grid_thw=images,
        video_grid_thw=videos,
        attention_mask=mask,
        **extra,
    )


def _sequence():
    """Two rows of 27 tokens: text, image, text, video, text; the second left-padded by 3."""
    row0 = [0] * 3 + [1] * 6 + [0] * 2 + [2] * 12 + [0] * 4  # image (1, 4, 6), video (3, 4, 4)
    row1 = [0] * 3 + [0] * 5 + [1] * 4 + [0] * 3 + [2] * 2 + [0] * 10  # image (1, 4, 4), video (2, 2, 2)
    token_types = torch.tensor([row0, row1])
    mask = torch.ones_like(token_types)
    mask[1, :3] = 0
    images = torch.tensor([[1, 4, 6], [1, 4, 4]])
    videos = torch.tensor([[3, 4, 4], [2, 2, 2]])
    return token_types, mask, images, videos


def test_position_ids_match_hf_qwen2_vl_get_rope_index():
    token_types, mask, images, videos = _sequence()
    want, want_deltas = _hf_rope_index(Qwen2VLModel, token_types, images, videos, mask=mask)
    got, deltas = F.mrope_position_ids(token_types, images, videos, spatial_merge_size=2, attention_mask=mask)
    assert torch.equal(got, want) and deltas.tolist() == want_deltas.flatten().tolist()


@pytest.mark.parametrize("seconds", [None, [0.75, 1.25], [2.0, 0.5]])
def test_position_ids_match_hf_qwen2_5_vl_time_aligned(seconds):
    token_types, mask, images, videos = _sequence()
    hf_seconds = torch.tensor(seconds) if seconds is not None else None
    want, want_deltas = _hf_rope_index(
        Qwen2_5_VLModel, token_types, images, videos, tokens_per_second=2, seconds=hf_seconds, mask=mask
    )
    got, deltas = F.mrope_position_ids(
        token_types,
        images.tolist(),
        videos,
        spatial_merge_size=2,
        tokens_per_second=2,
        second_per_grid_ts=seconds,
        attention_mask=mask,
    )
    assert torch.equal(got, want) and deltas.tolist() == want_deltas.flatten().tolist()


def test_position_ids_reference_example():
    """docs/conventions.md §9.4: text 2, video (3, 2, 2) with merge 1 at 1.5 s/step, 2 tokens/s, text 1."""
    types_ = torch.tensor([0, 0] + [2] * 12 + [0])
    ids, deltas = F.mrope_position_ids(
        types_,
        video_grid_thw=[[3, 2, 2]],
        spatial_merge_size=1,
        tokens_per_second=2,
        second_per_grid_ts=[0.75],
    )
    assert ids[0, 0].tolist() == [0, 1] + [2] * 4 + [3] * 4 + [5] * 4 + [4]
    assert ids[1, 0].tolist() == [0, 1] + [2, 2, 3, 3] * 3 + [4]
    assert ids[2, 0].tolist() == [0, 1] + [2, 3, 2, 3] * 3 + [4]
    assert deltas.tolist() == [6 - 15]


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
