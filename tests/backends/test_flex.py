"""The ``flex`` backend: score_mod/mask_mod semantics, stated CPU limits, compiled forward, GPU training; the
learnable biases' (Kerple, FIRE, the dynamic MLP bias) score_mod called with 0-d indices equals their
dense bias.

The score and mask functions are checked through FlexAttention's uncompiled reference (fast); one
compiled CPU forward is ``slow``; forward and backward on a GPU (gradients into the bias table
included) run only where CUDA is available. Expected values come from the attention formula
written in ``_bias_fixtures`` with each test encoding's closed-form bias.
"""

from __future__ import annotations

import pytest
import torch

import posenc
from _bias_fixtures import ClippedTableBias, QueryNormalisedBias, reference_attention
from posenc.backends import AttentionRequest, backend_limits, get_backend
from posenc.backends.flex import flex_bias_attention

H, D = 2, 8

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


def _request(
    enc,
    *,
    batch=2,
    q_len=21,
    k_len=21,
    kv_heads=H,
    causal=True,
    offset=0,
    padding=None,
    mask=None,
    explicit=False,
    dtype=torch.float32,
    grad=False,
    **extra,
):
    q = torch.randn(batch, H, q_len, D, dtype=dtype, requires_grad=grad)
    k = torch.randn(batch, kv_heads, k_len, D, dtype=dtype, requires_grad=grad)
    v = torch.randn(batch, kv_heads, k_len, D, dtype=dtype, requires_grad=grad)
    if explicit:
        k_pos = torch.sort(torch.randint(0, 50, (batch, k_len)), dim=1).values
        q_pos = k_pos[:, k_len - q_len :]
    else:
        q_pos, k_pos = torch.arange(offset, offset + q_len)[None], torch.arange(k_len)[None]
    keywords = dict(causal=causal, causal_offset=offset, key_padding_mask=padding, attn_mask=mask)
    req = AttentionRequest.from_keywords(
        q=q, k=k, v=v, encoding=enc, q_pos=q_pos, k_pos=k_pos, scale=0.35, **keywords, **extra
    )
    req.mask_keywords = keywords  # what the reference reads (the request holds the built mask only)
    return req


def _reference(req):
    bias = req.encoding.formula(req.q_pos, req.k_pos).float()
    return reference_attention(
        req.q,
        req.k,
        req.v,
        bias,
        req.scale,
        causal=req.mask_keywords["causal"],
        offset=req.mask_keywords["causal_offset"],
        padding=req.mask_keywords["key_padding_mask"],
        attn_mask=req.mask_keywords["attn_mask"],
    )


SETUPS = {
    "causal": {},
    "cache_offset": {"q_len": 4, "k_len": 25, "offset": 21},
    "gqa_explicit_positions": {"kv_heads": 1, "explicit": True},
    "cross_padding": {"causal": False, "q_len": 11, "k_len": 30, "padding": "pad"},
    "bool_and_float_masks": {"causal": False, "mask": "bool"},
    "float_mask": {"causal": False, "mask": "float", "explicit": True},
    # Left padding under a causal mask: query 0 of the second sequence sees no key (zero output).
    "rows_without_keys": {"padding": "left"},
    "bool_mask_rows_without_keys": {"causal": False, "mask": "bool_empty_rows"},
    "float_mask_minus_inf_rows": {"mask": "float_minus_inf"},
}


def _build(enc, setup):
    options = dict(SETUPS[setup])
    batch, q_len, k_len = 2, options.get("q_len", 21), options.get("k_len", 21)
    if options.get("padding") == "pad":
        padding = torch.zeros(batch, k_len, dtype=torch.bool)
        padding[0, -5:] = True
        options["padding"] = padding
    elif options.get("padding") == "left":
        padding = torch.zeros(batch, k_len, dtype=torch.bool)
        padding[1, :3] = True
        options["padding"] = padding
    if options.get("mask") == "bool":
        mask = torch.rand(batch, H, q_len, k_len) > 0.5
        mask[..., 0] = True  # every query keeps a key
        options["mask"] = mask
    elif options.get("mask") == "bool_empty_rows":
        mask = torch.rand(batch, H, q_len, k_len) > 0.5
        mask[0, 1, 3] = False
        mask[1, :, 7] = False
        options["mask"] = mask
    elif options.get("mask") == "float":
        options["mask"] = torch.randn(1, H, q_len, k_len)
    elif options.get("mask") == "float_minus_inf":
        mask = torch.randn(1, H, q_len, k_len)
        mask[0, 0, 5] = float("-inf")  # a whole row hidden by -inf
        mask[0, 1, 9, :4] = float("-inf")
        options["mask"] = mask
    return _request(enc, **options)


