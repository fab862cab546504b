"""The householder backend (PaTH's chunkwise form, posenc.backends.householder) states what it does not
serve."""

from __future__ import annotations

import torch

import posenc
from posenc.backends import AttentionRequest, backend_limits, get_backend
from posenc.encodings.base import TokenStates

F64 = torch.float64


def _layer(num_kv_heads=None, seed=0, spec="path"):
    torch.manual_seed(seed)
    layer = posenc.MultiheadAttention(32, 4, spec, causal=True, num_kv_heads=num_kv_heads)
    return layer.to(F64)


def test_the_householder_backend_states_its_limits():
    layer = _layer()
    x = torch.randn(1, 6, 32, dtype=F64)
    states = TokenStates.same_sequence(layer.encoding.token_states(x))
    q = torch.zeros(1, 4, 6, 8, dtype=F64)
    request = AttentionRequest.from_keywords(
        q=q, k=q, v=q, encoding=layer.encoding, q_pos=torch.arange(6)[None], k_pos=torch.arange(6)[None],
        scale=1.0, causal=True, token_states=states, dropout_p=0.1,
    )  # fmt: skip
    reasons = backend_limits(get_backend("householder"), request)  # dropout: a fact the dispatcher checks
    assert any("dropout" in r for r in reasons)
    alibi = posenc.MultiheadAttention(32, 4, "alibi", causal=True)
    request = AttentionRequest.from_keywords(
        q=q.float(), k=q.float(), v=q.float(), encoding=alibi.encoding, q_pos=torch.arange(6)[None],
        k_pos=torch.arange(6)[None], scale=1.0, causal=True,
    )  # fmt: skip
    assert get_backend("householder").reasons(request) == ["serves PaTH only; alibi is bias"]
