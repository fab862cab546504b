"""2-D sinusoidal (MAE), axial 2-D RoPE and Qwen2-VL M-RoPE against HF, rotary-embedding-torch and docs/conventions.md §2.3, §9.1 and §9.2."""

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


def test_mrope_grid_ids_reference_example():
    """Grid (1, 4, 6) with spatial merge 2 is the LLM grid (1, 2, 3); start 3."""
    ids = F.mrope_grid_ids(3, 1, 4 // 2, 6 // 2)
    assert ids.tolist() == [[3, 3, 3, 3, 3, 3], [3, 3, 3, 4, 4, 4], [3, 4, 5, 3, 4, 5]]


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
