"""VideoRoPE (Wei et al. 2025) as a layout of the general M-RoPE plus its id builder.

The expected values are written here, in float64, from VideoRoPE's own code (github.com/Wiselnn570/VideoRoPE,
``videorope-transformer/modeling_videorope.py``): ``get_t_scale_rope_index`` (the diagonal layout and the
temporal spacing ``scale_factor``) and ``apply_m_modify_multimodal_rotary_pos_emb`` (the low-frequency
temporal allocation), followed step by step on token lists, not through posenc's map or builder.
"""

from __future__ import annotations

import pytest
import torch

import posenc
from posenc import functional as F

VISION_START, VISION_END, IMAGE_TOKEN, VIDEO_TOKEN = 90, 91, 92, 93


def _reference_ids(tokens: list[int], image_grid_thw, video_grid_thw, merge: int, scale_factor: float):
    """``get_t_scale_rope_index`` for one unpadded row, in float64: ``(ids [3, T], delta)``."""
    pieces, start = [], 0
    images, videos = list(image_grid_thw), list(video_grid_thw)
    while True:
        candidates = [tokens.index(tok, start) for tok in (IMAGE_TOKEN, VIDEO_TOKEN) if tok in tokens[start:]]
        if not candidates:
            break
        end = min(candidates)
        t, h, w = (images if tokens[end] == IMAGE_TOKEN else videos).pop(0)
        gt, gh, gw = t, h // merge, w // merge
        text_len = end - start
        st_idx = pieces[-1][0].max() + 1 if pieces else 0.0
        pieces.append(torch.arange(text_len, dtype=torch.float64).expand(3, -1) + st_idx)
        t_index = torch.arange(gt, dtype=torch.float64).view(-1, 1).expand(-1, gh * gw).flatten()
        h_index = (
            torch.arange(gh, dtype=torch.float64).view(1, -1, 1).expand(gt, -1, gw).flatten() - (gh - 1) // 2
        )
        w_index = (
            torch.arange(gw, dtype=torch.float64).view(1, 1, -1).expand(gt, gh, -1).flatten() - (gw - 1) // 2
        )
        t_index = t_index * scale_factor + text_len + st_idx
        pieces.append(torch.stack([t_index, h_index + t_index, w_index + t_index]))
        start = end + gt * gh * gw
    if start < len(tokens):
        st_idx = pieces[-1][0].max() + 1 if pieces else 0.0
        pieces.append(torch.arange(len(tokens) - start, dtype=torch.float64).expand(3, -1) + st_idx)
    ids = torch.cat(pieces, dim=1)
    return ids, float(ids[0].max() + 1 - len(tokens))


