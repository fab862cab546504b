"""M-RoPE's position ids (posenc.encodings.mrope_ids) against HF Qwen2-VL's and Qwen2.5-VL's get_rope_index,
VideoRoPE's own id code and hand-worked examples (docs/conventions.md §9.1, §9.8)."""

from __future__ import annotations

import types

import pytest
import torch
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLModel
from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VLModel

import posenc
from _videorope_reference import VIDEO_TOKEN, reference_ids, reference_rotate, video_sequence
from posenc import functional as F

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


@pytest.mark.parametrize("spacing", [2, 1, 2.0, 0.5, 3])
def test_ids_equal_videorope_code(spacing):
    tokens, types, images, videos = video_sequence()
    want, want_delta = reference_ids(tokens, images, videos, merge=2, scale_factor=spacing)
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
    want, want_delta = reference_ids(tokens, [], [[2, 10, 10]], merge=2, scale_factor=2)
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
    want_q, want_k = (reference_rotate(x, want[:, None], [4, 6, 6], 10000.0) for x in (q, k))
    torch.testing.assert_close(
        (rq @ rk.transpose(-1, -2)).double(), want_q @ want_k.transpose(-1, -2), atol=2e-4, rtol=0
    )


def test_padding_and_batches():
    tokens, types, images, videos = video_sequence()
    padded = torch.cat([torch.zeros(2, dtype=torch.int64), types])
    batch = torch.stack([padded, torch.cat([types, torch.zeros(2, dtype=torch.int64)])])
    mask = torch.ones_like(batch)
    mask[0, :2] = 0  # left padding in row 0, right padding in row 1
    mask[1, -2:] = 0
    ids, deltas = F.videorope_position_ids(batch, images * 2, videos * 2, attention_mask=mask)
    want, want_delta = reference_ids(tokens, images, videos, merge=2, scale_factor=2)
    torch.testing.assert_close(ids[:, 0, 2:].double(), want, rtol=0, atol=0)
    torch.testing.assert_close(ids[:, 1, :-2].double(), want, rtol=0, atol=0)
    assert ids[:, 0, :2].eq(0).all() and ids[:, 1, -2:].eq(0).all()
    assert deltas.tolist() == [want_delta, want_delta]


def test_worked_example():
    # docs/conventions.md §9.8, by hand: the 3x3 block at p = 2 is centred on (2, 2), offsets −1, 0, 1.
    types = torch.tensor([0, 0] + [1] * 9 + [0, 0])
    ids, deltas = F.videorope_position_ids(types, image_grid_thw=[[1, 6, 6]])
    assert ids[0, 0].tolist() == [0, 1] + [2] * 9 + [3, 4]
    assert ids[1, 0].tolist() == [0, 1, 1, 1, 1, 2, 2, 2, 3, 3, 3, 3, 4]
    assert ids[2, 0].tolist() == [0, 1, 1, 2, 3, 1, 2, 3, 1, 2, 3, 3, 4]
    assert deltas.tolist() == [-8]


def test_mrope_grid_ids_reference_example():
    """Grid (1, 4, 6) with spatial merge 2 is the LLM grid (1, 2, 3); start 3."""
    ids = F.mrope_grid_ids(3, 1, 4 // 2, 6 // 2)
    assert ids.tolist() == [[3, 3, 3, 3, 3, 3], [3, 3, 3, 4, 4, 4], [3, 4, 5, 3, 4, 5]]
