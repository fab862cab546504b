"""Sinusoidal absolute encoding: hand numbers (docs/conventions.md §2.1), HF DistilBERT (interleaved) and
HF Marian (concat) tables, and the paper's formula written here in float64."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import posenc
from posenc import functional as F
from posenc.encodings.sinusoidal import Sinusoidal


def paper_table(positions: list[int], dim: int, base: float = 10000.0) -> np.ndarray:
    """PE[p, 2k] = sin(p / base^(2k/D)), PE[p, 2k+1] = cos(...), in float64 (Vaswani et al. §3.5)."""
    table = np.zeros((len(positions), dim))
    for row, p in enumerate(positions):
        for k in range(dim // 2):
            angle = p / base ** (2 * k / dim)
            table[row, 2 * k] = math.sin(angle)
            table[row, 2 * k + 1] = math.cos(angle)
    return table


def test_position_2_dim_4_interleaved_is_sin2_cos2_sin002_cos002() -> None:
    got = F.sinusoidal(torch.tensor([2]), 4)
    expected = torch.tensor([[math.sin(2), math.cos(2), math.sin(0.02), math.cos(0.02)]], dtype=torch.float32)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-7)
    # The rounded numbers printed in docs/conventions.md §2.1.
    torch.testing.assert_close(
        got[0], torch.tensor([0.909297, -0.416147, 0.019999, 0.999800]), rtol=0, atol=1e-6
    )


def test_concat_layout_position_2_dim_4() -> None:
    got = F.sinusoidal(torch.tensor(2), 4, layout="concat")
    torch.testing.assert_close(
        got, torch.tensor([0.909297, 0.019999, -0.416147, 0.999800]), rtol=0, atol=1e-6
    )


def test_reference_table_dim_4_positions_0_to_3() -> None:
    expected = torch.tensor(
        [
            [0, 1, 0, 1],
            [0.841471, 0.540302, 0.010000, 0.999950],
            [0.909297, -0.416147, 0.019999, 0.999800],
            [0.141120, -0.989992, 0.029996, 0.999550],
        ]
    )
    torch.testing.assert_close(F.sinusoidal(torch.arange(4), 4), expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize("n_pos,dim", [(1, 2), (7, 4), (33, 10), (64, 32)])
def test_equals_hf_distilbert_create_sinusoidal_embeddings(n_pos: int, dim: int) -> None:
    from transformers.models.distilbert.modeling_distilbert import create_sinusoidal_embeddings

    hf = torch.empty(n_pos, dim)
    create_sinusoidal_embeddings(n_pos, dim, hf)
    torch.testing.assert_close(F.sinusoidal(torch.arange(n_pos), dim), hf, rtol=0, atol=1e-7)


@pytest.mark.parametrize("n_pos,dim", [(1, 2), (7, 4), (33, 10), (64, 32)])
def test_concat_equals_hf_marian_sinusoidal_table(n_pos: int, dim: int) -> None:
    from transformers.models.marian.modeling_marian import MarianSinusoidalPositionalEmbedding

    hf = MarianSinusoidalPositionalEmbedding(n_pos, dim).create_weight()
    torch.testing.assert_close(F.sinusoidal(torch.arange(n_pos), dim, layout="concat"), hf, rtol=0, atol=1e-7)


def test_equals_paper_formula_for_far_positions_and_other_base() -> None:
    positions = [0, 1, 255, 256, 257, 4095, 100_000]
    for base in (10000.0, 500.0):
        expected = torch.tensor(paper_table(positions, 12, base), dtype=torch.float32)
        got = F.sinusoidal(torch.tensor(positions), 12, base=base)
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)


def test_concat_is_a_channel_permutation_of_interleaved() -> None:
    dim = 8
    interleaved = torch.tensor(paper_table(list(range(5)), dim), dtype=torch.float32)
    permutation = list(range(0, dim, 2)) + list(range(1, dim, 2))
    torch.testing.assert_close(
        F.sinusoidal(torch.arange(5), dim, layout="concat"), interleaved[:, permutation]
    )


def test_any_position_shape() -> None:
    assert F.sinusoidal(torch.zeros(2, 3, 5, dtype=torch.long), 6).shape == (2, 3, 5, 6)
    assert F.sinusoidal(torch.tensor(3), 6).shape == (6,)


def test_module_embed_adds_the_table_and_keeps_dtype() -> None:
    enc = posenc.build("sinusoidal", dim=8)
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    positions = torch.tensor([[0, 1, 2, 3, 4], [10, 11, 12, 13, 14]])
    out = enc.embed(x, positions)
    assert out.dtype == torch.float64
    expected = x + torch.stack([torch.tensor(paper_table(row, 8)) for row in positions.tolist()])
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-7)


def test_bf16_model_keeps_far_positions_apart() -> None:
    # Angles are computed before the cast: in bf16, 256 and 257 would be one number.
    enc = Sinusoidal(dim=8)
    far = enc.encode(torch.tensor([[257]]), dtype=torch.bfloat16)
    assert far.dtype == torch.bfloat16
    expected = torch.tensor(paper_table([257], 8), dtype=torch.float32).to(torch.bfloat16)
    torch.testing.assert_close(far[0], expected, rtol=0, atol=0)
    assert not torch.equal(far, enc.encode(torch.tensor([[256]]), dtype=torch.bfloat16))


def test_no_maximum_position() -> None:
    enc = Sinusoidal(dim=4)
    assert enc.max_positions is None
    got = enc.encode(torch.tensor([[1_000_000]]))
    torch.testing.assert_close(
        got[0], torch.tensor(paper_table([1_000_000], 4), dtype=torch.float32), rtol=0, atol=1e-6
    )


def test_layer_fills_in_dim_and_adds_the_encoding() -> None:
    attn = posenc.MultiheadAttention(8, 2, encoding="sinusoidal:layout=concat", backend="eager")
    assert attn.encoding.dim == 8 and attn.encoding.layout == "concat"


@pytest.mark.parametrize("dim", [7, 1, 0, -2])
def test_bad_dim_is_an_error_naming_dim(dim: int) -> None:
    with pytest.raises(ValueError, match="dim"):
        F.sinusoidal(torch.arange(3), dim)
    with pytest.raises(ValueError, match="dim"):
        posenc.build(f"sinusoidal:dim={dim}")


def test_odd_layer_width_is_an_error_naming_dim() -> None:
    with pytest.raises(ValueError, match="dim=9"):
        posenc.MultiheadAttention(9, 1, encoding="sinusoidal")


def test_bad_options_raise_the_registry_error() -> None:
    with pytest.raises(ValueError, match="layout"):
        posenc.build("sinusoidal:layout=interleave", dim=4)
    with pytest.raises(ValueError, match="base"):
        posenc.build("sinusoidal:base=abc", dim=4)
    with pytest.raises(ValueError, match="base"):
        posenc.build("sinusoidal:base=0", dim=4)
    with pytest.raises(ValueError, match="layout"):
        F.sinusoidal(torch.arange(3), 4, layout="split")  # type: ignore[arg-type]


def test_negative_or_float_positions_rejected_by_the_module() -> None:
    enc = Sinusoidal(dim=4)
    with pytest.raises(ValueError, match="non-negative"):
        enc.encode(torch.tensor([[-1, 0]]))
    with pytest.raises(ValueError, match="integer"):
        enc.encode(torch.tensor([[0.5]]))


def test_preview_shows_the_first_positions() -> None:
    text = Sinusoidal(dim=4).preview()
    assert "p=2" in text and f"{math.sin(2):+.6f}" in text and f"{math.cos(0.02):+.6f}" in text


# ----------------------------------------------------------- step="whisper" (docs/conventions.md §2.1)


def whisper_formula(positions: list[int], dim: int, base: float = 10000.0) -> np.ndarray:
    """``[sin(p·ω_k) | cos(p·ω_k)]`` with ``ω_k = exp(−k·ln(base)/(D/2 − 1))``, in float64."""
    half = dim // 2
    table = np.zeros((len(positions), dim))
    for row, p in enumerate(positions):
        for k in range(half):
            angle = p * math.exp(-k * math.log(base) / (half - 1))
            table[row, k] = math.sin(angle)
            table[row, half + k] = math.cos(angle)
    return table


@pytest.mark.parametrize("length,dim", [(1500, 512), (1500, 384), (448, 1280), (7, 4), (33, 10)])
def test_whisper_step_equals_hf_whisper_sinusoids(length: int, dim: int) -> None:
    """HF's ``sinusoids`` (whisper-base 512, whisper-tiny 384, large's width 1280, small sizes) to its
    float32 angles: each is rounded twice (``exp`` and the product with ``p``), an error up to
    ``p·2^-24`` apiece, so ``length·2^-23`` bounds the distance of the two tables (posenc's float64
    angles equal the trained checkpoint's table: tests/test_real_whisper.py)."""
    from transformers.models.whisper.modeling_whisper import sinusoids

    got = F.sinusoidal(torch.arange(length), dim, layout="concat", step="whisper")
    want = sinusoids(length, dim)
    assert got.dtype == want.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=0, atol=length * 2**-23)


