"""2-D sinusoidal (MAE) against HF ViT-MAE's table and docs/conventions.md §2.3."""

from __future__ import annotations

import pytest
import torch

import posenc
from posenc import functional as F

# ---------------------------------------------------------------------------- 2-D sinusoidal


def test_sinusoidal2d_reference_example():
    """D = 8, 2×3 grid, patch (row 1, col 2) = flattened position 5: [sin w, cos w | sin h, cos h]."""
    enc = posenc.build("sinusoidal2d", dim=8, grid_width=3)
    got = enc.encode(torch.tensor([[5]]))[0, 0]
    want = torch.tensor([0.909297, 0.019999, -0.416147, 0.999800, 0.841471, 0.010000, 0.540302, 0.999950])
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    rows, cols = F.grid_row_col(torch.arange(6), 3)
    assert rows.tolist() == [0, 0, 0, 1, 1, 1] and cols.tolist() == [0, 1, 2, 0, 1, 2]


def test_sinusoidal2d_matches_hf_vit_mae_table_with_cls_token():
    from transformers import ViTMAEConfig
    from transformers.models.vit_mae.modeling_vit_mae import ViTMAEEmbeddings

    config = ViTMAEConfig(hidden_size=16, image_size=8, patch_size=2, num_channels=3)  # a 4×4 grid of patches
    embeddings = ViTMAEEmbeddings(config)
    embeddings.initialize_weights()
    want = embeddings.position_embeddings[0].detach()  # [1 + 16, 16], cls row first
    enc = posenc.build("sinusoidal2d", dim=16, grid_width=4, cls_token=True)
    got = enc.encode(torch.arange(17)[None])[0]
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    assert (got[0] == 0).all()


def test_sinusoidal2d_added_by_the_layer_and_dtype():
    layer = posenc.MultiheadAttention(16, 2, encoding="sinusoidal2d:grid_width=4")
    x = torch.zeros(1, 8, 16)
    pos = torch.arange(8)
    enc = layer.encoding
    torch.testing.assert_close(enc.embed(x, pos[None]), enc.encode(pos[None]))
    assert enc.encode(pos[None], dtype=torch.bfloat16).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="dim"):
        posenc.build("sinusoidal2d", dim=6, grid_width=2)
    with pytest.raises(ValueError, match="grid_width"):
        posenc.build("sinusoidal2d", dim=8, grid_width=0)
    with pytest.raises(ValueError, match="grid_width"):
        posenc.MultiheadAttention(16, 2, encoding="sinusoidal2d")  # required: no silent default grid
