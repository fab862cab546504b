"""Half-pair RoPE (channel ``k`` with ``k + d_r/2``) on CPU as one compiled loop, bit for bit the eager passes.

Why: in eager PyTorch the half pairing (HF Llama's ``rotate_half`` layout) takes five elementwise
passes over half-width rows (``mul``, ``addcmul`` for each half, and a copy of one half when in
place): about a third of the speed of copying q and k on the attention layer's path, where the
interleaved pairing runs as one complex multiply. A C loop reads each pair once and writes it once.

Exactness: :func:`posenc.kernels.rope.apply_rotary` computes, per element,
``o1 = addcmul(x1·cos, x2, sin, value=-1)`` and ``o2 = addcmul(x2·cos, x1, sin)``: the product with
``cos`` rounded to ``x``'s dtype, then ``addcmul``, which PyTorch's CPU kernels evaluate as one
fused multiply-add where their build contracts ``self + value·t1·t2`` (float32/64; in float32, then
rounded once, for bfloat16). The loop writes the same operations (``-ffp-contract=off`` with an
explicit ``fma``, or the unfused form), and the first call compares both forms with the eager
passes on probe rows (row lengths that take PyTorch's vector and scalar loops, each dtype): the
compiled loop is used only in the form that matched bit for bit, and not at all when neither did.

When it runs: a CPU tensor of float32, float64 or bfloat16 whose channels are adjacent in memory
(any other strides: the layer's ``[B, H, T, D]`` views of its projections included), outside
autograd (the fused kernel's autograd function calls it forward and backward) and outside
``torch.compile``. It is compiled on first use with the C compiler (``$CC``, else ``cc``, ``gcc``
or ``clang``; about a second) into ``$POSENC_KERNELS``, else ``~/.cache/posenc/kernels``, once per
source, compiler and CPU capability, and loaded from there afterwards. It uses
``torch.get_num_threads()`` threads (OpenMP) on large tensors.

When the eager passes run instead (the same bits, slower): float16, a last dimension with a stride
other than 1, no C compiler, a failed build or probe (:func:`status` says which), or
``POSENC_NATIVE_ROPE=0`` in the environment.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import Tensor

from . import half_pairs

__all__ = ["DISABLE_ENV", "KERNELS_ENV", "eager_only", "kernel_dir", "rotate_half", "status"]

#: ``POSENC_NATIVE_ROPE=0`` keeps the eager passes (read at the first half-pair rotation).
DISABLE_ENV = "POSENC_NATIVE_ROPE"
#: The folder the compiled loop is kept in (default ``~/.cache/posenc/kernels``).
KERNELS_ENV = "POSENC_KERNELS"

# One loop per dtype. fused=1: o1 = fma(-x2, s, round(x1*c)); fused=0, the unfused
# one (round(x1*c) + round(-x2*s)). ROUND rounds a product to the storage dtype, as eager's mul does.
_SOURCE = r"""
#include <stdint.h>
#include <string.h>
#include <math.h>

static inline float bf16_load(uint16_t u) {
    uint32_t w = (uint32_t)u << 16; float f; memcpy(&f, &w, 4); return f;
}
static inline uint16_t bf16_store(float f) { /* round to nearest even, as c10::BFloat16 */
    uint32_t w; memcpy(&w, &f, 4);
    uint16_t r = (uint16_t)((w + (((w >> 16) & 1u) + 0x7FFFu)) >> 16);
    return f != f ? (uint16_t)0x7FC0 : r;
}
#define SAME(v) (v)
#define BF16_ROUND(v) bf16_load(bf16_store(v))

/* Row r of the B*H*L rows, in memory order (heads inside positions in the layer's projection views). */
static inline void locate(int64_t r, int64_t H, int64_t L, int64_t heads_inner, int64_t* b, int64_t* h,
                          int64_t* t) {
    const int64_t rest = r % (H * L);
    *b = r / (H * L);
    *h = heads_inner ? rest % H : rest / L;
    *t = heads_inner ? rest / H : rest % L;
}

