"""Real-valued positions: taken by the families that define them (rotary: an angle p·θ for any real p),
refused with the reason by the encodings defined on whole positions (docs/conventions.md §7.11)."""

from __future__ import annotations

import math

import pytest
import torch

import posenc
from posenc.encodings.base import Kind

FLOAT_FAMILIES = ["rope", "hope:train_length=64", "fope:train_length=64", "mrope", "xpos"]


def test_which_encodings_take_real_positions():
    takes = {name for name in posenc.available() if posenc.get_class(name).float_positions}
    assert {"rope", "hope", "fope", "mrope", "xpos"} <= takes
    assert all(posenc.get_class(name).kind is Kind.ROTARY for name in takes)
    assert not {"learned", "t5", "shaw", "deberta", "alibi", "sinusoidal", "axial_rope"} & takes


def test_rope_at_real_positions_is_the_formula():
    """Pair k of a query at real position p turns by p·θ_k (written out in float64)."""
    enc = posenc.build("rope", head_dim=16)
    pos = torch.tensor([[0.0, 0.25, 1.5, 7.125, 100.75]])
    q = torch.randn(1, 2, 5, 16, dtype=torch.float64)
    got, _ = enc.rotate(q, q, pos, pos)
    want = q.clone()
    for k in range(8):
        angle = pos[0].double() * 10000.0 ** (-2 * k / 16)
        x1, x2 = q[..., k], q[..., k + 8]
        want[..., k] = x1 * angle.cos() - x2 * angle.sin()
        want[..., k + 8] = x2 * angle.cos() + x1 * angle.sin()
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    # the half-way angle differs from both neighbours: the fraction is used, not truncated
    assert not torch.allclose(got[:, :, 1], q[:, :, 1])


@pytest.mark.parametrize("spec", FLOAT_FAMILIES)
def test_layer_takes_real_positions_and_caches(spec):
    layer = posenc.MultiheadAttention(32, 2, spec, causal=True).eval()
    x = torch.randn(2, 9, 32)
    pos = torch.cumsum(torch.rand(2, 9) + 0.1, dim=1)  # random increasing real positions
    full = layer(x, positions=pos)
    assert layer.last_backend == "sdpa"
    cache = posenc.KVCache()
    steps = [
        layer(x[:, :4], positions=pos[:, :4], cache=cache),
        layer(x[:, 4:], positions=pos[:, 4:], cache=cache),
    ]
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-5, atol=1e-5)
    eager = posenc.MultiheadAttention(32, 2, spec, causal=True, backend="eager").eval()
    eager.load_state_dict(layer.state_dict())
    if hasattr(layer.encoding, "sin_coef"):  # FoPE's coefficients are buffers of the encoding
        eager.encoding.load_state_dict(layer.encoding.state_dict())
    torch.testing.assert_close(eager(x, positions=pos), full, rtol=1e-5, atol=1e-5)
    # whole numbers as reals give what the integers give
    whole = torch.arange(9).expand(2, -1)
    torch.testing.assert_close(
        layer(x, positions=whole.float()), layer(x, positions=whole), rtol=1e-5, atol=1e-5
    )


@pytest.mark.parametrize(
    ("spec", "reason"),
    [
        ("learned", "one row per whole position"),
        ("t5", "buckets whole relative distances"),
        ("shaw", "clipped whole distance"),
        ("deberta", "log-buckets"),
        ("alibi", "alibi is defined on whole positions"),
        ("sinusoidal", "sinusoidal is defined on whole positions"),
        ("axial_rope:grid_width=4", "patch index"),
    ],
)
def test_integer_only_encodings_refuse_real_positions_with_the_reason(spec, reason):
    layer = posenc.MultiheadAttention(32, 2, spec, causal=True)
    x = torch.randn(1, 5, 32)
    with pytest.raises(ValueError, match=r"positions must be an integer tensor") as err:
        layer(x, positions=torch.tensor([0.0, 1.0, 2.5, 3.0, 4.0]))
    assert reason in str(err.value)
    layer(x, positions=torch.arange(5))  # whole positions still work


def test_bad_real_positions():
    layer = posenc.MultiheadAttention(32, 2, "rope", causal=True)
    x = torch.randn(1, 3, 32)
    with pytest.raises(ValueError, match="non-negative"):
        layer(x, positions=torch.tensor([0.0, -0.5, 1.0]))
    with pytest.raises(ValueError, match="finite"):
        layer(x, positions=torch.tensor([0.0, math.nan, 1.0]))
    out = layer(x, positions=torch.tensor([0.0, 0.5, 1.0], dtype=torch.float16))  # widened to float32
    assert out.shape == x.shape


@pytest.mark.parametrize("backend", ["sdpa", "blocked", "segments"])
def test_every_rotary_backend_agrees_with_eager_at_real_positions(backend):
    """Windows send rotary layers to the blocked and segment splits: real positions reach them too."""
    x = torch.randn(2, 40, 32)
    pos = torch.cumsum(torch.rand(2, 40) + 0.1, dim=1)
    torch.manual_seed(0)
    eager = posenc.MultiheadAttention(32, 2, "rope", causal=True, window=8, backend="eager").eval()
    fast = posenc.MultiheadAttention(32, 2, "rope", causal=True, window=8, backend=backend).eval()
    fast.load_state_dict(eager.state_dict())
    got = fast(x, positions=pos)
    assert fast.last_backend == backend
    torch.testing.assert_close(got, eager(x, positions=pos), rtol=1e-5, atol=1e-5)