def test_whisper_step_other_base_equals_hf_sinusoids_max_timescale() -> None:
    from transformers.models.whisper.modeling_whisper import sinusoids

    got = F.sinusoidal(torch.arange(50), 16, base=500.0, layout="concat", step="whisper")
    torch.testing.assert_close(got, sinusoids(50, 16, max_timescale=500.0), rtol=0, atol=50 * 2**-23)


def test_whisper_step_equals_the_formula_and_the_worked_numbers() -> None:
    positions = [0, 1, 2, 255, 1499, 100_000]
    got = F.sinusoidal(torch.tensor(positions), 12, layout="concat", step="whisper")
    torch.testing.assert_close(
        got, torch.tensor(whisper_formula(positions, 12), dtype=torch.float32), rtol=0, atol=1e-7
    )
    # docs/conventions.md §2.1: D = 4, ω = [1, 1e-4], position 2, concat.
    torch.testing.assert_close(
        F.sinusoidal(torch.tensor(2), 4, layout="concat", step="whisper"),
        torch.tensor([0.909297, 0.000200, -0.416147, 1.000000]),
        rtol=0,
        atol=1e-6,
    )
    # The lowest frequency is exactly 1/base (the paper's stops at base^(-(D-2)/D)).
    far = F.sinusoidal(torch.tensor(10000), 4, layout="concat", step="whisper")
    torch.testing.assert_close(far[1], torch.tensor(math.sin(1.0)), rtol=0, atol=1e-6)


