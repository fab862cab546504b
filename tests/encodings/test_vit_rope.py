"""ViT 2-D RoPE: RoPE-Mixed against the paper's rotation written out here, DINOv3's RoPE against HF ``dinov3_vit``.

RoPE-Mixed's reference is its definition (Heo et al. 2024, as timm's ``RotaryEmbeddingMixed`` and
naver-ai's rope-vit compute it): patch ``(row, col)`` turns pair ``(2k, 2k+1)`` of head ``h`` by
``col · fx[h, k] + row · fy[h, k]``. It is written below as explicit 2x2 rotations in float64;
timm itself is not a test dependency, because its package pulls torchvision, which re-pins torch.
Tiny configs built here; nothing is downloaded. docs/conventions.md §9.5-§9.6.
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers import DINOv3ViTConfig
from transformers.models.dinov3_vit.modeling_dinov3_vit import (
    DINOv3ViTRopePositionEmbedding,
    apply_rotary_pos_emb,
)

import posenc
from posenc import functional as F

# ---------------------------------------------------------------------------- RoPE-Mixed


def _rope_mixed_reference(x: torch.Tensor, freqs: torch.Tensor, grid_width: int, prefix: int) -> torch.Tensor:
    """The paper's rotation, token by token: ``x [B, H, T, D]``, ``freqs [2, H, D/2]`` (fx, fy).

    Token ``t >= prefix`` is patch ``p = t - prefix`` at ``row = p // grid_width``, ``col = p % grid_width``
    (row-major, timm's ``xy`` grid); pair ``k`` of head ``h`` is multiplied by the rotation matrix of
    angle ``col * fx[h, k] + row * fy[h, k]``. Prefix tokens (class token, registers) are not rotated.
    """
    out = x.clone()
    for t in range(prefix, x.shape[2]):
        row, col = divmod(t - prefix, grid_width)
        for h in range(x.shape[1]):
            for k in range(x.shape[3] // 2):
                angle = col * freqs[0, h, k].item() + row * freqs[1, h, k].item()
                rotation = torch.tensor(
                    [[math.cos(angle), -math.sin(angle)], [math.sin(angle), math.cos(angle)]], dtype=x.dtype
                )
                out[:, h, t, 2 * k : 2 * k + 2] = x[:, h, t, 2 * k : 2 * k + 2] @ rotation.T
    return out


@pytest.mark.parametrize(("grid_width", "tokens", "prefix"), [(4, 12, 0), (4, 17, 1), (5, 15, 5), (1, 3, 0)])
def test_rope_mixed_equals_the_papers_rotation(grid_width, tokens, prefix):
    torch.manual_seed(0)
    heads, head_dim = 3, 8
    enc = posenc.build(
        "rope_mixed", num_heads=heads, head_dim=head_dim, grid_width=grid_width, prefix_tokens=prefix
    ).double()
    with torch.no_grad():  # arbitrary learned frequencies, not the initial ones
        enc.freqs.copy_(torch.randn(2, heads, head_dim // 2, dtype=torch.float64))
    q = torch.randn(2, heads, tokens, head_dim, dtype=torch.float64)
    k = torch.randn(2, heads, tokens, head_dim, dtype=torch.float64)
    positions = torch.arange(tokens)[None]
    got_q, got_k = enc.rotate(q, k, positions, positions)
    freqs = enc.freqs.detach()
    torch.testing.assert_close(
        got_q, _rope_mixed_reference(q, freqs, grid_width, prefix), rtol=1e-12, atol=1e-12
    )
    torch.testing.assert_close(
        got_k, _rope_mixed_reference(k, freqs, grid_width, prefix), rtol=1e-12, atol=1e-12
    )


def test_rope_mixed_float32_rotation_is_close_to_float64():
    torch.manual_seed(1)
    enc = posenc.build("rope_mixed", num_heads=2, head_dim=8, grid_width=3, prefix_tokens=1)
    q = torch.randn(1, 2, 10, 8)
    got, _ = enc.rotate(q, q, torch.arange(10)[None], torch.arange(10)[None])
    want = _rope_mixed_reference(q.double(), enc.freqs.detach().double(), 3, 1)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_rope_mixed_scores_depend_on_the_2d_offset_and_frequencies_learn():
    enc = posenc.build("rope_mixed", num_heads=2, head_dim=8, grid_width=10)
    q, k = torch.randn(1, 2, 1, 8), torch.randn(1, 2, 1, 8)

    def score(p_q, p_k):
        rq, rk = enc.rotate(q, k, torch.tensor([[p_q]]), torch.tensor([[p_k]]))
        return (rq * rk).sum(-1)

    # (row 1, col 2) vs (row 0, col 1) and (row 5, col 7) vs (row 4, col 6): the same offset (1, 1).
    torch.testing.assert_close(score(12, 1), score(57, 46), rtol=1e-5, atol=1e-5)
    score(12, 1).sum().backward()
    assert enc.freqs.grad is not None and enc.freqs.grad.abs().sum() > 0


def test_rope_mixed_init_follows_the_paper():
    """docs/conventions.md §9.5: per head, the x and y parts of pair j and j + D/4 are orthogonal, magnitude base^(-4j/D)."""
    freqs = F.rope_mixed_init_freqs(4, 16, base=10.0, generator=torch.Generator().manual_seed(1))
    fx, fy = freqs
    magnitude = torch.hypot(fx, fy)
    want = torch.tensor([10.0 ** (-4 * j / 16) for j in range(4)] * 2)
    torch.testing.assert_close(magnitude, want.expand(4, -1), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(
        (fx[:, :4] * fx[:, 4:] + fy[:, :4] * fy[:, 4:]), torch.zeros(4, 4), atol=1e-6, rtol=0
    )


def test_rope_mixed_grouped_query_heads_share_their_group_frequencies():
    layer = posenc.MultiheadAttention(32, 4, encoding="rope_mixed:grid_width=3", num_kv_heads=2)
    enc = layer.encoding
    q, k = torch.randn(1, 4, 1, 8), torch.randn(1, 2, 1, 8)
    rq, rk = enc.rotate(q, k, torch.tensor([[4]]), torch.tensor([[4]]))
    # Same position: the rotation cancels in each query head's score with its key head.
    scores = (rq * rk.repeat_interleave(2, dim=1)).sum(-1)
    torch.testing.assert_close(scores, (q * k.repeat_interleave(2, dim=1)).sum(-1), rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------- DINOv3


def _hf_config(head_dim: int, heads: int, grid: tuple[int, int], **augment) -> DINOv3ViTConfig:
    return DINOv3ViTConfig(
        hidden_size=heads * head_dim,
        num_attention_heads=heads,
        image_size=(grid[0] * 4, grid[1] * 4),
        patch_size=4,
        rope_theta=100.0,
        pos_embed_shift=augment.get("shift"),
        pos_embed_jitter=augment.get("jitter"),
        pos_embed_rescale=augment.get("rescale"),
    )


def _dinov3(grid, prefix, head_dim=16, **augment):
    return posenc.build(
        "dinov3_rope",
        head_dim=head_dim,
        grid_width=grid[1],
        grid_height=grid[0],
        prefix_tokens=prefix,
        **augment,
    )


@pytest.mark.parametrize(("grid", "prefix", "head_dim"), [((3, 4), 5, 16), ((4, 4), 1, 32), ((2, 6), 0, 8)])
def test_dinov3_matches_hf_in_eval_mode(grid, prefix, head_dim):
    heads = 2
    rope = DINOv3ViTRopePositionEmbedding(_hf_config(head_dim, heads, grid)).eval()
    cos, sin = rope(torch.zeros(1, 3, grid[0] * 4, grid[1] * 4))
    tokens = prefix + grid[0] * grid[1]
    q, k = torch.randn(2, heads, tokens, head_dim), torch.randn(2, heads, tokens, head_dim)
    want_q, want_k = apply_rotary_pos_emb(q, k, cos, sin)
    enc = _dinov3(grid, prefix, head_dim).eval()
    positions = torch.arange(tokens)[None]
    got_q, got_k = enc.rotate(q, k, positions, positions)
    torch.testing.assert_close(got_q, want_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_k, want_k, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(enc.inv_freq, rope.inv_freq, rtol=1e-6, atol=0)


@pytest.mark.parametrize(
    "augment",
    [{"rescale": 2.0}, {"shift": 0.1}, {"jitter": 1.5}, {"shift": 0.2, "jitter": 1.3, "rescale": 2.0}],
)
def test_dinov3_training_augmentation_matches_hf_under_the_same_seed(augment):
    grid, prefix, heads = (3, 4), 1, 2
    rope = DINOv3ViTRopePositionEmbedding(_hf_config(16, heads, grid, **augment)).train()
    torch.manual_seed(123)
    cos, sin = rope(torch.zeros(1, 3, grid[0] * 4, grid[1] * 4))
    tokens = prefix + grid[0] * grid[1]
    q, k = (
        torch.randn(1, heads, tokens, 16, dtype=torch.float64),
        torch.randn(1, heads, tokens, 16, dtype=torch.float64),
    )
    want_q, want_k = apply_rotary_pos_emb(q, k, cos.double(), sin.double())
    enc = _dinov3(grid, prefix, **augment).train()
    positions = torch.arange(tokens)[None]
    torch.manual_seed(123)
    got_q, got_k = enc.rotate(q, k, positions, positions)
    torch.testing.assert_close(got_q, want_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_k, want_k, rtol=1e-5, atol=1e-5)
    enc.eval()
    assert not torch.allclose(enc.rotate(q, k, positions, positions)[0], want_q, atol=1e-4)


def test_dinov3_reference_coordinates():
    """docs/conventions.md §9.6: a 2x4 grid has y in {-0.5, 0.5} and x in {-0.75, -0.25, 0.25, 0.75}."""
    enc = _dinov3((2, 4), prefix=1)
    coords, is_patch = enc.coords(torch.tensor([[0, 1, 4, 8]]))
    assert is_patch.tolist() == [[False, True, True, True]]
    assert coords[0, 1:].tolist() == [[-0.5, -0.75], [-0.5, 0.75], [0.5, 0.75]]
    torch.testing.assert_close(enc.inv_freq, torch.tensor([1.0, 100**-0.25, 0.1, 100**-0.75]))
    angle = 2 * math.pi * -0.75 * 1.0  # pair 4 (x, j = 0) of patch 0
    cos, _ = F.dinov3_cos_sin(coords[:, 1:2], enc.inv_freq)
    assert cos[0, 0, 4].item() == pytest.approx(math.cos(angle), abs=1e-6)


def test_bad_options_name_them():
    with pytest.raises(ValueError, match="head_dim"):
        posenc.build("dinov3_rope", head_dim=18, grid_width=2)
    with pytest.raises(ValueError, match="jitter"):
        posenc.build("dinov3_rope", head_dim=16, grid_width=2, jitter=0.5)
    with pytest.raises(ValueError, match="shift"):
        posenc.build("dinov3_rope", head_dim=16, grid_width=2, shift=-1.0)
    with pytest.raises(ValueError, match="grid_width"):
        posenc.build("rope_mixed", num_heads=2, head_dim=16, grid_width=0)
    with pytest.raises(ValueError, match="head_dim"):
        posenc.build("rope_mixed", num_heads=2, head_dim=6, grid_width=2)
