"""The dynamic MLP bias against x-transformers' DynamicPositionBias and a softmax written out
(docs/conventions.md §10)."""

from __future__ import annotations

import pytest
import torch

import posenc

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
