"""M-RoPE position ids: the 3-axis ``(t, h, w)`` ids of text, image and video tokens (Qwen2-VL, Qwen2.5-VL, VideoRoPE).

:func:`mrope_grid_ids` gives the ids of one vision block, :func:`mrope_position_ids` those of a
whole text + image + video sequence, as HF Qwen2-VL / Qwen2.5-VL ``get_rope_index`` (Qwen2.5-VL's
time-aligned temporal ids included). :func:`videorope_grid_ids` and
:func:`videorope_position_ids` give VideoRoPE's (Wei et al. 2025): the diagonal layout and the
adjustable temporal spacing, as its code's ``get_t_scale_rope_index``.
:class:`~posenc.encodings.mrope.MRoPE` reads them through its ``position_ids`` context manager
(docs/conventions.md §9.2, §9.7).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import Tensor

__functional__ = ["mrope_grid_ids", "mrope_position_ids", "videorope_grid_ids", "videorope_position_ids"]

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


def videorope_grid_ids(
    start: float, grid_t: int, grid_h: int, grid_w: int, temporal_spacing: float = 2
) -> Tensor:
    """VideoRoPE's ids ``[3, grid_t·grid_h·grid_w]`` of one vision block starting at ``start`` (diagonal layout).

    ``t = start + δ·t_index`` (δ = ``temporal_spacing``, VideoRoPE's ATS ``scale_factor``, 2 in its
    runs), ``h = t + row − (grid_h − 1)//2``, ``w = t + col − (grid_w − 1)//2``: each frame is
    centred on the diagonal ``t = h = w`` that the text runs along. Tokens in (t, row, col) order,
    LLM grid (after spatial merging). int64 when ``δ`` is an int, else float32 (as VideoRoPE's code).
    """
    steps = torch.arange(grid_t)
    temporal = (
        steps * temporal_spacing if isinstance(temporal_spacing, int) else steps * float(temporal_spacing)
    )
    t = (temporal + start)[:, None, None].expand(grid_t, grid_h, grid_w)
    rows = torch.arange(grid_h)[None, :, None] - (grid_h - 1) // 2
    cols = torch.arange(grid_w)[None, None, :] - (grid_w - 1) // 2
    return torch.stack([t.flatten(), (t + rows).flatten(), (t + cols).flatten()])


def _grid(value: Any, name: str, index: int, who: str) -> tuple[int, int, int]:
    grid = [int(v) for v in (value.tolist() if isinstance(value, Tensor) else value)]
    if len(grid) != 3 or min(grid) <= 0:
        raise ValueError(f"{who}: {name}[{index}] must be three positive sizes (t, h, w), got {grid}")
    return grid[0], grid[1], grid[2]


def _check_types(token_types: Tensor, spatial_merge_size: int, who: str) -> Tensor:
    if token_types.dim() == 1:
        token_types = token_types[None]
    if token_types.dim() != 2 or token_types.dtype.is_floating_point:
        raise ValueError(f"{who}: token_types must be integer [B, T], got {tuple(token_types.shape)}")
    if spatial_merge_size <= 0:
        raise ValueError(f"{who}: spatial_merge_size must be positive, got {spatial_merge_size}")
    return token_types


def _runs(
    types: list[int], grids: dict[int, Iterator[Any]], counters: dict[int, int], merge: int, who: str
) -> Iterator[tuple[int, int, tuple[int, int, int] | None]]:
    """``(kind, length, LLM grid (t, h/m, w/m))`` of each run of one row's real tokens; text runs have no grid.

    Each run of image (video) tokens takes the next grid of its kind (``counters`` counts them).
    """
    for kind, run in itertools.groupby(types):
        length = len(list(run))
        if kind == TEXT:
            yield kind, length, None
            continue
        if kind not in grids:
            raise ValueError(f"{who}: token type {kind} is not 0 (text), 1 (image) or 2 (video)")
        name = "image_grid_thw" if kind == IMAGE else "video_grid_thw"
        value = next(grids[kind], None)
        if value is None:
            raise ValueError(f"{who}: more {name[:5]} runs than {name} entries")
        grid = _grid(value, name, counters[kind], who)
        if grid[1] % merge or grid[2] % merge:
            raise ValueError(
                f"{who}: {name}[{counters[kind]}] = {grid} is not divisible by spatial_merge_size={merge}"
            )
        llm = grid[0], grid[1] // merge, grid[2] // merge
        if length != llm[0] * llm[1] * llm[2]:
            raise ValueError(
                f"{who}: a run of {length} {name[:5]} tokens, but {name}[{counters[kind]}] = {grid} with "
                f"spatial_merge_size={merge} has {llm[0] * llm[1] * llm[2]}"
            )
        counters[kind] += 1
        yield kind, length, llm


def _walk(
    token_types: Tensor,
    image_grid_thw: Any,
    video_grid_thw: Any,
    attention_mask: Tensor | None,
    merge: int,
    who: str,
) -> Iterator[tuple[int, Tensor, Iterator[tuple[int, int, tuple[int, int, int] | None]]]]:
    """``(row, keep, runs)`` of each row: the mask of its real tokens and :func:`_runs` over them."""
    grids = {
        IMAGE: iter(list(image_grid_thw) if image_grid_thw is not None else []),
        VIDEO: iter(list(video_grid_thw) if video_grid_thw is not None else []),
    }
    counters = {IMAGE: 0, VIDEO: 0}
    for row, types in enumerate(token_types):
        keep = (
            attention_mask[row].bool()
            if attention_mask is not None
            else torch.ones_like(types, dtype=torch.bool)
        )
        yield row, keep, _runs(types[keep].tolist(), grids, counters, merge, who)


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
        image_grid_thw: ``[N, 3]`` image patch grids ``(t, h, w)`` before spatial merging.
        video_grid_thw: ``[N, 3]`` video patch grids ``(t, h, w)``, likewise.
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
    token_types = _check_types(token_types, spatial_merge_size, "mrope_position_ids")
    seconds = iter([float(s) for s in second_per_grid_ts] if second_per_grid_ts is not None else [])
    ids = torch.zeros(3, *token_types.shape, dtype=torch.int64)
    deltas = []
    walk = _walk(
        token_types, image_grid_thw, video_grid_thw, attention_mask, spatial_merge_size, "mrope_position_ids"
    )
    for row, keep, runs in walk:
        blocks, position = [], 0
        for kind, length, grid in runs:
            if grid is None:
                blocks.append(torch.arange(position, position + length).expand(3, -1))
                position += length
                continue
            interval: float = 1
            if kind == VIDEO and tokens_per_second is not None:
                interval = float(tokens_per_second) * next(seconds, 1.0)
            blocks.append(mrope_grid_ids(position, *grid, interval))
            position += max(grid[1], grid[2])
        row_ids = torch.cat(blocks, dim=1) if blocks else torch.zeros(3, 0, dtype=torch.int64)
        ids[:, row, keep] = row_ids
        deltas.append((int(row_ids.max()) + 1 if row_ids.numel() else 0) - row_ids.shape[1])
    return ids.to(token_types.device), torch.tensor(deltas, device=token_types.device)


def videorope_position_ids(
    token_types: Tensor,
    image_grid_thw: Tensor | Sequence[Sequence[int]] | None = None,
    video_grid_thw: Tensor | Sequence[Sequence[int]] | None = None,
    *,
    spatial_merge_size: int = 2,
    temporal_spacing: float = 2,
    attention_mask: Tensor | None = None,
    non_negative: bool = False,
) -> tuple[Tensor, Tensor]:
    """VideoRoPE's 3-axis ids of text + image + video sequences (its code's ``get_t_scale_rope_index``).

    Read with ``mrope:layout=videorope`` (low-frequency temporal allocation). Arguments as
    :func:`mrope_position_ids`, plus:

    Args:
        temporal_spacing: δ, the step of ``t`` between frames (VideoRoPE's adjustable temporal
            spacing, ``scale_factor``; 2 in its runs). An int gives int64 ids, a float float32 ids.
        non_negative: add one constant per row to every id (and delta) so that the row's smallest
            id is 0. A block starting before ``(h/m − 1)//2`` has negative ``h``/``w`` ids
            (VideoRoPE's too), which :class:`~posenc.encodings.mrope.MRoPE` refuses; a common shift
            of all axes changes no attention score.

    Returns:
        ``(ids [3, B, T], deltas [B])``: a text run continues ``p, p+1, …`` on every axis; a vision
        block starting at ``p`` gets :func:`videorope_grid_ids` and moves ``p`` to its last
        ``t`` + 1 (the text after a video goes on from its last frame, on the diagonal).
        ``deltas = max(t) + 1 − (number of real tokens)`` per row, as its code's ``rope_deltas``.
        Text-only rows get ``t = h = w = 0, 1, 2, …``: 1-D RoPE.
    """
    token_types = _check_types(token_types, spatial_merge_size, "videorope_position_ids")
    if (
        isinstance(temporal_spacing, bool)
        or not isinstance(temporal_spacing, (int, float))
        or not (math.isfinite(temporal_spacing) and temporal_spacing > 0)
    ):
        raise ValueError(
            f"videorope_position_ids: temporal_spacing must be a positive finite number (VideoRoPE uses 2), "
            f"got temporal_spacing={temporal_spacing!r}"
        )
    dtype = torch.int64 if isinstance(temporal_spacing, int) else torch.float32
    ids = torch.zeros(3, *token_types.shape, dtype=dtype)
    deltas = torch.zeros(token_types.shape[0], dtype=dtype)
    walk = _walk(
        token_types,
        image_grid_thw,
        video_grid_thw,
        attention_mask,
        spatial_merge_size,
        "videorope_position_ids",
    )
    for row, keep, runs in walk:
        blocks, position = [], torch.zeros((), dtype=dtype)
        for _kind, length, grid in runs:
            if grid is None:
                blocks.append((torch.arange(length, dtype=dtype) + position).expand(3, -1))
                position = position + length
                continue
            block = videorope_grid_ids(position, *grid, temporal_spacing=temporal_spacing)
            blocks.append(block)
            position = block[0].max() + 1
        row_ids = torch.cat(blocks, dim=1) if blocks else torch.zeros(3, 0, dtype=dtype)
        deltas[row] = position - row_ids.shape[1]  # position: the last t + 1 (or the text's next id)
        shift = row_ids.min().clamp(max=0) if non_negative and row_ids.numel() else 0
        ids[:, row, keep] = row_ids - shift
        deltas[row] -= shift
    return ids.to(token_types.device), deltas.to(token_types.device)
