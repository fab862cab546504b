"""posenc's flush-to-zero scope around its CPU kernel calls (:mod:`posenc.backends.parts.denormals`).

A thread's flush setting is read off what it computes: ``1e-39 * 2`` is ``2e-39`` where the thread keeps
denormals and ``0`` where it flushes them (DAZ). With two intra-op threads an elementwise product of a
long tensor splits in two halves, one per thread, so the halves tell the calling thread's setting and
its worker's.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager

import pytest
import torch

from posenc.backends.parts import denormals, flash
from posenc.backends.parts.denormals import MIN_FLUSHED_WORK, flush_scope, flushed_denormals, keep_denormals

TINY = 1e-39  # below float32's smallest normal, 1.18e-38
pytestmark = pytest.mark.skipif(
    "every intra-op thread" not in flush_scope(), reason=f"no flush scope here: {flush_scope()}"
)


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    _reset_every_thread()
    torch.set_num_threads(before)


def _reset_every_thread() -> None:
    """Denormals kept on this thread and its workers (a failing test must not leave them flushed)."""
    torch.set_flush_denormal(False)
    team, _ = denormals._team()
    team.write(team.read(), torch.get_num_threads())


def _flushing() -> tuple[bool, bool]:
    """Whether the calling thread and its worker flush: each half of ``TINY * 2`` is 0 where its thread does."""
    x = torch.full((1 << 22,), TINY, dtype=torch.float32)
    if bool((x == 0).any()):  # filled under FTZ: the calling thread flushes
        return True, _worker_flushes()
    y = x * 2.0
    half = y.numel() // 2
    return bool((y[:half] == 0).all()), bool((y[half:] == 0).all())


_X = torch.full((1 << 22,), TINY, dtype=torch.float32)  # built at import, before any test flushes


def _worker_flushes() -> bool:
    y = _X * 2.0
    return bool((y[y.numel() // 2 :] == 0).all())


def test_the_probe_sees_each_thread_s_own_setting(two_threads):
    """``torch.set_flush_denormal`` reaches the calling thread only: the worker keeps denormals."""
    assert _flushing() == (False, False)
    torch.set_flush_denormal(True)
    assert _flushing() == (True, False)


def test_inside_the_block_every_thread_flushes_and_after_it_none_does(two_threads):
    with flushed_denormals(MIN_FLUSHED_WORK):
        assert _flushing() == (True, True)
    assert _flushing() == (False, False)


def test_a_caller_that_flushes_keeps_its_setting(two_threads):
    torch.set_flush_denormal(True)
    denormals._team()[0].write(denormals._team()[0].read(), 2)  # the caller's whole team flushes
    with flushed_denormals(MIN_FLUSHED_WORK):
        assert _flushing() == (True, True)
    assert _flushing() == (True, True)


def test_nested_blocks_switch_once_and_an_error_restores(two_threads):
    with pytest.raises(RuntimeError, match="inside"), flushed_denormals(MIN_FLUSHED_WORK):
        with flushed_denormals(MIN_FLUSHED_WORK):
            pass
        assert _flushing() == (True, True)  # the inner block's exit left the outer one's setting
        raise RuntimeError("inside")
    assert _flushing() == (False, False)


def test_small_calls_on_other_devices_and_the_off_switch_change_nothing(two_threads):
    with flushed_denormals(MIN_FLUSHED_WORK - 1):
        assert _flushing() == (False, False)
    with flushed_denormals(MIN_FLUSHED_WORK, "meta"):
        assert _flushing() == (False, False)
    with keep_denormals(), flushed_denormals(MIN_FLUSHED_WORK):
        assert _flushing() == (False, False)


def test_python_threads_each_keep_their_own_setting(two_threads):
    """Each Python thread has its own register and its own OpenMP team: blocks on two threads at
    once flush and restore their own, and the main thread is untouched throughout."""
    seen, errors, start = [], [], threading.Barrier(3)

    def worker():
        try:
            torch.set_num_threads(2)
            start.wait()
            for _ in range(20):
                with flushed_denormals(MIN_FLUSHED_WORK):
                    seen.append(_flushing())
            seen.append(("after", *_flushing()))
        except Exception as err:  # reported below
            errors.append(err)

    threads = [threading.Thread(target=worker) for _ in range(2)]
    for t in threads:
        t.start()
    start.wait()
    main = [_flushing() for _ in range(5)]
    for t in threads:
        t.join()
    assert errors == []
    assert [s for s in seen if s[0] != "after"] == [(True, True)] * 40
    assert [s for s in seen if s[0] == "after"] == [("after", False, False)] * 2
    assert main == [(False, False)] * 5


@contextmanager
def _recording(entered):
    real = denormals.flushed_denormals

    @contextmanager
    def record(work, device="cpu"):
        entered.append(work)
        with real(work, device):
            yield

    flash.flushed_denormals = record
    try:
        yield
    finally:
        flash.flushed_denormals = real


@pytest.mark.skipif(not flash.cpu_flash_available(), reason="no CPU flash kernel in this torch")
def test_the_flash_kernel_s_forward_and_backward_run_flushed_and_stay_exact():
    """An ALiBi-like key term hundreds below the row maximum: flushed and kept, the outputs and
    gradients agree to float32 rounding, and both kernel calls entered the block with their size."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 1024, 32, requires_grad=True) for _ in range(3))
    far = -0.5 * torch.arange(1024, dtype=torch.float32).flip(0)  # keys far back: down to -511
    mask = far.view(1, 1, 1, -1).expand(1, 2, 1024, 1024)

    def run():
        out, lse = flash.flash_forward(q, k, v, 0.0, True, attn_mask=mask, scale=32**-0.5)
        grad = torch.linspace(-1, 1, out.numel()).view_as(out)
        grads = flash.flash_backward(grad, q, k, v, out, lse, 0.0, True, attn_mask=mask, scale=32**-0.5)
        return out, grads

    entered: list[int] = []
    with _recording(entered):
        out, grads = run()
    assert entered == [2 * 1024 * 1024] * 2
    with keep_denormals():
        want, want_grads = run()
    torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-7)
    for g, w in zip(grads, want_grads):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