#define ROTATE_HALF(NAME, T, F, LOAD, STORE, ROUND, FMA_FN)                                          \
static inline void NAME##_row(const T* x, T* o, const T* c, const T* s, int64_t half, int fused) {   \
    if (fused) {                                                                                     \
        _Pragma("omp simd")                                                                          \
        for (int64_t k = 0; k < half; k++) {                                                         \
            const F x1 = LOAD(x[k]), x2 = LOAD(x[k + half]), ck = LOAD(c[k]), sk = LOAD(s[k]);       \
            const F a = ROUND(x1 * ck), e = ROUND(x2 * ck);                                          \
            o[k] = STORE(FMA_FN(-x2, sk, a));                                                        \
            o[k + half] = STORE(FMA_FN(x1, sk, e));                                                  \
        }                                                                                            \
    } else {                                                                                         \
        _Pragma("omp simd")                                                                          \
        for (int64_t k = 0; k < half; k++) {                                                         \
            const F x1 = LOAD(x[k]), x2 = LOAD(x[k + half]), ck = LOAD(c[k]), sk = LOAD(s[k]);       \
            const F a = ROUND(x1 * ck), e = ROUND(x2 * ck), p = -x2 * sk, q = x1 * sk;               \
            o[k] = STORE(a + p);                                                                     \
            o[k + half] = STORE(e + q);                                                              \
        }                                                                                            \
    }                                                                                                \
}                                                                                                    \
void NAME(const T* src, T* dst, const T* cs, const T* sn, int64_t B, int64_t H, int64_t L,           \
          int64_t half, int64_t sb, int64_t sh, int64_t st, int64_t db, int64_t dh, int64_t dt,      \
          int64_t cb, int64_t ct, int fused, int threads) {                                          \
    const int64_t rows = B * H * L, heads_inner = sh < st;                                           \
    if (threads > 1 && rows * half > 32768) {                                                        \
        _Pragma("omp parallel for schedule(static) num_threads(threads)")                            \
        for (int64_t r = 0; r < rows; r++) {                                                         \
            int64_t b, h, t;                                                                         \
            locate(r, H, L, heads_inner, &b, &h, &t);                                                \
            NAME##_row(src + b * sb + h * sh + t * st, dst + b * db + h * dh + t * dt,               \
                       cs + b * cb + t * ct, sn + b * cb + t * ct, half, fused);                     \
        }                                                                                            \
    } else { /* no parallel region: its start costs more than a decoding step's rows */              \
        for (int64_t r = 0; r < rows; r++) {                                                         \
            int64_t b, h, t;                                                                         \
            locate(r, H, L, heads_inner, &b, &h, &t);                                                \
            NAME##_row(src + b * sb + h * sh + t * st, dst + b * db + h * dh + t * dt,               \
                       cs + b * cb + t * ct, sn + b * cb + t * ct, half, fused);                     \
        }                                                                                            \
    }                                                                                                \
}

ROTATE_HALF(posenc_rope_half_f32, float, float, SAME, SAME, SAME, fmaf)
ROTATE_HALF(posenc_rope_half_f64, double, double, SAME, SAME, SAME, fma)
ROTATE_HALF(posenc_rope_half_bf16, uint16_t, float, bf16_load, bf16_store, BF16_ROUND, fmaf)
"""

_FUNCTIONS = {
    torch.float32: "posenc_rope_half_f32",
    torch.float64: "posenc_rope_half_f64",
    torch.bfloat16: "posenc_rope_half_bf16",
}

# Instruction sets per PyTorch CPU capability: the loop gets the ones PyTorch's own kernels use
# (so FMA is there exactly when theirs can contract), and never -march=native, which could not
# run on another machine sharing the same cache folder.
_ARCH_FLAGS = {
    "AVX512": ["-mavx2", "-mfma", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"],
    "AVX2": ["-mavx2", "-mfma"],
}


class _State:
    """The loaded loop and its form, or why there is none; built once per process."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.loaded = False
        self.library: ctypes.CDLL | None = None
        self.fused = 0
        self.reason = "not loaded yet (loads at the first half-pair rotation)"
        self.path: Path | None = None
        self.disabled_here = 0  # eager_only() depth


_STATE = _State()


