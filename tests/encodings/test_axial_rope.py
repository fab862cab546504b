"""Axial 2-D RoPE against HF Qwen2-VL's vision rotary, rotary-embedding-torch's axial form and
docs/conventions.md §9.2."""

from __future__ import annotations

import pytest
import torch

import posenc

# ---------------------------------------------------------------------------- axial RoPE


def test_axial_rope_matches_hf_qwen2_vl_vision_rotary():
    from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLVisionConfig
    from transformers.models.qwen2_vl.modeling_qwen2_vl import (
        Qwen2VLVisionRotaryEmbedding,
        apply_rotary_pos_emb_vision,
    )

    head_dim, heads, grid_h, grid_w = 16, 2, 3, 5
    hf_rope = Qwen2VLVisionRotaryEmbedding(Qwen2VLVisionConfig(embed_dim=head_dim * heads, num_heads=heads))
    rows = torch.arange(grid_h).repeat_interleave(grid_w)
    cols = torch.arange(grid_w).repeat(grid_h)
    q, k = (
        torch.randn(grid_h * grid_w, heads, head_dim),
        torch.randn(grid_h * grid_w, heads, head_dim),
    )  # HF: [N, heads, d]
    cos, sin = hf_rope(q, torch.stack([rows, cols], dim=-1))
    want_q, want_k = apply_rotary_pos_emb_vision(q, k, cos, sin)

    enc = posenc.build("axial_rope", head_dim=head_dim, grid_width=grid_w)
    pos = torch.arange(grid_h * grid_w)[None]
    got_q, got_k = enc.rotate(q.transpose(0, 1)[None], k.transpose(0, 1)[None], pos, pos)
    torch.testing.assert_close(got_q[0].transpose(0, 1), want_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_k[0].transpose(0, 1), want_k, rtol=1e-5, atol=1e-5)


def test_axial_rope_interleaved_matches_rotary_embedding_torch_axial_lang():
    import rotary_embedding_torch as ret  # a test reference: the [test] extra installs it

    head_dim, grid_h, grid_w = 16, 2, 3
    reference = ret.RotaryEmbedding(dim=head_dim // 2, freqs_for="lang")
    freqs = reference.get_axial_freqs(grid_h, grid_w)  # [H, W, head_dim] interleaved
    x = torch.randn(1, 1, grid_h, grid_w, head_dim)
    want = ret.apply_rotary_emb(freqs, x).reshape(1, 1, grid_h * grid_w, head_dim)
    enc = posenc.build("axial_rope", head_dim=head_dim, grid_width=grid_w, pairing="interleaved")
    pos = torch.arange(grid_h * grid_w)[None]
    got, _ = enc.rotate(x.reshape(1, 1, -1, head_dim), x.reshape(1, 1, -1, head_dim), pos, pos)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_axial_rope_scores_depend_on_2d_offsets_only():
    enc = posenc.build("axial_rope", head_dim=8, grid_width=10)
    q, k = torch.randn(1, 1, 1, 8, dtype=torch.float64), torch.randn(1, 1, 1, 8, dtype=torch.float64)

    def score(p_q: int, p_k: int) -> float:
        rq, rk = enc.rotate(q, k, torch.tensor([[p_q]]), torch.tensor([[p_k]]))
        return float((rq * rk).sum())

    # (row 1, col 2) vs (row 0, col 1) and (row 5, col 7) vs (row 4, col 6): same offset (1, 1).
    assert score(12, 1) == pytest.approx(score(57, 46), abs=1e-6)
    assert score(12, 1) != pytest.approx(score(12, 2), abs=1e-3)
