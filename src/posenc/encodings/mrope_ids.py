"""M-RoPE position ids: the 3-axis ``(t, h, w)`` ids of text, image and video tokens (Qwen2-VL, Qwen2.5-VL).

:func:`mrope_grid_ids` gives the ids of one vision block, :func:`mrope_position_ids` those of a
whole text + image + video sequence, as HF Qwen2-VL / Qwen2.5-VL ``get_rope_index`` (Qwen2.5-VL's
time-aligned temporal ids included). :class:`~posenc.encodings.mrope.MRoPE` reads them through
its ``position_ids`` context manager (docs/conventions.md §9.2).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

__functional__ = ["mrope_grid_ids", "mrope_position_ids"]

#: ``mm_token_type_ids`` values of HF Qwen-VL processors.
TEXT, IMAGE, VIDEO = 0, 1, 2


def mrope_grid_ids(start: int, grid_t: int, grid_h: int, grid_w: int, temporal_interval: float = 1) -> Tensor:
    """3-axis ids ``[3, grid_t·grid_h·grid_w]`` of one vision block starting at position ``start``.

    ``t = start + int(t_index·temporal_interval)``, ``h = start + row``, ``w = start + col``, tokens
    in (t, row, col) order; the grid is the LLM grid (after spatial merging), as in HF
    ``get_rope_index``. A fractional ``temporal_interval`` (Qwen2.5-VL's ``tokens_per_second ·
    second_per_grid_t``) is multiplied in float32 and truncated, as HF does.
    """
    steps = torch.arange(grid_t)
    if isinstance(temporal_interval, int):
        temporal = steps * temporal_interval
    else:
        temporal = (steps * float(temporal_interval)).long()
    t = temporal[:, None, None].expand(grid_t, grid_h, grid_w)
    h = torch.arange(grid_h)[None, :, None].expand(grid_t, grid_h, grid_w)
    w = torch.arange(grid_w)[None, None, :].expand(grid_t, grid_h, grid_w)
    return torch.stack([t.flatten(), h.flatten(), w.flatten()]) + start


def _grid(value: Any, name: str, index: int) -> tuple[int, int, int]:
    grid = [int(v) for v in (value.tolist() if isinstance(value, Tensor) else value)]
    if len(grid) != 3 or min(grid) <= 0:
        raise ValueError(
            f"mrope_position_ids: {name}[{index}] must be three positive sizes (t, h, w), got {grid}"
        )
    return grid[0], grid[1], grid[2]


def mrope_position_ids(
    token_types: Tensor,
    image_grid_thw: Tensor | Sequence[Sequence[int]] | None = None,
    video_grid_thw: Tensor | Sequence[Sequence[int]] | None = None,
    *,
    spatial_merge_size: int = 2,
    tokens_per_second: float | None = None,
    second_per_grid_ts: Sequence[float] | Tensor | None = None,
    attention_mask: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """3-axis position ids of text + image + video sequences, as HF Qwen2-VL / Qwen2.5-VL ``get_rope_index``.

    Args:
        token_types: ``[B, T]`` (or ``[T]``) integers, 0 text, 1 image, 2 video (HF's
            ``mm_token_type_ids``). Each run of image (video) tokens is one image (video) and takes
            the next grid, in order over the whole batch.
        image_grid_thw, video_grid_thw: ``[N, 3]`` patch grids ``(t, h, w)`` before spatial merging.
        spatial_merge_size: ``m``; a vision block has ``t · (h/m) · (w/m)`` tokens.
        tokens_per_second: None for Qwen2-VL (temporal ids step by 1); Qwen2.5-VL's
            ``vision_config.tokens_per_second``: video frames step by
            ``tokens_per_second · second_per_grid_t`` (images still by 1).
        second_per_grid_ts: seconds per temporal grid step of each video (default 1 each).
        attention_mask: ``[B, T]``, 1 for real tokens; padding gets id 0 and is skipped.

    Returns:
        ``(ids [3, B, T] int64, deltas [B])``: text runs continue ``1, 2, 3, …`` from the current
        position ``p``; a vision block starting at ``p`` gets :func:`mrope_grid_ids` and moves ``p``
        on by ``max(h, w) / m``. ``deltas = max(ids) + 1 − (number of real tokens)`` per row (HF's
        ``rope_deltas``, the offset of the positions generated after the prompt).

    Raises:
        ValueError: a run of vision tokens whose length is not its grid's token count, too few
            grids, a token type other than 0/1/2, or a grid not divisible by the merge size.
    """
    if token_types.dim() == 1:
        token_types = token_types[None]
    if token_types.dim() != 2 or token_types.dtype.is_floating_point:
        raise ValueError(
            f"mrope_position_ids: token_types must be integer [B, T], got {tuple(token_types.shape)}"
        )
    if spatial_merge_size <= 0:
        raise ValueError(f"mrope_position_ids: spatial_merge_size must be positive, got {spatial_merge_size}")
    grids = {
        IMAGE: iter(list(image_grid_thw) if image_grid_thw is not None else []),
        VIDEO: iter(list(video_grid_thw) if video_grid_thw is not None else []),
    }
    seconds = iter([float(s) for s in second_per_grid_ts] if second_per_grid_ts is not None else [])
    ids = torch.zeros(3, *token_types.shape, dtype=torch.int64)
    deltas = []
    counters = {IMAGE: 0, VIDEO: 0}
    for row, types in enumerate(token_types):
        keep = (
            attention_mask[row].bool()
            if attention_mask is not None
            else torch.ones_like(types, dtype=torch.bool)
        )
        blocks, position = [], 0
        for kind, run in itertools.groupby(types[keep].tolist()):
            length = len(list(run))
            if kind == TEXT:
                blocks.append(torch.arange(position, position + length).expand(3, -1))
                position += length
                continue
            if kind not in grids:
                raise ValueError(
                    f"mrope_position_ids: token type {kind} is not 0 (text), 1 (image) or 2 (video)"
                )
            name = "image_grid_thw" if kind == IMAGE else "video_grid_thw"
            value = next(grids[kind], None)
            if value is None:
                raise ValueError(f"mrope_position_ids: more {name[:5]} runs than {name} entries")
            grid_t, grid_h, grid_w = _grid(value, name, counters[kind])
            if grid_h % spatial_merge_size or grid_w % spatial_merge_size:
                raise ValueError(
                    f"mrope_position_ids: {name}[{counters[kind]}] = {(grid_t, grid_h, grid_w)} is not divisible "
                    f"by spatial_merge_size={spatial_merge_size}"
                )
            llm_h, llm_w = grid_h // spatial_merge_size, grid_w // spatial_merge_size
            if length != grid_t * llm_h * llm_w:
                raise ValueError(
                    f"mrope_position_ids: a run of {length} {name[:5]} tokens, but {name}[{counters[kind]}] = "
                    f"{(grid_t, grid_h, grid_w)} with spatial_merge_size={spatial_merge_size} has "
                    f"{grid_t * llm_h * llm_w}"
                )
            counters[kind] += 1
            interval: float = 1
            if kind == VIDEO and tokens_per_second is not None:
                interval = float(tokens_per_second) * next(seconds, 1.0)
            blocks.append(mrope_grid_ids(position, grid_t, llm_h, llm_w, interval))
            position += max(llm_h, llm_w)
        row_ids = torch.cat(blocks, dim=1) if blocks else torch.zeros(3, 0, dtype=torch.int64)
        ids[:, row, keep] = row_ids
        deltas.append((int(row_ids.max()) + 1 if row_ids.numel() else 0) - row_ids.shape[1])
    return ids.to(token_types.device), torch.tensor(deltas, device=token_types.device)
