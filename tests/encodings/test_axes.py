"""Multi-axis position ids (posenc.encodings._axes): ids of another batch are refused naming the position
ids, instead of a raw kernel error (issue 49 item 9: the error came from einsum for ComRoPE and LieRE,
from the RoPE kernel for M-RoPE and STRING); ids of batch one or of the call's batch serve."""

from __future__ import annotations

import pytest
import torch

import posenc

AXIS_SPECS = ["comrope:num_axes=3", "liere:num_axes=3", "mrope", "string:num_axes=3"]


@pytest.mark.parametrize("spec", AXIS_SPECS)
def test_multi_axis_ids_of_another_batch_name_the_position_ids(spec):
    torch.manual_seed(0)
    attn = posenc.MultiheadAttention(48, 2, encoding=spec)
    x = torch.randn(2, 5, 48)
    ids = torch.zeros(3, 3, 5, dtype=torch.long)  # batch 3 for a call of batch 2
    message = r"position ids have batch 3 but the (queries|keys) have batch 2"
    with pytest.raises(ValueError, match=message), attn.encoding.position_ids(ids):
        attn(x)


@pytest.mark.parametrize("spec", AXIS_SPECS)
def test_multi_axis_ids_of_batch_one_or_the_call_batch_still_serve(spec):
    """The check refuses only a mismatch: ids ``[A, T]`` (every row) and ``[A, B, T]`` give one output."""
    torch.manual_seed(0)
    attn = posenc.MultiheadAttention(48, 2, encoding=spec)
    x = torch.randn(2, 5, 48)
    ids = torch.arange(5).expand(3, 5)
    with attn.encoding.position_ids(ids):
        shared = attn(x)
    with attn.encoding.position_ids(ids[:, None].expand(3, 2, 5)):
        per_row = attn(x)
    torch.testing.assert_close(shared, per_row)
