"""Choosing a backend (posenc.backends.dispatch, ``select_backend``, ``use_backend``): ``auto`` picks the
same engine as before the splits became backends over a grid of requests, one priority list per device and
``set_priority``, a forced backend that cannot run names its reasons.

Before, ``auto`` chose ``blocked`` or ``relative`` and those chose a split inside ``run``:
``blocked`` ran the near/far split for a BIAS request (CPU flash dtypes, square self-attention at
consecutive positions with a plain causal mask or none, a far constant or separable terms, from
1024 queries) and the segment split for a request without a bias whose mask is neither empty nor
plain causal and whose segments cost at most the masked query blocks; ``relative`` ran the clipped
split for a CONTENT encoding declaring clipped tables (float32/64 on CPU, square, plain causal or no
mask, no sinks, from 512 queries and 8 near blocks, no nan). ``EXPECTED`` is that logic read case by
case (the comment names the rule that decides); the test asks ``auto`` now.
"""

from __future__ import annotations

import threading

import pytest
import torch

import posenc
from _dispatch_grid import EXPECTED, build
from posenc.backends import (
    AttentionRequest,
    NoBackendError,
    available_backends,
    dispatch,
    get_backend,
    requested_backend,
    select_backend,
)


@pytest.fixture(autouse=True)
def _nothing_forced_after():
    yield
    posenc.use_backend("auto")


@pytest.mark.parametrize("case", list(EXPECTED))
def test_auto_picks_the_engine_that_ran_before(case):
    with torch.no_grad():
        assert select_backend(build(case)).name == EXPECTED[case]


# ----------------------------------------------------------------------------
# The mask module and the dispatcher: one mask object per request, one priority list per device.


def _request(encoding="alibi", device="cpu", causal=True, **kw):
    enc = posenc.build(encoding, num_heads=2) if encoding != "rope" else posenc.build("rope", head_dim=8)
    q = torch.zeros(1, 2, 5, 8, device=device)
    pos = torch.arange(5, device=device)[None]
    return AttentionRequest.from_keywords(
        q=q, k=q, v=q, encoding=enc, q_pos=pos, k_pos=pos, scale=1.0, causal=causal, **kw
    )


def test_priority_lists_per_device():
    assert available_backends("cpu")[:3] == ["near_far", "segments", "blocked"]  # the splits first
    assert available_backends("cuda")[0] == "flex"
    assert available_backends("cpu")[-1] == "eager"


def test_set_priority_changes_auto_order(monkeypatch):
    monkeypatch.setitem(dispatch.PRIORITY, "cpu", ("eager",))
    assert available_backends("cpu")[0] == "eager"  # listed first; the unlisted ones follow
    assert select_backend(_request()).name == "eager"
    with pytest.raises(ValueError, match="twice"):
        dispatch.set_priority("cpu", ["eager", "eager"])


def test_a_preference_is_not_a_limit(monkeypatch):
    """blocked's reasons are hard limits only: off CPU it does not refuse because flex could serve
    (forcing backend="blocked" on a GPU used to raise NoBackendError)."""
    monkeypatch.setattr(type(get_backend("flex")), "reasons", lambda self, request: [])
    request = _request(device="meta")
    assert get_backend("blocked").reasons(request) == []


def test_no_backend_error_names_the_request():
    request = _request("rope", key_padding_mask=torch.zeros(1, 5, dtype=torch.bool))
    with pytest.raises(NoBackendError) as err:
        select_backend(request, "relative")
    message = str(err.value)
    for part in ("rope", "[1, 2, 5, 8]", "torch.float32", "cpu", "causal(offset=0)", "key_padding[1, 5]"):
        assert part in message, part


# ----------------------------------------------------------------------------
# ``posenc.use_backend``: a bare call forces a backend until ``"auto"``; a ``with`` block restores.


def _layer():
    return posenc.MultiheadAttention(32, 4, "rope", causal=True)


def test_a_bare_call_forces_the_backend_until_auto():
    layer, x = _layer(), torch.randn(1, 8, 32)
    layer(x)
    assert layer.last_backend == "sdpa"  # what auto picks for a short causal RoPE call
    posenc.use_backend("eager")
    layer(x)
    assert layer.last_backend == "eager"
    layer(x)
    assert layer.last_backend == "eager"  # still forced: it is not a one-call setting
    posenc.use_backend("auto")
    layer(x)
    assert layer.last_backend == "sdpa"


def test_a_with_block_restores_what_was_forced_before_it_even_on_error():
    layer, x = _layer(), torch.randn(1, 8, 32)
    posenc.use_backend("blocked")
    with posenc.use_backend("eager"):
        layer(x)
        assert layer.last_backend == "eager"
        posenc.use_backend("sdpa")  # a bare call inside the block ends with it
        assert requested_backend() == "sdpa"
    assert requested_backend() == "blocked"
    with pytest.raises(RuntimeError, match="inside"), posenc.use_backend("eager"):
        raise RuntimeError("inside")
    assert requested_backend() == "blocked"
    with posenc.use_backend("auto"):
        layer(x)
        assert layer.last_backend == "sdpa"
    assert requested_backend() == "blocked"


def test_the_forced_backend_overrides_a_layers_own_and_belongs_to_its_thread():
    layer = posenc.MultiheadAttention(32, 4, "rope", causal=True, backend="sdpa")
    posenc.use_backend("eager")
    layer(torch.randn(1, 8, 32))
    assert layer.last_backend == "eager"
    seen = []
    thread = threading.Thread(target=lambda: seen.append(requested_backend()))
    thread.start()
    thread.join()
    assert seen == ["auto"]


def test_an_unknown_name_is_refused_naming_it_and_changes_nothing():
    posenc.use_backend("eager")
    with pytest.raises(ValueError, match=r"unknown backend 'egaer'.*eager"):
        posenc.use_backend("egaer")
    with pytest.raises(TypeError, match="name must be a backend name"):
        posenc.use_backend(None)  # type: ignore[arg-type]
    assert requested_backend() == "eager"