@pytest.mark.parametrize("encoding_cls", [ClippedTableBias, QueryNormalisedBias])
@pytest.mark.parametrize("setup", list(SETUPS))
def test_score_and_mask_mods_match_formula(encoding_cls, setup):
    enc = encoding_cls(num_heads=H)
    req = _build(enc, setup)
    with torch.no_grad():
        out = flex_bias_attention(req, compiled=False)
        torch.testing.assert_close(out, _reference(req), rtol=1e-5, atol=1e-5)


def test_cpu_reasons_are_stated():
    """Facts of torch 2.13 on CPU, each a stated reason (this test runs on CPU tensors)."""
    enc = ClippedTableBias(num_heads=H)
    flex = get_backend("flex")
    training = _request(enc, grad=True)
    assert any("no backward pass on CPU" in r for r in flex.reasons(training))
    assert any("float64" in r for r in flex.reasons(_request(enc, dtype=torch.float64)))
    assert any("weights" in r for r in flex.reasons(_request(enc, need_weights=True)))
    assert any("dropout" in r for r in backend_limits(flex, _request(enc, dropout_p=0.1)))
    nope = _request(posenc.build("nope"))
    assert any("BIAS" in r for r in flex.reasons(nope))
    # A trainable captured table needs a backward pass too; without grad the request is served.
    assert any("no backward pass on CPU" in r for r in flex.reasons(_request(enc)))
    with torch.no_grad():
        assert flex.reasons(_request(enc)) == []


def test_training_layer_on_cpu_falls_to_another_backend_without_error():
    layer = posenc.MultiheadAttention(H * D, H, ClippedTableBias(num_heads=H), causal=True)
    layer(torch.randn(1, 9, H * D)).sum().backward()
    assert layer.last_backend != "flex"
    assert layer.encoding.table.grad is not None


@pytest.mark.slow
def test_compiled_forward_matches_formula_on_cpu():
    enc = ClippedTableBias(num_heads=H)
    req = _build(enc, "gqa_explicit_positions")
    with torch.no_grad():
        out = flex_bias_attention(req)
        torch.testing.assert_close(out, _reference(req), rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_forward_and_backward_match_formula():
    enc = ClippedTableBias(num_heads=H).cuda()
    req = _build(enc, "gqa_explicit_positions")
    # The same request on the GPU (its mask is built again there from the same description).
    on_gpu = {name: getattr(req, name).cuda().detach() for name in ("q", "k", "v", "q_pos", "k_pos")}
    for name in ("q", "k", "v"):
        on_gpu[name].requires_grad_(True)
    keywords = {name: req.mask_keywords[name] for name in ("causal", "causal_offset")}
    req = AttentionRequest.from_keywords(encoding=enc, scale=req.scale, **keywords, **on_gpu)
    req.mask_keywords = keywords
    assert get_backend("flex").reasons(req) == []
    out = flex_bias_attention(req)
    ref = _reference(req)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    inputs = [req.q, req.k, req.v, enc.table]
    weight = torch.randn_like(out)
    got = torch.autograd.grad((out * weight).sum(), inputs)
    want = torch.autograd.grad((ref * weight).sum(), inputs)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-3, atol=1e-4)


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


#: Options the compiled layer test (tests/test_backends.py, every BIAS encoding with its example
#: options) does not reach: each compile costs 7-30 s on 2 cores.
FLEX_CASES = [
    ("kerple", {"variant": "power"}),
    ("mlp_bias", {"dim": 32, "log_distance": True}),
]


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