def kernel_dir() -> Path:
    """Where the compiled loop is kept: ``$POSENC_KERNELS``, else ``~/.cache/posenc/kernels``."""
    configured = os.environ.get(KERNELS_ENV)
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "posenc" / "kernels"


def status() -> str:
    """Whether half pairs rotate through the compiled loop, and if not, why (loads it if needed)."""
    _load()
    if _STATE.library is None:
        return f"eager passes: {_STATE.reason}"
    form = "fused multiply-add" if _STATE.fused else "unfused multiply-add"
    return f"compiled loop ({form}, as the eager passes): {_STATE.path}"


@contextlib.contextmanager
def eager_only() -> Iterator[None]:
    """Rotate half pairs with the eager passes inside the block, in every thread of the process
    (benchmarks and tests compare the two)."""
    _STATE.disabled_here += 1
    try:
        yield
    finally:
        _STATE.disabled_here -= 1


def rotate_half(x: Tensor, target: Tensor, cos: Tensor, sin: Tensor) -> bool:
    """Rotate the half pairs of ``x [B, H, T, D]`` into ``target`` (``x`` itself for in place).

    ``cos``/``sin`` are ``[B|1, T, d_r/2]`` in ``x``'s dtype; channels past ``d_r`` are not touched.
    Returns False, having done nothing, where the compiled loop does not serve (module docstring);
    the caller then runs the eager passes.
    """
    if not _serves(x, target, cos, sin) or _STATE.disabled_here or torch.compiler.is_compiling():
        return False
    if not _load() or _STATE.library is None:
        return False
    _call(_STATE.library, _STATE.fused, x, target, cos, sin)
    # a write autograd did not see: count it, as an in-place op would (a tensor saved for backward
    # and then rotated makes backward raise instead of using the rotated values)
    torch.autograd.graph.increment_version(target)
    return True


def _serves(x: Tensor, target: Tensor, cos: Tensor, sin: Tensor) -> bool:
    # plain tensors only: subclasses (fake tensors, parameters) may have no memory of their own
    if (
        type(x) is not Tensor
        or type(target) is not Tensor
        or type(cos) is not Tensor
        or type(sin) is not Tensor
    ):
        return False
    dtype = x.dtype
    if dtype not in _FUNCTIONS or target.dtype != dtype or cos.dtype != dtype or sin.dtype != dtype:
        return False
    if x.device.type != "cpu" or x.stride(-1) != 1 or target.stride(-1) != 1 or x.numel() == 0:
        return False
    try:  # inside torch.vmap, tensors have no pointer to pass
        return bool(x.data_ptr() and target.data_ptr() and cos.data_ptr() and sin.data_ptr())
    except RuntimeError:
        return False


def _call(library: ctypes.CDLL, fused: int, x: Tensor, target: Tensor, cos: Tensor, sin: Tensor) -> None:
    batch, heads, length, _ = x.shape
    cos, sin = cos.contiguous(), sin.contiguous()  # one set of strides for both tables
    if cos.shape != sin.shape:
        raise ValueError(f"cos and sin must have one shape, got {tuple(cos.shape)} and {tuple(sin.shape)}")
    x_b, x_h, x_t, _ = x.stride()
    o_b, o_h, o_t, _ = target.stride()
    table_batch = cos.stride(0) if cos.shape[0] > 1 else 0  # one table row per batch row, or shared
    getattr(library, _FUNCTIONS[x.dtype])(
        x.data_ptr(), target.data_ptr(), cos.data_ptr(), sin.data_ptr(), batch, heads, length,
        cos.shape[-1], x_b, x_h, x_t, o_b, o_h, o_t, table_batch, cos.stride(1), fused, torch.get_num_threads(),
    )  # fmt: skip


def _load() -> bool:
    """Build (or find), load and probe the loop once per process; False while that could not be tried."""
    if _STATE.loaded:
        return True
    with _STATE.lock:
        if not _STATE.loaded:
            try:
                _STATE.library, _STATE.fused, _STATE.reason = _build_and_probe()
            except Exception as error:  # a context the probe cannot run in (a mode, a transform)
                _STATE.reason = f"not loaded yet: its probe could not run here ({error}); it tries again"
                return False
            _STATE.loaded = True
    return True


