"""Nothing silent in the attention request and the backends and kernels that serve it.

* **One check of ``AttentionRequest`` at construction**: a table of bad requests, one per field
  and mistake, each a ValueError whose message names the field; heads that do not divide are that
  error, not the flash kernel's SIGFPE. The mask keywords (``causal``, ``key_padding_mask``, ...)
  are no request fields: a table of bad ones, each named where the mask is built.
* **Choosing a backend**: nan or inf in the inputs never reaches a fused kernel that would turn it
  finite (and the non-finite check sees every nan and inf, and no overflow); a padding mask at
  length never builds a dense mask on auto; dense weights at length 50,000 are refused up front,
  naming the memory.
* **Masks**: a float mask row of -inf gives zeros on every backend, never attention to future
  keys; a broadcast ``[B, 1, 1, Tk]`` mask works on blocked.
* **Operand layouts on the CPU flash paths.** The blocked backend's masked blocks, the near/far
  split (T5's far constant, ALiBi's separable terms), the segment split, the clipped split and
  sdpa with sinks call PyTorch's CPU flash kernel directly; each is given q, k and v whose last
  dimension is not dense (a ``[..., ::2]`` view, a transposed copy, a stride-0 expand) and must
  equal the eager backend on the ``.contiguous()`` tensors, outputs and gradients (float64).
* **sdpa with sinks** refuses a bias only when the bias has trainable parameters, and says so.
* **bfloat16 T5 table gradient** on eager and sdpa against the same attention written out in
  float64 here (T5's bucket formula copied from HF).

Expected values come from the eager backend on dense copies, a forced backend, or the attention
written out in float64.
"""

from __future__ import annotations

import dataclasses
import math
import os
import subprocess
import sys
from collections.abc import Callable

import pytest
import torch

import posenc
from posenc.backends import AttentionRequest, clipped, get_backend
from posenc.backends.blocked import blocked_bias_attention
from posenc.backends.clipped import clipped_attention
from posenc.backends.near_far import near_far_attention
from posenc.backends.segments import segment_attention
from posenc.masks.attention_mask import AttentionMask

from ._helpers import E, _layer

HEADS, DIM = 2, 8


# ---------------------------------------------------------------------------- the request's fields


B, T = 2, 6


def _valid() -> dict:
    """A valid request's fields: 2 query heads over 1 kv head, T5 built for 2 heads."""
    q = torch.randn(B, HEADS, T, DIM)
    k, v = torch.randn(B, 1, T, DIM), torch.randn(B, 1, T, DIM)
    pos = torch.arange(T)[None]
    return dict(q=q, k=k, v=v, encoding=posenc.build("t5", num_heads=HEADS), q_pos=pos, k_pos=pos, scale=0.4)


def _heads(n: int) -> dict:
    return dict(q=torch.randn(B, n, T, DIM), k=torch.randn(B, n, T, DIM), v=torch.randn(B, n, T, DIM))


META = torch.device("meta")


