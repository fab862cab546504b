"""A decode step checks only the tokens it adds for nan/inf, and no backend turns nan into finite numbers.

A cached entry was checked when it was written (its ``FiniteMark``); the next step's request reads
only q and the new keys and values. A nan in the new tokens still sends the request to a backend that
propagates it, and a nan written at an earlier step stays in every later output, as on eager.
"""

from __future__ import annotations

import copy

import pytest
import torch

import posenc
from _contract import nan_hook
from posenc.backends import AttentionRequest, NoBackendError
from posenc.backends import request as request_module

CPU_BACKENDS = ["auto", "near_far", "segments", "blocked", "flex", "clipped", "relative", "sdpa", "eager"]

ENCODINGS = ["rope", "alibi", "t5", "fox", "shaw"]


def _layer(encoding: str, backend: str) -> posenc.MultiheadAttention:
    torch.manual_seed(0)
    return posenc.MultiheadAttention(32, 4, encoding, causal=True, backend=backend).eval()


def _decode(layer, xs, which: str | None, at: int) -> list[torch.Tensor]:
    """Prefill ``xs[0]``, then one step per further input; a nan enters ``which`` (q, k or v) at step ``at``."""
    step = [0]
    handle = None
    if which is not None:
        handle = getattr(layer, f"{which}_proj").register_forward_hook(nan_hook(step, at))
    cache, outs = posenc.KVCache(), []
    try:
        for i, x in enumerate(xs):
            step[0] = i
            outs.append(layer(x, cache=cache))
    finally:
        if handle is not None:
            handle.remove()
    return outs


def _inputs(steps: int = 5) -> list[torch.Tensor]:
    torch.manual_seed(1)
    return [torch.randn(2, 6, 32)] + [torch.randn(2, 1, 32) for _ in range(steps)]


def _same_as_eager(outs, eager_outs) -> None:
    for got, want in zip(outs, eager_outs, strict=True):
        assert torch.equal(got.isnan(), want.isnan())
        assert torch.equal(got.isinf(), want.isinf())
        fine = torch.isfinite(want)
        torch.testing.assert_close(got[fine], want[fine], atol=1e-5, rtol=1e-5)


def _runs_clean(layer, xs) -> bool:
    try:
        _decode(copy.deepcopy(layer), xs, None, -1)
    except (NoBackendError, ValueError):
        return False
    return True


@pytest.mark.parametrize("which", ["q", "k", "v"])
@pytest.mark.parametrize("encoding", ENCODINGS)
@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_nan_in_new_token_propagates(encoding: str, backend: str, which: str) -> None:
    """(a) A nan in the new token's q, k or v at decode step 2 gives nan output, through the cached
    layer, on every CPU backend that serves the clean steps (a forced fused one may refuse instead);
    (b) a nan key or value cached at step 2 keeps every later output as eager's."""
    xs = _inputs()
    layer = _layer(encoding, backend)
    if not _runs_clean(layer, xs):
        pytest.skip(f"{backend} does not serve {encoding} decoding")
    eager = copy.deepcopy(layer)
    eager.backend = "eager"
    want = _decode(eager, xs, which, at=2)
    assert not torch.isfinite(want[2]).all()
    try:
        got = _decode(layer, xs, which, at=2)
    except NoBackendError as error:  # a forced fused backend refuses the nan: it never hides it
        assert backend != "auto" and "nan or inf" in str(error)
        return
    assert not torch.isfinite(got[2]).all()
    if which != "q":  # the nan key or value is cached: every later step sees it
        assert all(not torch.isfinite(out).all() for out in got[2:])
    _same_as_eager(got, want)


def _counted_decode_step(monkeypatch, cache_len: int) -> list[int]:
    """Elements the nan check reduces in one decode step after a ``cache_len``-token prefill."""
    torch.manual_seed(0)
    layer = posenc.MultiheadAttention(32, 4, "rope", causal=True).eval()
    cache = posenc.KVCache()
    with torch.no_grad():
        layer(torch.randn(1, cache_len, 32), cache=cache)
        counted: list[int] = []
        real, real_together = request_module.all_finite, request_module.all_finite_together

        def counting(t: torch.Tensor) -> bool:
            counted.append(t.numel())
            return real(t)

        def counting_together(tensors) -> bool:
            counted.extend(t.numel() for t in tensors)
            return real_together(tensors)

        monkeypatch.setattr(request_module, "all_finite", counting)
        monkeypatch.setattr(request_module, "all_finite_together", counting_together)
        layer(torch.randn(1, 1, 32), cache=cache)
        monkeypatch.setattr(request_module, "all_finite", real)
        monkeypatch.setattr(request_module, "all_finite_together", real_together)
    assert layer.last_backend == "sdpa"
    return counted


