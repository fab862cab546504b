"""Kerple, FIRE and the dynamic MLP bias against their formulas (float64, written here), docs/conventions.md §10 and x-transformers."""

from __future__ import annotations

import math

import pytest
import torch

import posenc
from posenc import functional as F


def _dense(enc, length: int) -> torch.Tensor:
    return enc.bias(length, length).double()


# ---------------------------------------------------------------------------- Kerple


@pytest.mark.parametrize(
    ("variant", "p", "a", "expected"),
    [
        ("log", 1.0, 1.0, [-1.609438, -1.386294, -1.098612, -0.693147, 0.0]),
        ("power", 1.0, 1.0, [-4.0, -3.0, -2.0, -1.0, 0.0]),
        ("power", 0.5, 0.5, [-1.0, -0.866025, -0.707107, -0.5, 0.0]),
    ],
)
def test_kerple_reference_rows(variant, p, a, expected):
    enc = posenc.build("kerple", num_heads=1, variant=variant)
    with torch.no_grad():
        enc.bias_p.fill_(p)
        enc.bias_a.fill_(a)
    row = enc.bias(1, 5, q_offset=4)[0, 0]
    torch.testing.assert_close(row, torch.tensor(expected), rtol=0, atol=1e-6)


@pytest.mark.parametrize("variant", ["log", "power"])
def test_kerple_matches_formula(variant):
    enc = posenc.build("kerple", num_heads=3, variant=variant).double().requires_grad_(False)
    with torch.no_grad():
        enc.bias_p.copy_(torch.tensor([0.005, 0.7, 2.5]))  # below, inside and above the clamp range
        enc.bias_a.copy_(torch.tensor([0.3, 0.001, 1.2]))
    got = _dense(enc, 7)
    for h in range(3):
        p = min(max(float(enc.bias_p[h]), 0.01), 2.0 if variant == "power" else math.inf)
        a = max(float(enc.bias_a[h]), 0.01)
        for i in range(7):
            for j in range(7):
                dist = max(i - j, 0)
                want = -p * math.log(1 + a * dist) if variant == "log" else -a * dist**p
                assert float(got[h, i, j]) == pytest.approx(want, abs=1e-12)


def test_kerple_gradients_finite_on_the_diagonal():
    enc = posenc.build("kerple", num_heads=2, variant="power")
    enc.bias(4, 4).sum().backward()
    assert torch.isfinite(enc.bias_p.grad).all() and torch.isfinite(enc.bias_a.grad).all()
    assert (enc.bias_p.grad != 0).any()


# ---------------------------------------------------------------------------- FIRE


def test_fire_input_reference_numbers():
    c, threshold = torch.tensor(0.1), torch.tensor(512.0)
    got = F.fire_input(torch.tensor(10), torch.tensor(4), c, threshold)
    assert float(got) == pytest.approx(math.log(1.6) / math.log(52.2), abs=1e-6)
    assert float(got) == pytest.approx(0.118835, abs=1e-6)
    near_one = F.fire_input(torch.tensor(10), torch.tensor(0), c, torch.tensor(4.0))
    assert float(near_one) == pytest.approx(1.0, abs=1e-5)


def _fire_formula(enc, i: int, j: int, h: int) -> float:
    c = float(enc.c)
    threshold = abs(float(enc.threshold_mult) * float(enc.threshold_init))
    x = math.log(abs(c * (i - j)) + 1) / (math.log(abs(c * max(i, threshold)) + 1) + enc.eps)
    w1, b1 = enc.mlp_in.weight[:, 0].tolist(), enc.mlp_in.bias.tolist()
    hidden = [max(w * x + b, 0.0) for w, b in zip(w1, b1)]
    return sum(w * v for w, v in zip(enc.mlp_out.weight[h].tolist(), hidden)) + float(enc.mlp_out.bias[h])


def test_fire_matches_formula_and_depends_on_query_position():
    enc = posenc.build("fire", num_heads=2, threshold_init=4.0).double().requires_grad_(False)
    with torch.no_grad():
        enc.c.fill_(0.3)
        enc.threshold_mult.fill_(1.5)  # L = 6
    got = enc.bias(4, 9, q_offset=5).double()  # queries 5..8: below and above L
    for h in range(2):
        for a, i in enumerate(range(5, 9)):
            for j in range(9):
                assert float(got[h, a, j]) == pytest.approx(_fire_formula(enc, i, j, h), abs=1e-10)
    assert not torch.allclose(
        enc.bias(1, 2, q_offset=10), enc.bias(1, 2, q_offset=1000)
    )  # not shift invariant


def test_fire_threshold_and_c_are_learned():
    enc = posenc.build("fire", num_heads=2, threshold_init=64.0)
    enc.bias(5, 5, q_offset=3).square().sum().backward()
    assert enc.c.grad is not None and float(enc.c.grad) != 0.0
    assert enc.threshold_mult.grad is not None and float(enc.threshold_mult.grad) != 0.0
    assert "threshold_init" in dict(enc.named_buffers()) and not enc.threshold_init.requires_grad


# ---------------------------------------------------------------------------- dynamic MLP bias vs x-transformers


def _copy_from_x_transformers(dpb, enc) -> None:
    layers = list(dpb.mlp)
    with torch.no_grad():
        for index, block in enumerate(layers[:-1]):
            enc.linears[index].load_state_dict(block[0].state_dict())
            if enc.norm:
                if index == 0:
                    enc.first_norm_gain.copy_(block[1].gamma + torch.randn_like(block[1].gamma) * 0.1)
                    block[1].gamma.copy_(enc.first_norm_gain)
                else:
                    block[1].weight.add_(torch.randn_like(block[1].weight) * 0.1)
                    block[1].bias.add_(torch.randn_like(block[1].bias) * 0.1)
                    enc.norms[index - 1].load_state_dict(block[1].state_dict())
        enc.out.load_state_dict(layers[-1].state_dict())


