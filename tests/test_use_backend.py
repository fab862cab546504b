"""``posenc.use_backend``: a bare call forces a backend until ``"auto"``; a ``with`` block restores.

The README's Backends section shows both forms; ``torch.set_grad_enabled`` is the model (it acts
when called and restores the previous mode when used as a context manager).
"""

from __future__ import annotations

import threading

import pytest
import torch

import posenc
from posenc.backends import requested_backend


@pytest.fixture(autouse=True)
def _nothing_forced_after():
    yield
    posenc.use_backend("auto")


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