def _reference_rotate(
    x: torch.Tensor, ids: torch.Tensor, mrope_section: list[int], base: float
) -> torch.Tensor:
    """``apply_m_modify_multimodal_rotary_pos_emb`` in float64: ``x [B, H, T, D]``, ``ids [3, B, T]``."""
    dim = x.shape[-1]
    inv_freq = 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    freqs = ids.double()[..., None] * inv_freq  # [3, B, T, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    sections = [mrope_section[0], mrope_section[1] + mrope_section[2]] * 2
    index, cos_parts, sin_parts = 0, [], []
    for i, section in enumerate(sections[::-1]):
        if i % 2 == 0:  # the h/w block: one channel at a time, h, w, h, w, ...
            for j in range(section):
                row = 1 if j % 2 == 0 else 2
                cos_parts.append(cos[row, ..., index : index + 1])
                sin_parts.append(sin[row, ..., index : index + 1])
                index += 1
        else:  # the t block
            cos_parts.append(cos[0, ..., index : index + section])
            sin_parts.append(sin[0, ..., index : index + section])
            index += section
    cos, sin = torch.cat(cos_parts, -1)[:, None], torch.cat(sin_parts, -1)[:, None]
    x = x.double()
    rotated = torch.cat((-x[..., dim // 2 :], x[..., : dim // 2]), dim=-1)
    return x * cos + rotated * sin


def _sequence(lead_text: int = 3):
    """Text, a video (3 frames of 6x4 patches: 3x3x2 tokens at merge 2), text, an image (1x2x3 tokens), text."""
    video, image = [3, 6, 4], [1, 4, 6]
    tokens = [7] * lead_text + [VISION_START] + [VIDEO_TOKEN] * 18 + [VISION_END] + [8, 9]
    tokens += [VISION_START] + [IMAGE_TOKEN] * 6 + [VISION_END] + [10, 11, 12]
    types = torch.tensor([{VIDEO_TOKEN: 2, IMAGE_TOKEN: 1}.get(tok, 0) for tok in tokens])
    return tokens, types, [image], [video]


@pytest.mark.parametrize("spacing", [2, 1, 2.0, 0.5, 3])
def test_ids_equal_videorope_code(spacing):
    tokens, types, images, videos = _sequence()
    want, want_delta = _reference_ids(tokens, images, videos, merge=2, scale_factor=spacing)
    ids, deltas = F.videorope_position_ids(types, images, videos, temporal_spacing=spacing)
    assert ids.shape == (3, 1, len(tokens))
    assert ids.dtype == (torch.int64 if isinstance(spacing, int) else torch.float32)
    torch.testing.assert_close(ids[:, 0].double(), want, rtol=0, atol=0)
    assert float(deltas[0]) == want_delta
    # The diagonal: the video's middle row and first column share t; the text after it goes on from its last t.
    assert want[1, 4 + 2] == want[0, 4 + 2] and want[2, 4] == want[0, 4]


def test_negative_ids_are_videorope_s_and_a_shift_keeps_every_attention_score():
    # 2 frames of 5x5 tokens right after one text token: (5 − 1)//2 = 2 > the start 1, so h and w go negative.
    tokens = [7] + [VIDEO_TOKEN] * 50 + [8]
    types = torch.tensor([2 if tok == VIDEO_TOKEN else 0 for tok in tokens])
    want, want_delta = _reference_ids(tokens, [], [[2, 10, 10]], merge=2, scale_factor=2)
    ids, deltas = F.videorope_position_ids(types, video_grid_thw=[[2, 10, 10]])
    torch.testing.assert_close(ids[:, 0].double(), want, rtol=0, atol=0)
    assert want.min() == -1 and float(deltas[0]) == want_delta
    shifted, shifted_deltas = F.videorope_position_ids(types, video_grid_thw=[[2, 10, 10]], non_negative=True)
    torch.testing.assert_close(shifted[:, 0].double(), want + 1, rtol=0, atol=0)
    assert float(shifted_deltas[0]) == want_delta + 1
    enc = posenc.build("mrope:layout=videorope", head_dim=32)
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 1, 2, len(tokens), 32, generator=gen)
    with pytest.raises(ValueError, match="non_negative=True"), enc.position_ids(ids):
        enc.rotate(q, k, torch.arange(len(tokens))[None], torch.arange(len(tokens))[None])
    with enc.position_ids(shifted):
        rq, rk = enc.rotate(q, k, torch.arange(len(tokens))[None], torch.arange(len(tokens))[None])
    want_q, want_k = (_reference_rotate(x, want[:, None], [4, 6, 6], 10000.0) for x in (q, k))
    torch.testing.assert_close(
        (rq @ rk.transpose(-1, -2)).double(), want_q @ want_k.transpose(-1, -2), atol=2e-4, rtol=0
    )


@pytest.mark.parametrize(
    ("head_dim", "section", "spacing"), [(32, None, 2), (64, [4, 14, 14], 0.5), (16, [2, 3, 3], 2)]
)
def test_rotation_equals_videorope_code(head_dim, section, spacing):
    tokens, types, images, videos = _sequence(lead_text=5)
    ids, _ = F.videorope_position_ids(types, images, videos, temporal_spacing=spacing)
    want_ids, _ = _reference_ids(tokens, images, videos, merge=2, scale_factor=spacing)
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
        rq.double(), _reference_rotate(q, want_ids[:, None], used, 10000.0), atol=1e-5, rtol=0
    )
    torch.testing.assert_close(
        rk.double(), _reference_rotate(k, want_ids[:, None], used, 10000.0), atol=1e-5, rtol=0
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


def test_padding_and_batches():
    tokens, types, images, videos = _sequence()
    padded = torch.cat([torch.zeros(2, dtype=torch.int64), types])
    batch = torch.stack([padded, torch.cat([types, torch.zeros(2, dtype=torch.int64)])])
    mask = torch.ones_like(batch)
    mask[0, :2] = 0  # left padding in row 0, right padding in row 1
    mask[1, -2:] = 0
    ids, deltas = F.videorope_position_ids(batch, images * 2, videos * 2, attention_mask=mask)
    want, want_delta = _reference_ids(tokens, images, videos, merge=2, scale_factor=2)
    torch.testing.assert_close(ids[:, 0, 2:].double(), want, rtol=0, atol=0)
    torch.testing.assert_close(ids[:, 1, :-2].double(), want, rtol=0, atol=0)
    assert ids[:, 0, :2].eq(0).all() and ids[:, 1, -2:].eq(0).all()
    assert deltas.tolist() == [want_delta, want_delta]


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


def test_worked_example():
    # docs/conventions.md §9.8, by hand: the 3x3 block at p = 2 is centred on (2, 2), offsets −1, 0, 1.
    types = torch.tensor([0, 0] + [1] * 9 + [0, 0])
    ids, deltas = F.videorope_position_ids(types, image_grid_thw=[[1, 6, 6]])
    assert ids[0, 0].tolist() == [0, 1] + [2] * 9 + [3, 4]
    assert ids[1, 0].tolist() == [0, 1, 1, 1, 1, 2, 2, 2, 3, 3, 3, 3, 4]
    assert ids[2, 0].tolist() == [0, 1, 1, 2, 3, 1, 2, 3, 1, 2, 3, 3, 4]
    assert deltas.tolist() == [-8]
