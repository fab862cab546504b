"""Learned absolute table: lookup, the max_len limit, and extend() against linear interpolation
written here in float64."""

from __future__ import annotations

import math

import pytest
import torch

import posenc
from posenc.encodings.learned import Learned


def interpolate_rows(old: torch.Tensor, new_len: int) -> torch.Tensor:
    """Row r of the result = old linearly interpolated at x = r·(L−1)/(new_len−1) (endpoints aligned)."""
    old = old.double()
    length = old.shape[0]
    rows = []
    for r in range(new_len):
        x = r * (length - 1) / (new_len - 1)
        left = min(math.floor(x), length - 1)
        right = min(left + 1, length - 1)
        frac = x - left
        rows.append((1 - frac) * old[left] + frac * old[right])
    return torch.stack(rows)


def test_encode_is_the_table_rows_and_embed_adds_them() -> None:
    enc = Learned(dim=6, max_len=10)
    positions = torch.tensor([[0, 3, 9], [1, 1, 2]])
    weight = enc.table.weight.detach()
    torch.testing.assert_close(enc.encode(positions), weight[positions], rtol=0, atol=0)
    x = torch.randn(2, 3, 6)
    torch.testing.assert_close(enc.embed(x, positions), x + weight[positions], rtol=0, atol=0)


def test_init_is_normal_with_std_002_like_bert() -> None:
    weight = Learned(dim=64, max_len=2048).table.weight.detach()
    assert abs(float(weight.std()) - 0.02) < 0.0005
    assert abs(float(weight.mean())) < 0.0005


def test_default_max_len_is_512() -> None:
    enc = posenc.build("learned", dim=4)
    assert enc.max_len == 512 and enc.max_positions == 512 and enc.table.weight.shape == (512, 4)


def test_position_past_the_table_is_an_error_naming_max_len() -> None:
    enc = Learned(dim=4, max_len=8)
    enc.encode(torch.arange(8))  # the last row is fine
    with pytest.raises(ValueError, match="max_len=8"):
        enc.encode(torch.arange(9))


def test_sequence_longer_than_max_len_in_a_layer_is_an_error_naming_max_len() -> None:
    attn = posenc.MultiheadAttention(8, 2, encoding="learned:max_len=4", backend="eager")
    attn(torch.randn(1, 4, 8))
    with pytest.raises(ValueError, match="max_len"):
        attn(torch.randn(1, 5, 8))
    cache = posenc.KVCache()
    attn(torch.randn(1, 4, 8), cache=cache)
    with pytest.raises(ValueError, match="max_len"):
        attn(torch.randn(1, 1, 8), cache=cache)  # position 4 continues past the table


def test_output_dtype_follows_the_request() -> None:
    enc = Learned(dim=4, max_len=8).to(torch.bfloat16)
    assert enc.encode(torch.arange(3)).dtype == torch.bfloat16
    x = torch.randn(1, 3, 4, dtype=torch.bfloat16)
    assert enc.embed(x, torch.arange(3)[None]).dtype == torch.bfloat16


@pytest.mark.parametrize("old_len,new_len", [(5, 9), (5, 13), (7, 10), (2, 5), (16, 100)])
def test_extend_equals_linear_interpolation_over_positions(old_len: int, new_len: int) -> None:
    enc = Learned(dim=3, max_len=old_len)
    old = enc.table.weight.detach().clone()
    enc.extend(new_len)
    expected = interpolate_rows(old, new_len).float()
    torch.testing.assert_close(enc.table.weight.detach(), expected, rtol=0, atol=1e-8)
    assert enc.max_len == enc.max_positions == new_len and enc.table.num_embeddings == new_len


def test_extend_keeps_old_rows_when_it_is_a_pure_resampling() -> None:
    enc = Learned(dim=4, max_len=5)
    old = enc.table.weight.detach().clone()
    enc.extend(9)  # (9 − 1) / (5 − 1) = 2: old row i lands on new row 2i
    torch.testing.assert_close(enc.table.weight.detach()[0::2], old, rtol=0, atol=0)
    torch.testing.assert_close(enc.table.weight.detach()[1], (old[0] + old[1]) / 2, rtol=0, atol=1e-9)


def test_extend_keeps_the_endpoints_and_a_one_row_table_is_repeated() -> None:
    enc = Learned(dim=4, max_len=7)
    old = enc.table.weight.detach().clone()
    enc.extend(11)
    new = enc.table.weight.detach()
    torch.testing.assert_close(new[0], old[0], rtol=0, atol=0)
    torch.testing.assert_close(new[-1], old[-1], rtol=0, atol=0)
    single = Learned(dim=2, max_len=1)
    row = single.table.weight.detach().clone()
    single.extend(3)
    torch.testing.assert_close(single.table.weight.detach(), row.expand(3, -1), rtol=0, atol=0)


def test_extend_updates_config_trains_and_round_trips_state_dict() -> None:
    enc = Learned(dim=4, max_len=6)
    enc.extend(10)
    assert enc.config()["max_len"] == 10 and "max_len=10" in enc.spec()
    assert enc.table.weight.requires_grad
    enc.encode(torch.arange(10)).sum().backward()
    assert enc.table.weight.grad is not None and enc.table.weight.grad.shape == (10, 4)
    rebuilt = posenc.build(enc.spec())
    rebuilt.load_state_dict(enc.state_dict())
    torch.testing.assert_close(rebuilt.encode(torch.arange(10)), enc.encode(torch.arange(10)))


def test_extend_must_grow() -> None:
    enc = Learned(dim=4, max_len=6)
    for bad in (6, 3, 0):
        with pytest.raises(ValueError, match="new_max_len"):
            enc.extend(bad)


def test_bad_options_raise_the_registry_error() -> None:
    with pytest.raises(ValueError, match="max_len"):
        posenc.build("learned:max_len=big", dim=4)
    with pytest.raises(ValueError, match="max_len"):
        posenc.build("learned:max_len=0", dim=4)
    with pytest.raises(ValueError, match="max_length"):
        posenc.build("learned:max_length=4", dim=4)


def test_preview_shows_the_table_shape() -> None:
    assert "table [8, 4]" in Learned(dim=4, max_len=8).preview()