def _build_and_probe() -> tuple[ctypes.CDLL | None, int, str]:
    if os.environ.get(DISABLE_ENV, "1").strip().lower() in ("0", "false", "no", "off"):
        return None, 0, f"{DISABLE_ENV}={os.environ[DISABLE_ENV]} in the environment"
    compiler = _compiler()
    if compiler is None:
        return None, 0, "no C compiler found ($CC, cc, gcc or clang)"
    try:
        path = _compiled(compiler)
        library = ctypes.CDLL(str(path))
        for name in _FUNCTIONS.values():  # typed once: calls then pass plain ints
            getattr(library, name).argtypes = (
                [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 12 + [ctypes.c_int] * 2
            )
            getattr(library, name).restype = None
    except (OSError, subprocess.SubprocessError) as error:
        return None, 0, f"building the loop failed: {error}"
    _STATE.path = path
    for fused in (1, 0):
        if _matches_eager(library, fused):
            return library, fused, ""
    return None, 0, "the compiled loop differs from the eager passes on the probe rows, in both forms"


def _compiler() -> str | None:
    configured = os.environ.get("CC")
    if configured:
        return shutil.which(configured)
    return shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


def _compiled(compiler: str) -> Path:
    """The shared library for this source, compiler and CPU capability, compiled if not kept yet."""
    arch = _ARCH_FLAGS.get(torch.backends.cpu.get_cpu_capability(), [])
    if platform.machine().lower() not in ("x86_64", "amd64"):
        arch = []
    flags = ["-O3", "-shared", "-fPIC", "-ffp-contract=off", *arch]
    key = "\0".join([_SOURCE, os.path.realpath(compiler), *flags, platform.machine()])
    folder = kernel_dir()
    path = folder / f"rope_half_{hashlib.sha256(key.encode()).hexdigest()[:16]}.so"
    if path.exists():
        return path
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder) as work:
        source = Path(work) / "rope_half.c"
        source.write_text(_SOURCE)
        built = Path(work) / path.name
        # OpenMP for threads; without it (no libgomp), one thread and still vector loops
        for parallel in ("-fopenmp", "-fopenmp-simd"):
            command = [compiler, *flags, parallel, str(source), "-o", str(built), "-lm"]
            done = subprocess.run(command, capture_output=True, text=True, timeout=300)
            if done.returncode == 0:
                break
        else:
            raise OSError(f"{' '.join(command)} exited with {done.returncode}: {done.stderr.strip()[-500:]}")
        os.replace(built, path)  # atomic: another process compiling the same key is harmless
    return path


def _matches_eager(library: ctypes.CDLL, fused: int) -> bool:
    """The loop in this form equals the eager passes bit for bit on probe rows of every dtype."""
    for dtype in _FUNCTIONS:
        for half in (1, 5, 37, 64):  # PyTorch's scalar loop, its tail, its vector loop
            count = 2 * 7 * 3 * 2 * half
            x = _probe_values(count, 0, 2) * 10.0 ** _probe_values(count, 1, 7)  # over seven decades
            x = x.to(dtype).reshape(2, 7, 3, 2 * half).transpose(1, 2)  # the layer's projection views
            cos, sin = (_probe_values(7 * half, seed, 2).to(dtype).reshape(1, 7, half) for seed in (2, 3))
            want = torch.empty_like(x)
            half_pairs.rotate_half_pairs(x, want, cos[0], sin[0], half, inplace=False)
            got = x.clone()
            _call(library, fused, got, got, cos, sin)
            if not torch.equal(got, want):
                return False
    return True


def _probe_values(count: int, seed: int, spread: int) -> Tensor:
    """``count`` float64 values spread over ``(-spread/2, spread/2)``, from a hash of their index, not
    from torch's random generators (global state, and refused inside ``torch.vmap``)."""
    index = torch.arange(count, dtype=torch.float64, device="cpu")
    fraction = torch.frac(torch.sin(index * 12.9898 + seed * 78.233) * 43758.5453).abs()
    return (fraction * 2 - 1) * (spread / 2)