def test_whisper_step_interleaved_is_the_same_numbers_interleaved() -> None:
    concat = F.sinusoidal(torch.arange(9), 8, layout="concat", step="whisper")
    interleaved = F.sinusoidal(torch.arange(9), 8, step="whisper")
    assert torch.equal(interleaved[:, 0::2], concat[:, :4]) and torch.equal(
        interleaved[:, 1::2], concat[:, 4:]
    )


def test_whisper_step_differs_from_the_paper_step() -> None:
    paper = F.sinusoidal(torch.arange(5), 8, layout="concat")
    whisper = F.sinusoidal(torch.arange(5), 8, layout="concat", step="whisper")
    assert (paper - whisper).abs().max() > 0.01


def test_whisper_step_module_spec_and_layer() -> None:
    from transformers.models.whisper.modeling_whisper import sinusoids

    enc = posenc.build("sinusoidal:layout=concat,step=whisper", dim=16)
    assert enc.step == "whisper"
    torch.testing.assert_close(
        enc.encode(torch.arange(20)[None])[0], sinusoids(20, 16), rtol=0, atol=20 * 2**-23
    )
    assert "step=whisper" in enc.preview()
    attn = posenc.MultiheadAttention(16, 2, encoding="sinusoidal:step=whisper", backend="eager")
    assert attn.encoding.step == "whisper"


def test_bad_step_is_an_error_naming_step() -> None:
    with pytest.raises(ValueError, match="step"):
        posenc.build("sinusoidal:step=fairseq", dim=8)
    with pytest.raises(ValueError, match="step"):
        F.sinusoidal(torch.arange(3), 8, step="t2t")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"step='whisper'.*dim >= 4"):
        F.sinusoidal(torch.arange(3), 2, step="whisper")
    with pytest.raises(ValueError, match="dim >= 4"):
        posenc.build("sinusoidal:step=whisper", dim=2)
