"""What an encoding offers the exact splits (posenc.encodings.offers): the near/far declaration of every
registered BIAS encoding that makes one (a far constant beyond a distance, separable row and key terms)
against bias_at itself."""

from __future__ import annotations

import pytest
import torch

import posenc
from _near_far import DECLARING, HEADS, _encoding


def test_alibi_and_t5_declare_what_the_split_needs():
    assert {"alibi", "t5"} <= set(DECLARING)


@pytest.mark.parametrize("name", DECLARING)
def test_far_constant_declaration_holds(name):
    enc = _encoding(name, True, torch.float64)
    declared = enc.near_far()
    beyond = None if declared is None else declared.far_constant_beyond
    if beyond is None:
        pytest.skip(f"{name} declares no far constant")
    head = torch.arange(HEADS)[:, None]
    q = torch.full((1, 400), 500)
    before = enc.bias_at(head, q, q - torch.arange(beyond, beyond + 400))
    after = enc.bias_at(head, q, q + torch.arange(beyond, beyond + 400))
    assert bool((before == before[:, :1]).all()) and bool((after == after[:, :1]).all())
    # and it is the smallest such distance: one step closer, some direction still differs
    closer = torch.stack([enc.bias_at(head, q[:, :1], q[:, :1] + s * (beyond - 1)) for s in (-1, 1)])
    far = torch.stack([before[:, :1], after[:, :1]])
    assert bool((closer != far).any())


@pytest.mark.parametrize("mode", ["causal", "symmetric"])
def test_alibi_separable_terms_equal_bias_at(mode):
    enc = posenc.build("alibi", num_heads=3, mode=mode)
    q_pos, k_pos = torch.arange(5, 45)[None], torch.arange(50)[None]
    dense = enc.bias_for_positions(q_pos, k_pos).double()  # [1, H, Tq, Tk]
    for term in enc.near_far().separable(q_pos, k_pos):
        total = term.row[..., :, None] + term.col[..., None, :]
        side = {"all": torch.ones_like(dense, dtype=torch.bool)[0, 0]}.get(term.side)
        if side is None:
            diff = k_pos[0][None, :] - q_pos[0][:, None]
            side = diff <= 0 if term.side == "before" else diff >= 0
        torch.testing.assert_close(total[..., side], dense[..., side], rtol=0, atol=1e-12)