#: One bad request per row: (id, the field the error must name, the fields that differ from _valid()).
BAD_REQUESTS = [
    ("q-3d", "q", lambda: dict(q=torch.randn(B, T, DIM))),
    ("q-integer", "q", lambda: dict(q=torch.zeros(B, HEADS, T, DIM, dtype=torch.long))),
    ("k-3d", "k", lambda: dict(k=torch.randn(B, T, DIM))),
    ("v-5d", "v", lambda: dict(v=torch.randn(B, 1, T, DIM, 1))),
    ("k-batch", "k", lambda: dict(k=torch.randn(1, 1, T, DIM))),
    ("v-batch", "v", lambda: dict(v=torch.randn(1, 1, T, DIM))),
    # q with 2 heads, k and v with 3: SIGFPE in the flash kernel at L=1031 (see the test below)
    ("k-heads-not-a-divisor", "k", lambda: dict(k=torch.randn(B, 3, T, DIM), v=torch.randn(B, 3, T, DIM))),
    ("v-heads", "v", lambda: dict(k=torch.randn(B, 2, T, DIM), v=torch.randn(B, 1, T, DIM))),
    ("v-shorter-than-k", "v", lambda: dict(v=torch.randn(B, 1, T - 1, DIM))),
    ("k-head-size", "k", lambda: dict(k=torch.randn(B, 1, T, DIM // 2))),
    ("k-dtype", "k", lambda: dict(k=torch.randn(B, 1, T, DIM, dtype=torch.float64))),
    ("v-dtype", "v", lambda: dict(v=torch.randn(B, 1, T, DIM, dtype=torch.bfloat16))),
    ("k-device", "k", lambda: dict(k=torch.empty(B, 1, T, DIM, device=META))),
    ("v-device", "v", lambda: dict(v=torch.empty(B, 1, T, DIM, device=META))),
    ("encoding-not-an-encoding", "encoding", lambda: dict(encoding="t5")),
    # T5 built for 2 heads given 1-head queries (served silently before)
    ("encoding-t5-heads", "encoding", lambda: _heads(1)),
    (
        "encoding-alibi-heads",
        "encoding",
        lambda: dict(**_heads(4), encoding=posenc.build("alibi", num_heads=2)),
    ),
    (
        "encoding-shaw-head-size",
        "encoding",
        lambda: dict(encoding=posenc.build("shaw:k=2", num_heads=HEADS, head_dim=DIM // 2)),
    ),
    # float positions were truncated by blocked and used as they are by eager (0.014 apart)
    ("q_pos-float", "q_pos", lambda: dict(q_pos=torch.arange(T)[None] / 2)),
    ("k_pos-float", "k_pos", lambda: dict(k_pos=torch.arange(T, dtype=torch.float32)[None])),
    ("q_pos-bool", "q_pos", lambda: dict(q_pos=torch.ones(1, T, dtype=torch.bool))),
    ("q_pos-1d", "q_pos", lambda: dict(q_pos=torch.arange(T))),
    ("k_pos-1d", "k_pos", lambda: dict(k_pos=torch.arange(T))),
    ("q_pos-one-short", "q_pos", lambda: dict(q_pos=torch.arange(T - 1)[None])),
    ("k_pos-one-long", "k_pos", lambda: dict(k_pos=torch.arange(T + 1)[None])),
    ("k_pos-batch", "k_pos", lambda: dict(k_pos=torch.arange(T).expand(3, T))),
    ("q_pos-device", "q_pos", lambda: dict(q_pos=torch.empty(1, T, dtype=torch.long, device=META))),
    ("q_pos-not-a-tensor", "q_pos", lambda: dict(q_pos=list(range(T)))),
    ("scale-nan", "scale", lambda: dict(scale=float("nan"))),
    ("scale-inf", "scale", lambda: dict(scale=float("inf"))),
    ("scale-zero", "scale", lambda: dict(scale=0.0)),
    ("scale-negative", "scale", lambda: dict(scale=-0.4)),
    ("scale-string", "scale", lambda: dict(scale="0.4")),
    ("scale-tensor", "scale", lambda: dict(scale=torch.tensor([0.4, 0.5]))),
    ("dropout_p-one", "dropout_p", lambda: dict(dropout_p=1.0)),
    ("dropout_p-negative", "dropout_p", lambda: dict(dropout_p=-0.1)),
    ("dropout_p-nan", "dropout_p", lambda: dict(dropout_p=float("nan"))),
    ("need_weights-none", "need_weights", lambda: dict(need_weights=None)),
    ("mask-not-a-mask", "mask", lambda: dict(mask="causal")),
    (
        "mask-other-length",
        "mask",
        lambda: dict(mask=AttentionMask.build(q_len=T + 1, k_len=T + 1, batch=B, heads=HEADS, causal=True)),
    ),
    ("sinks-shape", "sinks", lambda: dict(sinks=torch.zeros(3))),
    ("sinks-integer", "sinks", lambda: dict(sinks=torch.zeros(HEADS, dtype=torch.long))),
]

#: One bad mask keyword per row, as BAD_REQUESTS: the request holds the built mask only, so these are
#: checked where the mask is built (AttentionMask.build, and AttentionRequest.from_keywords through it).
BAD_MASK_KEYWORDS = [
    ("causal-string", "causal", lambda: dict(causal="yes")),
    ("causal_offset-negative", "causal_offset", lambda: dict(causal=True, causal_offset=-1)),
    ("causal_offset-float", "causal_offset", lambda: dict(causal=True, causal_offset=1.5)),
    ("key_padding_mask-float", "key_padding_mask", lambda: dict(key_padding_mask=torch.zeros(B, T))),
    (
        "key_padding_mask-shape",
        "key_padding_mask",
        lambda: dict(key_padding_mask=torch.zeros(B, T - 1).bool()),
    ),
    ("key_padding_mask-1d", "key_padding_mask", lambda: dict(key_padding_mask=torch.zeros(T).bool())),
    ("attn_mask-3d", "attn_mask", lambda: dict(attn_mask=torch.ones(B, T, T).bool())),
    ("attn_mask-integer", "attn_mask", lambda: dict(attn_mask=torch.ones(1, 1, T, T, dtype=torch.long))),
    ("attn_mask-keys", "attn_mask", lambda: dict(attn_mask=torch.ones(1, 1, T, T + 1).bool())),
    ("attn_mask-heads", "attn_mask", lambda: dict(attn_mask=torch.ones(1, 3, T, T).bool())),
    (
        "key_padding_mask-device",
        "key_padding_mask",
        lambda: dict(key_padding_mask=torch.zeros(B, T, dtype=torch.bool, device=META)),
    ),
    ("attn_mask-device", "attn_mask", lambda: dict(attn_mask=torch.ones(1, 1, T, T, device=META))),
]


@pytest.mark.parametrize("field,bad", [pytest.param(f, b, id=i) for i, f, b in BAD_REQUESTS])
def test_request_names_the_field_at_fault(field, bad):
    """Checked once, at construction: a ValueError whose message starts with the field's name."""
    _ = AttentionRequest(**_valid())  # the base request is valid
    with pytest.raises(ValueError, match=rf"^AttentionRequest\.{field}: "):
        AttentionRequest(**{**_valid(), **bad()})


MASK_KEYWORDS = {"causal", "causal_offset", "key_padding_mask", "attn_mask"}


@pytest.mark.parametrize("keyword,bad", [pytest.param(f, b, id=i) for i, f, b in BAD_MASK_KEYWORDS])
def test_a_bad_mask_keyword_is_named_where_the_mask_is_built(keyword, bad):
    """The checks the request ran on its keyword fields run where the mask is built: a ValueError
    naming the keyword from AttentionMask.build, ``AttentionRequest.<keyword>`` from from_keywords."""
    _ = AttentionRequest.from_keywords(**_valid())  # the base request is valid
    with pytest.raises(ValueError, match=rf"^AttentionRequest\.{keyword}: "):
        AttentionRequest.from_keywords(**_valid(), **bad())
    _ = AttentionMask.build(q_len=T, k_len=T, batch=B, heads=HEADS)
    with pytest.raises(ValueError, match=rf"^{keyword}: "):
        AttentionMask.build(q_len=T, k_len=T, batch=B, heads=HEADS, **bad())


def test_every_field_has_a_bad_request():
    """The tables cover each field and keyword the checks read (a new field needs a row)."""
    checked = {"q", "k", "v", "encoding", "q_pos", "k_pos", "scale", "dropout_p", "need_weights"}
    checked |= {"mask", "sinks"}
    assert checked == {field for _, field, _ in BAD_REQUESTS}
    assert {keyword for _, keyword, _ in BAD_MASK_KEYWORDS} == MASK_KEYWORDS


def test_the_request_holds_one_mask_form():
    """``mask`` is the request's only mask field: the keywords are not fields, a request given one
    is a TypeError, and a request without a mask is full bidirectional attention."""
    fields = {f.name for f in dataclasses.fields(AttentionRequest)}
    assert "mask" in fields and not fields & MASK_KEYWORDS
    for keyword in sorted(MASK_KEYWORDS):
        with pytest.raises(TypeError, match=keyword):
            AttentionRequest(**_valid(), **{keyword: None})
    with pytest.raises(TypeError, match="not both"):
        AttentionRequest.from_keywords(**_valid(), mask=None)
    assert AttentionRequest(**_valid()).mask.is_trivial
    causal = AttentionRequest.from_keywords(**_valid(), causal=True, causal_offset=2).mask
    assert causal.causal_offset == 2 and causal.q_len == T and causal.heads == HEADS


def test_heads_that_do_not_divide_are_an_error_not_a_crash():
    """q with 2 heads and k, v with 3 at L=1031 on auto killed Python with SIGFPE (flash kernel);
    run in a child process so that the old crash fails this test instead of ending the run."""
    code = (
        "import torch, posenc\n"
        "from posenc.backends.run import run_attention\n"
        "from posenc.backends import AttentionRequest\n"
        "q, kv = torch.randn(1, 2, 1031, 16), torch.randn(1, 3, 1031, 16)\n"
        "pos = torch.arange(1031)[None]\n"
        "try:\n"
        "    run_attention(AttentionRequest.from_keywords(q=q, k=kv, v=kv, encoding=posenc.build('t5', num_heads=2),\n"
        "                                   q_pos=pos, k_pos=pos, scale=0.25, causal=True))\n"
        "except ValueError as e:\n"
        "    print(e)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(posenc.__file__))}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, f"exit {done.returncode}: {done.stderr[-2000:]}"
    assert done.stdout.startswith("AttentionRequest.k: has 3 heads but q has 2"), done.stdout


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "values, finite",
    [
        ([1.0, -2.0, 3.0], True),
        ([1.0, float("nan"), 3.0], False),
        ([1.0, float("inf"), 3.0], False),
        ([float("-inf"), 2.0, 3.0], False),
        ([float("inf"), float("-inf"), 3.0], False),  # their sum is nan, not a cancellation
        ([1e308, 1e308, -1.0], True),  # float64: a sum that overflows, every element finite
    ],
)
def test_the_nonfinite_check_sees_every_nan_and_inf_and_no_overflow(values, finite, dtype):
    """has_nonfinite decides whether fused kernels (which would turn nan rows finite) may serve a
    request; it reduces with one float64 sum and tests element by element only when that sum is not
    finite."""
    from posenc.backends import AttentionRequest

    x = torch.zeros(1, 1, 5, 2, dtype=torch.float64)
    x.view(-1)[: len(values)] = torch.tensor(values, dtype=torch.float64)
    x = x.to(dtype)  # 1e308 becomes inf in float32 and bfloat16
    finite = finite and bool(torch.isfinite(x).all())
    pos = torch.arange(5)[None]
    for name in ("q", "k", "v"):
        q, k, v = (x if name == which else torch.ones_like(x) for which in ("q", "k", "v"))
        req = AttentionRequest.from_keywords(
            q=q, k=k, v=v, encoding=posenc.build("nope"), q_pos=pos, k_pos=pos, scale=1.0, causal=True
        )
        assert req.has_nonfinite is (not finite), (name, values)


# ---------------------------------------------------------------------------- choosing a backend


@pytest.mark.parametrize("encoding", ["rope", "alibi"])
def test_nan_in_the_input_is_never_turned_into_finite_numbers(encoding):
    """PyTorch's CPU flash kernel returns zeros for a query row whose logits are nan; auto must not
    pick it for such a request (it goes to eager, which propagates nan)."""
    layer = _layer(encoding, causal=True)
    x = torch.randn(1, 300, E)  # large enough that auto would take a fused kernel
    x[0, 5, 3] = float("nan")
    out = layer(x)
    assert layer.last_backend == "eager"
    assert bool(torch.isnan(out[0, 5]).all())
    for backend in ("sdpa", "blocked"):
        with (
            pytest.raises(posenc.backends.NoBackendError, match="nan or inf in the inputs"),
            posenc.use_backend(backend),
        ):
            layer(x)


def test_key_padding_at_length_never_builds_a_dense_mask_on_auto(monkeypatch):
    """sdpa turns a padding mask into a dense [B, 1, L, L] tensor (10 GB at L=50,000); past a size
    auto takes the blocked backend instead, with the same result."""
    monkeypatch.setattr("posenc.backends.parts.query_blocks.MAX_DENSE_MASK_BYTES", 300 * 300 * 4 - 1)
    layer = _layer("rope", causal=True).double()
    x = torch.randn(2, 300, E, dtype=torch.float64)
    pad = torch.zeros(2, 300, dtype=torch.bool)
    pad[1, :7] = True
    out = layer(x, key_padding_mask=pad)
    assert layer.last_backend == "segments"  # the padding mask split into segments, no dense mask
    with posenc.use_backend("sdpa"):
        torch.testing.assert_close(out, layer(x, key_padding_mask=pad), rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("how", ["need_weights", "forced_eager", "use_backend"])
def test_dense_weights_at_length_50000_fail_up_front_naming_the_memory(how):
    """[1, 2, 50000, 50000] float32 weights are 18.6 GiB: refused before anything is allocated."""
    layer = _layer("alibi", causal=True, backend="eager" if how == "forced_eager" else "auto")
    x = torch.randn(1, 50_000, E)
    match = (
        r"need_weights=True returns \[B, H, Tq, Tk\] = \[1, 2, 50000, 50000\] attention weights: 18\.6 GiB "
        r"\(limit 4 GiB\); drop need_weights"
        if how == "need_weights"
        else r"backend='eager' builds .* 18\.6 GiB \(limit 4 GiB\); use backend='auto'"
    )
    with pytest.raises(ValueError, match=match):
        if how == "use_backend":
            with posenc.use_backend("eager"):
                layer(x)
        else:
            layer(x, need_weights=how == "need_weights")


# ---------------------------------------------------------------------------- masks


@pytest.mark.parametrize("backend", ["eager", "sdpa", "blocked"])
def test_a_float_mask_row_of_minus_inf_never_unmasks_future_keys(backend):
    """A row hidden entirely by -inf in a causal layer gives zeros, not attention to future keys."""
    layer = _layer("alibi", causal=True)
    x = torch.randn(1, 6, E, requires_grad=True)
    mask = torch.zeros(6, 6)
    mask[2] = float("-inf")
    with posenc.use_backend(backend):
        out, weights = layer(x, attn_mask=mask, need_weights=True)
    assert torch.isfinite(out).all() and torch.isfinite(weights).all()
    assert (weights[0, :, 2] == 0).all()
    assert (weights.triu(1) == 0).all()
    # The row's output is the output projection's bias alone: nothing was attended to.
    torch.testing.assert_close(out[0, 2], layer.out_proj.bias.detach())
    out.sum().backward()
    assert torch.isfinite(x.grad).all()


def test_broadcast_attn_mask_rows_work_on_blocked():
    """A [B, 1, 1, Tk] mask (HF's encoder padding shape) is broadcastable, as the field says: blocked
    sliced its single row per query block and failed; it equals eager on the expanded mask now."""
    torch.manual_seed(6)
    length = 300
    enc = _t5(causal=False)
    q, k, v = (torch.randn(B, HEADS, length, DIM, dtype=torch.float64) for _ in range(3))
    pos = torch.arange(length)[None]
    allowed = torch.rand(B, 1, 1, length) > 0.3
    fields = dict(q=q, k=k, v=v, encoding=enc, q_pos=pos, k_pos=pos, scale=0.4)
    got, _ = get_backend("blocked").run(AttentionRequest.from_keywords(**fields, attn_mask=allowed))
    want, _ = get_backend("eager").run(
        AttentionRequest.from_keywords(**fields, attn_mask=allowed.expand(B, 1, length, length))
    )
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


# ---------------------------------------------------------------------------- operand layouts


#: Views with another last-dimension stride than 1, each built from a dense leaf so gradients reach
#: it: ``make(leaf)`` is what the path gets, ``make(leaf).contiguous()`` what eager gets.
LAYOUTS: dict[str, tuple[Callable[[tuple], tuple], Callable[[torch.Tensor], torch.Tensor]]] = {
    # [..., ::2] of a wider tensor (stride 2)
    "every_other": (lambda shape: shape, lambda x: torch.stack((x, torch.full_like(x, 7.0)), -1)[..., 0]),
    # the transpose of a [.., D, T] tensor (stride T)
    "transposed": (lambda shape: shape, lambda x: x.transpose(-1, -2).contiguous().transpose(-1, -2)),
    # one number per position expanded over the head size (stride 0)
    "expanded": (lambda shape: (*shape[:-1], 1), lambda x: x.expand(*x.shape[:-1], DIM)),
}


def _operands(layout: str, batch: int, length: int, kv_heads: int = HEADS):
    """Leaves ``(q, k, v)`` and the views of them that the path under test receives."""
    leaf_shape, make = LAYOUTS[layout]
    shapes = [(batch, HEADS, length, DIM), *[(batch, kv_heads, length, DIM)] * 2]
    leaves = [torch.randn(leaf_shape(s), dtype=torch.float64, requires_grad=True) for s in shapes]
    views = [make(leaf) for leaf in leaves]
    assert all(v.stride(-1) != 1 for v in views)
    return leaves, views


def _request(views, enc, length, **fields) -> AttentionRequest:
    pos = torch.arange(length)[None]
    q, k, v = views
    make = AttentionRequest if "mask" in fields else AttentionRequest.from_keywords
    return make(q=q, k=k, v=v, encoding=enc, q_pos=pos, k_pos=pos, scale=0.4, **fields)


def _contiguous(req: AttentionRequest) -> AttentionRequest:
    """``req`` with dense copies of q, k and v (still in the graph of the same leaves)."""
    return AttentionRequest(
        q=req.q.contiguous(), k=req.k.contiguous(), v=req.v.contiguous(), encoding=req.encoding,
        q_pos=req.q_pos, k_pos=req.k_pos, scale=req.scale, layer=req.layer, mask=req.mask, sinks=req.sinks,
    )  # fmt: skip


def _assert_path_equals_eager(run, req: AttentionRequest, leaves, extra=()) -> None:
    """``run(req)`` against eager on the request's dense copies: outputs and the gradients of the
    leaves (and of ``extra``: sinks, encoding parameters)."""
    out = run(req)
    ref, _ = get_backend("eager").run(_contiguous(req))
    torch.testing.assert_close(out, ref, rtol=1e-9, atol=1e-10)
    weight = torch.randn_like(ref)
    inputs = [*leaves, *extra]
    got = torch.autograd.grad((out * weight).sum(), inputs)
    want = torch.autograd.grad((ref * weight).sum(), inputs)
    for name, g, w in zip(["q", "k", "v", *(f"extra{i}" for i in range(len(extra)))], got, want):
        torch.testing.assert_close(g, w, rtol=1e-8, atol=1e-9, msg=lambda m, name=name: f"{name}: {m}")


def _t5(causal: bool) -> posenc.PositionalEncoding:
    enc = posenc.build(f"t5:bidirectional={not causal}", num_heads=HEADS).double()
    with torch.no_grad():
        enc.table.weight.normal_(0.0, 0.5)
    return enc


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_blocked_masked_blocks_read_strided_operands(layout):
    """T5 under a causal mask with padding, query blocks of 128 through the masked kernel (the
    issue's case: v[..., ::2] was 3.4 off)."""
    torch.manual_seed(1)
    length = 300
    leaves, views = _operands(layout, 2, length)
    enc = _t5(causal=True)
    padding = torch.zeros(2, length, dtype=torch.bool)
    padding[1, :5] = True
    req = _request(views, enc, length, causal=True, key_padding_mask=padding)
    _assert_path_equals_eager(blocked_bias_attention, req, leaves, extra=list(enc.parameters()))


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize(
    "name,causal", [("t5", True), ("t5", False), ("alibi", True)], ids=["t5-causal", "t5-bidir", "alibi"]
)
def test_near_far_split_reads_strided_operands(name, causal, layout):
    torch.manual_seed(2)
    length = 300
    leaves, views = _operands(layout, 2, length, kv_heads=1)
    enc = _t5(causal) if name == "t5" else posenc.build("alibi", num_heads=HEADS).double()
    req = _request(views, enc, length, causal=causal)
    _assert_path_equals_eager(near_far_attention, req, leaves, extra=list(enc.parameters()))


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_segment_split_reads_strided_operands(layout):
    """NoPE under a sliding window: bands of 128 queries in strided runs of the operands."""
    torch.manual_seed(3)
    length = 300
    leaves, views = _operands(layout, 2, length)
    mask = AttentionMask.build(q_len=length, k_len=length, batch=2, heads=HEADS, causal=True, window=40)
    req = _request(views, posenc.build("nope"), length, mask=mask)
    _assert_path_equals_eager(segment_attention, req, leaves)


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
def test_clipped_split_reads_strided_operands(causal, layout, monkeypatch):
    """Shaw without a value term: near blocks and far parts both through the flash kernel."""
    monkeypatch.setattr(clipped, "CLIPPED_BLOCK", 8)
    torch.manual_seed(4)
    length = 64
    leaves, views = _operands(layout, 2, length)
    enc = posenc.build("shaw:k=4,value_term=False", head_dim=DIM, num_heads=HEADS).double()
    req = _request(views, enc, length, causal=causal)
    _assert_path_equals_eager(clipped_attention, req, leaves, extra=list(enc.parameters()))


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("name", ["nope", "alibi"])
def test_sdpa_with_sinks_reads_strided_operands(name, layout):
    torch.manual_seed(5)
    length = 40
    leaves, views = _operands(layout, 2, length, kv_heads=1)
    enc = posenc.build(name, num_heads=HEADS).double() if name == "alibi" else posenc.build("nope")
    sinks = torch.randn(HEADS, dtype=torch.float64, requires_grad=True)
    req = _request(views, enc, length, causal=True, sinks=sinks)
    assert get_backend("sdpa").reasons(req) == []

    def run(r):
        return get_backend("sdpa").run(r)[0]

    _assert_path_equals_eager(run, req, leaves, extra=[sinks])


# ---------------------------------------------------------------------------- sdpa, sinks and a bias


def _sinks_request(enc, length=12):
    q, k, v = (torch.randn(1, HEADS, length, DIM, dtype=torch.float64, requires_grad=True) for _ in range(3))
    pos = torch.arange(length)[None]
    sinks = torch.randn(HEADS, dtype=torch.float64, requires_grad=True)
    return AttentionRequest.from_keywords(
        q=q, k=k, v=v, encoding=enc, q_pos=pos, k_pos=pos, scale=0.4, causal=True, sinks=sinks
    )  # fmt: skip


def test_sdpa_with_sinks_refuses_only_a_bias_with_trainable_parameters():
    """ALiBi has no parameter: nothing misses a gradient, so sdpa serves it under autograd (it was
    refused as "the bias gets no gradient"). T5's table would: the reason names it and the way out."""
    sdpa = get_backend("sdpa")
    assert sdpa.reasons(_sinks_request(posenc.build("alibi", num_heads=HEADS).double())) == []
    t5 = posenc.build("t5", num_heads=HEADS).double()
    (reason,) = sdpa.reasons(_sinks_request(t5))
    assert "table.weight" in reason and "no gradient" in reason and "blocked" in reason
    t5.requires_grad_(False)
    assert sdpa.reasons(_sinks_request(t5)) == []


# ---------------------------------------------------------------------------- T5 in bfloat16


def _hf_t5_bucket(relative_position: torch.Tensor, bidirectional: bool, num_buckets=32, max_distance=128):
    """HF ``T5Attention._relative_position_bucket``, copied (relative_position = key − query)."""
    relative_buckets = torch.zeros_like(relative_position)
    if bidirectional:
        num_buckets //= 2
        relative_buckets += (relative_position > 0).to(torch.long) * num_buckets
        relative_position = torch.abs(relative_position)
    else:
        relative_position = -torch.min(relative_position, torch.zeros_like(relative_position))
    max_exact = num_buckets // 2
    is_small = relative_position < max_exact
    relative_position_if_large = max_exact + (
        torch.log(relative_position.float() / max_exact)
        / math.log(max_distance / max_exact)
        * (num_buckets - max_exact)
    ).to(torch.long)
    relative_position_if_large = torch.min(
        relative_position_if_large, torch.full_like(relative_position_if_large, num_buckets - 1)
    )
    relative_buckets += torch.where(is_small, relative_position, relative_position_if_large)
    return relative_buckets


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
def test_t5_table_gradient_in_bfloat16_is_summed_wide(backend):
    """T5 causal at L=1031 in bfloat16: the table's gradient within 5% of the same attention written
    out in float64 (it was summed in bfloat16 by the gather's backward: 62% off; blocked: 1%)."""
    torch.manual_seed(7)
    length, scale = 1031, 0.25
    q, k, v = (torch.randn(1, HEADS, length, 16, dtype=torch.float64) for _ in range(3))
    weight = torch.randn(1, HEADS, length, 16, dtype=torch.float64)
    enc = posenc.build("t5:bidirectional=False", num_heads=HEADS)
    with torch.no_grad():
        enc.table.weight.normal_(0.0, 0.5)
    table64 = enc.table.weight.detach().double().requires_grad_(True)
    enc = enc.to(torch.bfloat16)

    pos = torch.arange(length)
    bias = table64[_hf_t5_bucket(pos[None, :] - pos[:, None], bidirectional=False)].permute(2, 0, 1)
    logits = (q @ k.transpose(-1, -2)) * scale + bias
    logits = logits.masked_fill(pos[None, :] > pos[:, None], float("-inf"))
    ref = torch.softmax(logits, -1) @ v
    (want,) = torch.autograd.grad((ref * weight).sum(), table64)

    bf = [t.to(torch.bfloat16) for t in (q, k, v)]
    req = AttentionRequest.from_keywords(
        q=bf[0], k=bf[1], v=bf[2], encoding=enc, q_pos=pos[None], k_pos=pos[None], scale=scale, causal=True
    )  # fmt: skip
    out, _ = get_backend(backend).run(req)
    (got,) = torch.autograd.grad((out.double() * weight).sum(), enc.table.weight)
    relative = (got.double() - want).norm() / want.norm()
    assert relative < 0.05, f"{backend}: table gradient {relative:.1%} off float64"