@pytest.mark.parametrize(
    ("depth", "log_distance", "norm"), [(2, False, False), (3, True, True), (1, True, False)]
)
def test_mlp_bias_matches_x_transformers_dynamic_position_bias(depth, log_distance, norm):
    import x_transformers.x_transformers as x_transformers  # a test reference: the [test] extra installs it

    dpb = x_transformers.DynamicPositionBias(8, heads=3, depth=depth, log_distance=log_distance, norm=norm)
    enc = posenc.build("mlp_bias", num_heads=3, dim=32, depth=depth, log_distance=log_distance, norm=norm)
    assert enc.hidden_dim == 8  # dim // 4
    _copy_from_x_transformers(dpb, enc)
    with torch.no_grad():
        want = dpb(6, 10)  # 6 queries (the last of 10 positions), 10 keys
    # x-transformers' relative position is i - j; with a cache the queries are the last positions.
    torch.testing.assert_close(enc.bias(6, 10, q_offset=4), want, rtol=1e-5, atol=1e-6)
    # The single elementwise definition agrees with the gathered dense path.
    heads = torch.arange(3)[:, None, None]
    direct = enc.bias_at(heads, torch.arange(4, 10)[None, :, None], torch.arange(10)[None, None, :])
    torch.testing.assert_close(direct, want, rtol=1e-5, atol=1e-6)


def test_mlp_bias_in_attention_matches_manual_softmax():
    torch.manual_seed(3)
    layer = posenc.MultiheadAttention(32, 2, encoding="mlp_bias", causal=False).eval()
    x = torch.randn(1, 6, 32)
    _, weights = layer(x, need_weights=True)
    q = layer.q_proj(x).view(1, 6, 2, 16).transpose(1, 2)
    k = layer.k_proj(x).view(1, 6, 2, 16).transpose(1, 2)
    bias = torch.stack(
        [
            torch.stack(
                [layer.encoding.bias_at(torch.tensor(h), torch.tensor(i), torch.arange(6)) for i in range(6)]
            )
            for h in range(2)
        ]
    )
    want = torch.softmax(q @ k.transpose(-1, -2) / 4.0 + bias, dim=-1)
    torch.testing.assert_close(weights, want, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------- errors and score_mod


def test_bad_options():
    with pytest.raises(ValueError, match="variant"):
        posenc.build("kerple:variant=exp", num_heads=2)
    with pytest.raises(ValueError, match="hidden_dim"):
        posenc.build("fire", num_heads=2, hidden_dim=0)
    with pytest.raises(ValueError, match="depth"):
        posenc.build("mlp_bias", num_heads=2, dim=16, depth=0)
    for name in ("kerple", "fire"):
        with pytest.raises(ValueError, match="causal"):
            posenc.MultiheadAttention(32, 2, encoding=name, causal=False)


SCORE_MOD_CASES = [
    ("kerple", {}),
    ("kerple", {"variant": "power"}),
    ("fire", {}),
    ("mlp_bias", {"dim": 32}),
    ("mlp_bias", {"dim": 32, "depth": 3, "norm": True, "log_distance": True}),
]


def _with_random_norms(enc):
    with torch.no_grad():
        for name, param in enc.named_parameters():
            if "norm" in name:
                param.add_(torch.randn_like(param) * 0.2)
    return enc


@pytest.mark.parametrize(("name", "options"), SCORE_MOD_CASES)
def test_score_mod_scalar_calls_equal_dense_bias(name, options):
    """Flex calls score_mod with 0-d index tensors: the same bias_at must give the dense values."""
    enc = _with_random_norms(posenc.build(name, num_heads=2, **options))
    dense = enc.bias(3, 5, q_offset=2)
    for h in range(2):
        for i in range(3):
            for j in range(5):
                score = enc.score_mod(
                    torch.tensor(0.0), torch.tensor(0), torch.tensor(h), torch.tensor(i + 2), torch.tensor(j)
                )
                torch.testing.assert_close(score, dense[h, i, j], rtol=1e-5, atol=1e-6)


FLEX_CASES = [
    ("kerple", {}),
    ("kerple", {"variant": "power"}),
    ("fire", {}),
    ("mlp_bias", {"dim": 32, "log_distance": True}),
]


@pytest.mark.slow
@pytest.mark.parametrize(("name", "options"), FLEX_CASES)
def test_compiled_flex_attention_runs_score_mod(name, options):
    """The score_mod lowers to a compiled FlexAttention kernel (pointwise ops only) and equals the dense bias."""
    from torch.nn.attention.flex_attention import flex_attention

    enc = _with_random_norms(posenc.build(name, num_heads=2, **options)).requires_grad_(False)
    q, k, v = (torch.randn(1, 2, 16, 16) for _ in range(3))
    causal = torch.triu(torch.ones(16, 16, dtype=torch.bool), 1)
    want = (
        torch.softmax((q @ k.transpose(-1, -2) / 4 + enc.bias(16, 16)).masked_fill(causal, float("-inf")), -1)
        @ v
    )

    def score_mod(score, b, h, q_idx, kv_idx):
        return torch.where(kv_idx <= q_idx, enc.score_mod(score, b, h, q_idx, kv_idx), -float("inf"))

    got = torch.compile(flex_attention)(q, k, v, score_mod=score_mod)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