def test_decode_check_is_o_new_tokens(monkeypatch) -> None:
    """(c) One new token costs the nan check the same elements with 16 or 1024 cached tokens."""
    short = _counted_decode_step(monkeypatch, 16)
    long = _counted_decode_step(monkeypatch, 1024)
    assert short and sum(short) == sum(long)
    assert sum(short) == 3 * 4 * 8  # q, the new key and the new value: [1, 4, 1, 8] each


def test_cross_attention_cache_is_checked_once(monkeypatch) -> None:
    """A cross-attention entry is checked at the step that writes it; later steps read only q."""
    torch.manual_seed(0)
    layer = posenc.MultiheadAttention(32, 4, "rope").eval()
    context, cache = torch.randn(1, 50, 32), posenc.KVCache()
    counted: list[int] = []
    real, real_together = request_module.all_finite, request_module.all_finite_together
    monkeypatch.setattr(request_module, "all_finite", lambda t: counted.append(t.numel()) or real(t))
    monkeypatch.setattr(
        request_module,
        "all_finite_together",
        lambda ts: counted.extend(t.numel() for t in ts) or real_together(ts),
    )
    with torch.no_grad():
        layer(torch.randn(1, 1, 32), context=context, cache=cache)
        first, counted[:] = sum(counted), []
        layer(torch.randn(1, 1, 32), context=context, cache=cache)
    assert first > sum(counted) == 4 * 8


def test_known_finite_keys_is_checked() -> None:
    q, k = torch.randn(1, 2, 1, 8), torch.randn(1, 2, 5, 8)
    pos = torch.arange(5)[None]
    nope = posenc.build("nope")
    fields = dict(q=q, k=k, v=k, encoding=nope, q_pos=pos[:, 4:], k_pos=pos, scale=0.3)
    with pytest.raises(ValueError, match="known_finite_keys"):
        AttentionRequest(**fields, known_finite_keys=6)
    k_nan = k.clone()
    k_nan[0, 0, 4, 0] = float("nan")  # past the known prefix: still found
    assert AttentionRequest(**{**fields, "k": k_nan}, known_finite_keys=4).has_nonfinite
    mark = posenc.encodings.base.FiniteMark()
    assert not AttentionRequest(**fields, known_finite_keys=4, finite_mark=mark).has_nonfinite
    assert mark.finite


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("size", [1, 37, 20000])
def test_all_finite_together_agrees_with_isfinite(dtype, size) -> None:
    """The summed test against torch.isfinite element by element: nan, inf, inf - inf (which sums to
    nan), and finite values whose sum overflows the dtype (still finite: the exact test decides)."""
    torch.manual_seed(size)
    big = torch.finfo(dtype).max / 2
    cases = {
        "finite": torch.randn(size).to(dtype),
        "overflowing sum": torch.full((max(size, 4),), big, dtype=dtype),
        "nan": torch.randn(size).to(dtype).index_fill(0, torch.tensor([size // 2]), float("nan")),
        "inf": torch.randn(size).to(dtype).index_fill(0, torch.tensor([0]), float("inf")),
        "inf - inf": torch.tensor([float("inf"), float("-inf")], dtype=dtype).repeat(max(size // 2, 1)),
    }
    other = torch.randn(3, 5)[:, ::2]  # a strided, finite companion
    for name, tensor in cases.items():
        want = bool(torch.isfinite(tensor).all())
        got = request_module.all_finite_together((other, tensor, torch.arange(3)))
        assert got == want, name


def test_the_nan_test_of_a_training_call_reads_values_without_warning(recwarn) -> None:
    """q, k, v that require grad are read as values (``float`` of a graph tensor warns)."""
    layer = posenc.MultiheadAttention(32, 4, "rope", causal=True)
    layer(torch.randn(2, 5, 32, requires_grad=True)).sum().backward()
    assert not [w for w in recwarn if "requires_grad" in str(w.message)]
