"""VideoRoPE's own code (github.com/Wiselnn570/VideoRoPE, ``videorope-transformer/modeling_videorope.py``)
followed step by step in float64 on token lists, not through posenc's map or builder: the reference
for VideoRoPE's ids (tests/encodings/test_mrope_ids.py) and its rotation (tests/encodings/test_mrope.py)."""

from __future__ import annotations

import torch

VISION_START, VISION_END, IMAGE_TOKEN, VIDEO_TOKEN = 90, 91, 92, 93


def reference_ids(tokens: list[int], image_grid_thw, video_grid_thw, merge: int, scale_factor: float):
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


def reference_rotate(
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


def video_sequence(lead_text: int = 3):
    """Text, a video (3 frames of 6x4 patches: 3x3x2 tokens at merge 2), text, an image (1x2x3 tokens), text."""
    video, image = [3, 6, 4], [1, 4, 6]
    tokens = [7] * lead_text + [VISION_START] + [VIDEO_TOKEN] * 18 + [VISION_END] + [8, 9]
    tokens += [VISION_START] + [IMAGE_TOKEN] * 6 + [VISION_END] + [10, 11, 12]
    types = torch.tensor([{VIDEO_TOKEN: 2, IMAGE_TOKEN: 1}.get(tok, 0) for tok in tokens])
    return tokens, types, [image], [video]
