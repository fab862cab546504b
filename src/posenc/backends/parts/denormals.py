"""Flush-to-zero around posenc's CPU kernel calls: no denormal slow path, the caller's setting kept.

A bias that grows with distance (ALiBi, Kerple, FIRE, Sandwich, FoX, a large T5 bias, masks written as
large finite negatives) sends far logits hundreds below the row maximum. Their ``exp(s - lse)``, the
products that use it in the backward, and the intermediate steps of a vectorised ``exp`` whose result
underflows, fall below float32's smallest normal (``1.2e-38``), and an x86 CPU pays a microcode assist for
every denormal operand or result unless the thread's MXCSR register says to flush them (FTZ: results to
zero; DAZ: inputs as zero). On an Intel Xeon the ALiBi split's backward ran 3.8x slower for it (AMD
CPUs pay less). ``torch.set_flush_denormal`` sets the register of the calling thread only, and the
intra-op (OpenMP) worker threads keep theirs.

:func:`flushed_denormals` sets FTZ and DAZ on the calling thread and on every intra-op worker for the
duration of a block, and puts each back as the calling thread had it: on x86-64 Linux with glibc it
hands ``fesetenv`` (C, no Python, no GIL) to libgomp's ``GOMP_parallel``, which runs it once on each
thread of the calling thread's team; with one intra-op thread it calls ``fesetenv`` directly. Nested
blocks, and a caller whose thread already flushes, change nothing. Elsewhere (another OS or CPU, or a
torch built without libgomp) :func:`flush_scope` says why and the block runs as it is.

**Exactness.** A flushed value is below ``1.2e-38``: in a softmax whose largest term is 1, or a
gradient that sums such terms with others, it is below float32's rounding of the result, so outputs
and gradients stay within float32 rounding of the unflushed ones (the backends' float32 and float64
tests pass unchanged; float64 values do not get near float64's ``2.2e-308``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import platform
import sys
import threading
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from functools import lru_cache

import torch

__all__ = ["MIN_FLUSHED_WORK", "flush_scope", "flushed_denormals", "keep_denormals"]

#: Logits (rows x keys x heads x batch) below which a call is not worth the two thread-team
#: round trips (tens of microseconds against the call's milliseconds).
MIN_FLUSHED_WORK = 1 << 20

# glibc's x86-64 fenv_t: 32 bytes, the MXCSR register in its last four.
_FENV_SIZE, _MXCSR_OFFSET = 32, 28
_FTZ, _DAZ = 1 << 15, 1 << 6

_state = threading.local()  # depth of nested blocks on this thread; the benchmark's off switch


class _Team:
    """libm's ``fegetenv``/``fesetenv`` and libgomp's ``GOMP_parallel``, bound once."""

    def __init__(self, libm: ctypes.CDLL, gomp: ctypes.CDLL | None) -> None:
        task = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
        self.fegetenv, self.fesetenv = libm.fegetenv, libm.fesetenv
        self.fegetenv.argtypes = self.fesetenv.argtypes = [ctypes.c_void_p]
        self.task = ctypes.cast(libm.fesetenv, task)  # void fn(void *): its int result is ignored
        self.parallel = None
        if gomp is not None:
            self.parallel = gomp.GOMP_parallel
            self.parallel.argtypes = [task, ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint]
            self.parallel.restype = None

    def read(self) -> ctypes.Array:
        env = (ctypes.c_char * _FENV_SIZE)()
        self.fegetenv(env)
        return env

    def write(self, env: ctypes.Array, threads: int) -> None:
        """``env`` on the calling thread and, with more than one thread, on its whole team."""
        if threads > 1 and self.parallel is not None:
            self.parallel(self.task, ctypes.addressof(env), threads, 0)
        else:
            self.fesetenv(env)


def _mxcsr(env: ctypes.Array) -> int:
    return int.from_bytes(bytes(env)[_MXCSR_OFFSET:_FENV_SIZE], "little")


def _with_mxcsr(env: ctypes.Array, value: int) -> ctypes.Array:
    raw = bytearray(bytes(env))
    raw[_MXCSR_OFFSET:_FENV_SIZE] = value.to_bytes(4, "little")
    return (ctypes.c_char * _FENV_SIZE).from_buffer_copy(bytes(raw))


def _loaded_gomp() -> str | None:
    """The path of the libgomp this process has loaded (torch's), or None."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libgomp" in line and "/" in line}
    except OSError:
        return None
    return min(paths) if paths else None


@lru_cache(maxsize=1)
def _team() -> tuple[_Team | None, str]:
    """The bound functions and the scope in words (why there is none, where there is none)."""
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        return (
            None,
            f"none: flush-to-zero is set through x86-64 Linux's MXCSR, not on {sys.platform} {platform.machine()}",
        )
    if platform.libc_ver()[0] != "glibc":
        return None, "none: the environment layout read here is glibc's, and this C library is not glibc"
    torch.get_num_threads()  # torch (and its OpenMP runtime) loaded
    libm = ctypes.CDLL(ctypes.util.find_library("m") or "libm.so.6")
    path = _loaded_gomp()
    if path is None:
        return _Team(libm, None), "the calling thread only: this torch's intra-op threads are not libgomp's"
    return _Team(libm, ctypes.CDLL(path)), "the calling thread and every intra-op thread (libgomp)"


def flush_scope() -> str:
    """Which threads :func:`flushed_denormals` covers on this machine, in words (for benchmark headers)."""
    return _team()[1]


@contextmanager
def keep_denormals() -> Iterator[None]:
    """Run the block with posenc's flushing off on this thread (the benchmark's baseline)."""
    before = getattr(_state, "off", False)
    _state.off = True
    try:
        yield
    finally:
        _state.off = before


def flushed_denormals(
    work: int = MIN_FLUSHED_WORK, device: torch.device | str = "cpu"
) -> AbstractContextManager[None]:
    """Flush denormals to zero on the calling thread and its intra-op workers for the block.

    Args:
        work: the call's size in logits; below :data:`MIN_FLUSHED_WORK` nothing is changed.
        device: the tensors' device; only ``cpu`` is touched.

    Every thread is put back to the calling thread's environment as it was on entry (a caller that
    already flushes sees no change at all). Blocks nest: only the outermost one switches. Under
    ``torch.compile`` nothing is changed (a ``nullcontext``, which traces): the flush is eager-mode.
    """
    if torch.compiler.is_compiling() or work < MIN_FLUSHED_WORK or torch.device(device).type != "cpu":
        return nullcontext()
    return _flushed()


@contextmanager
def _flushed() -> Iterator[None]:
    team, _ = _team()
    if team is None or getattr(_state, "depth", 0) or getattr(_state, "off", False):
        yield
        return
    saved = team.read()
    if _mxcsr(saved) & (_FTZ | _DAZ) == _FTZ | _DAZ:
        yield
        return
    threads = torch.get_num_threads()
    team.write(_with_mxcsr(saved, _mxcsr(saved) | _FTZ | _DAZ), threads)
    _state.depth = 1
    try:
        yield
    finally:
        _state.depth = 0
        team.write(saved, threads)
