"""The ``piecewise`` backend (ReRoPE, Leaky ReRoPE, Self-Extend, DCA by tiles of the CPU flash kernel)
against the eager reference, which computes every part's dense logits and keeps each pair's own:
output and gradients in float64, for every registered piecewise family (found from the registry, so a
new family is tested here without a new test), at odd lengths and offsets; the tiles against the
families' own part index; what it refuses; and that it never builds a ``[L, L]`` tensor."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import posenc
from posenc.backends import AttentionRequest, get_backend, select_backend
from posenc.backends.piecewise import PIECEWISE_MIN_LEN, piecewise_attention
from posenc.encodings._rope_parts import PiecewiseRoPE
from posenc.examples import build_example
from posenc.masks.attention_mask import AttentionMask

F64 = torch.float64
HEADS, KV_HEADS, DIM = 4, 2, 16
FAMILIES = sorted(n for n in posenc.available() if issubclass(posenc.get_class(n), PiecewiseRoPE))
#: Options beyond the registry's examples: long windows and chunks (one part only at short lengths),
#: the query scaling, a scaling with an attention factor, pairings and partial rotation.
MORE_SPECS = [
    "rerope:window=100",
    "rerope:window=7,log_scale_length=9,pairing=interleaved",
    "leaky_rerope:window=6,leaky_factor=2.5,scaling=yarn,factor=4,original_max_position_embeddings=16",
    "self_extend:group_size=4,neighbor_window=6,rotary_dim=8",
    "self_extend:group_size=1,neighbor_window=3",
    "dca:chunk_size=9,local_size=3",
    "dca:chunk_size=30,local_size=0",
]
SPECS = FAMILIES + MORE_SPECS
#: (length, first position): one token, odd lengths, positions that do not start at 0 (DCA's
#: first chunk is then cut), a length where the band takes several blocks.
SHAPES = [(1, 0), (37, 0), (41, 5), (113, 3)]


def _request(spec: str, length: int, start: int = 0, dtype=F64, grad: bool = True, **keywords):
    torch.manual_seed(length + start)
    enc = posenc.build(spec, head_dim=DIM) if ":" in spec else build_example(spec, HEADS, DIM)

    def tensor(heads):
        return torch.randn(2, heads, length, DIM, dtype=dtype, requires_grad=grad)

    pos = torch.arange(start, start + length)[None]
    return AttentionRequest.from_keywords(
        q=tensor(HEADS), k=tensor(KV_HEADS), v=tensor(KV_HEADS), encoding=enc, q_pos=pos, k_pos=pos,
        scale=DIM**-0.5, **({"causal": True} | keywords),
    )  # fmt: skip


def _out_and_grads(run, req):
    out = run(req)
    weight = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)
    return out, torch.autograd.grad((out * weight).sum(), (req.q, req.k, req.v))


@pytest.mark.parametrize("length,start", SHAPES, ids=[f"{n}at{s}" for n, s in SHAPES])
@pytest.mark.parametrize("spec", SPECS)
def test_piecewise_matches_eager(spec, length, start):
    req = _request(spec, length, start)
    assert get_backend("piecewise").reasons(req) == []
    out, grads = _out_and_grads(lambda r: piecewise_attention(r, block=8, size=16), req)
    ref, want = _out_and_grads(lambda r: get_backend("eager").run(r)[0], req)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    for name, g, w in zip("qkv", grads, want):
        torch.testing.assert_close(
            g, w, rtol=1e-9, atol=1e-12, msg=lambda m, name=name: f"grad of {name}: {m}"
        )


@pytest.mark.parametrize(
    "spec", ["self_extend:group_size=3,neighbor_window=40", "dca:chunk_size=50,local_size=10"]
)
def test_piecewise_float32_through_a_layer(spec):
    """A layer forced onto the backend against the same layer on eager: float32 output and the
    projections' gradients."""
    torch.manual_seed(0)
    layer = posenc.MultiheadAttention(HEADS * DIM, HEADS, encoding=spec, num_kv_heads=KV_HEADS, causal=True)
    x = torch.randn(2, 150, HEADS * DIM)
    results = []
    for backend in ("piecewise", "eager"):
        layer.zero_grad()
        with posenc.backends.use_backend(backend):
            out = layer(x)
        out.square().mean().backward()
        assert layer.last_backend == backend
        results.append((out, [p.grad.clone() for p in layer.parameters()]))
    (out, grads), (ref, want) = results
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    for g, w in zip(grads, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("length,start", [(1, 0), (23, 0), (64, 7), (97, 13)])
@pytest.mark.parametrize("spec", SPECS)
def test_tiles_cover_each_causal_pair_once_in_its_part(spec, length, start):
    """Every causal pair lies in exactly one tile, and that tile's part is the pair's part as the
    family's own ``parts`` index (the one the eager logits use) gives it; no tile holds a future key."""
    enc = _request(spec, 1).encoding
    pos = torch.arange(start, start + length)[None]
    part, _ = enc.parts(pos, pos)
    cover = torch.zeros(length, length, dtype=torch.long)
    for tile in enc.part_tiles(start, length):
        i = torch.arange(*tile.rows)[:, None]
        j = torch.arange(*tile.keys)[None]
        inside = torch.ones(i.shape[0], j.shape[1], dtype=torch.bool)
        if tile.distances is not None:
            lo, hi = tile.distances
            inside &= i - j >= lo
            if hi is not None:
                inside &= i - j <= hi
        assert bool((j <= i)[inside].all()), f"{tile} holds a future key"
        rows, keys = slice(*tile.rows), slice(*tile.keys)
        cover[rows, keys] += inside.long()
        wrong = inside & (part[0, rows, keys] != tile.part)
        assert not bool(wrong.any()), f"{tile} holds pairs of another part"
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    assert bool((cover[causal] == 1).all()) and bool((cover[~causal] == 0).all())


def test_piecewise_states_what_it_cannot_serve():
    plain = _request("rerope:window=4", 40, grad=False)
    pad = torch.zeros(2, 40, dtype=torch.bool)
    pad[0, :3] = True
    fields = {f: getattr(plain, f) for f in ("q", "k", "v", "encoding", "q_pos", "k_pos", "scale")}
    cases = {
        "padding": AttentionRequest.from_keywords(**fields, causal=True, key_padding_mask=pad),
        "window": AttentionRequest(
            **fields,
            mask=AttentionMask.build(q_len=40, k_len=40, batch=2, heads=HEADS, causal=True, window=8),
        ),
        "cross": _request("rerope:window=4", 40, grad=False, causal=False),
    }
    for label, req in cases.items():
        reasons = get_backend("piecewise").reasons(req)
        assert any("plain causal mask" in r for r in reasons), (label, reasons)


def test_piecewise_refuses_other_encodings_and_nonfinite_inputs():
    pos = torch.arange(40)[None]
    q = torch.randn(1, HEADS, 40, DIM)
    rope = AttentionRequest.from_keywords(
        q=q,
        k=q,
        v=q,
        encoding=posenc.build("rope", head_dim=DIM),
        q_pos=pos,
        k_pos=pos,
        scale=0.25,
        causal=True,
    )
    assert any("piecewise-RoPE families" in r for r in get_backend("piecewise").reasons(rope))
    req = _request("dca:chunk_size=8,local_size=2", 40, grad=False)
    req.v[0, 0, 3, 0] = float("nan")
    reasons = get_backend("piecewise").reasons(req)
    assert any("nan" in r for r in reasons)
    # auto then takes a backend that propagates the nan to the rows that read key 3 (its kv head
    # serves query heads 0 and 1)
    out, _ = select_backend(req).run(req)
    assert bool(out[0, :2, 3:, 0].isnan().all())


def test_auto_takes_piecewise_for_long_causal_self_attention():
    short = _request("self_extend:group_size=2,neighbor_window=64", PIECEWISE_MIN_LEN - 1, grad=False)
    long = _request("self_extend:group_size=2,neighbor_window=64", PIECEWISE_MIN_LEN, grad=False)
    assert select_backend(short).name == "relative"
    assert select_backend(long).name == "piecewise"


class _LargestTensor(TorchDispatchMode):
    """Records the largest number of elements of any tensor an op returns."""

    largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        for t in result if isinstance(result, (tuple, list)) else (result,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return result


@pytest.mark.parametrize("spec", ["rerope:window=64", "dca:chunk_size=96,local_size=16"])
def test_piecewise_never_builds_the_logit_matrix(spec):
    """Forward and backward at 1024 tokens: no op returns a tensor as large as one head's
    ``[L, L]`` logits (the eager reference's logits are ``[B, H, L, L]``)."""
    length = 1024
    req = _request(spec, length, dtype=torch.float32)
    with _LargestTensor() as seen:
        out = piecewise_attention(req)
        torch.autograd.grad(out.sum(), (req.q, req.k, req.v))
    assert seen.largest < length * length // 2, seen.largest
    with _LargestTensor() as eager:
        get_backend("eager").run(req)
    assert eager.largest >= length * length  # the check sees what a dense path builds


def test_piecewise_refuses_trainable_encoding_parameters():
    """The tiles return gradients for q, k and v only: an encoding parameter that trains (a future
    learned table) must send the request elsewhere, not lose its gradient."""
    req = _request("rerope:window=4", 40, grad=False)
    req.encoding.register_parameter("probe", torch.nn.Parameter(torch.zeros(1)))
    assert any("require grad" in r for r in get_backend("piecewise").reasons(req))
    with torch.no_grad():
        assert get_backend("piecewise").reasons(req) == []


@pytest.mark.parametrize(
    "spec", ["self_extend:group_size=4,neighbor_window=64", "dca:chunk_size=200,local_size=40"]
)
def test_hf_prefill_runs_on_the_tiles_and_equals_the_dense_path(spec):
    """A tiny HF Llama swapped to a piecewise family: a 520-token prefill (auto: the tiles) equals the
    same model forced onto the dense ``relative`` backend, and cached generation (prefill on the
    tiles, steps on ``relative``) picks a full pass's tokens."""
    pytest.importorskip("transformers")
    import posenc.hf
    from _piecewise_rope import cached_generate_equals_full_pass, hf_ids, tiny_llama

    model = posenc.hf.swap_encoding(tiny_llama(), spec)
    ids = hf_ids(PIECEWISE_MIN_LEN + 8, batch=1)
    seen = []
    original = piecewise_attention

    def spy(req, *args, **kwargs):
        seen.append(req.q_len)
        return original(req, *args, **kwargs)

    with torch.no_grad(), pytest.MonkeyPatch.context() as patch:
        patch.setattr(get_backend("piecewise"), "run", lambda req: (spy(req), None))
        got = model(ids).logits
    assert seen == [ids.shape[1]] * 2  # both layers' prefill on the tiles
    with torch.no_grad(), posenc.backends.use_backend("relative"):
        want = model(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-10)
    cached_generate_equals_full_pass(model, ids, 4)
