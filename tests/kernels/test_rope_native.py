"""The compiled half-pair RoPE loop (posenc.kernels.rope_native) against PyTorch's own operations.

Expected values are the eager operations written out here (``addcmul(x1·cos, x2, sin, value=-1)``
and ``addcmul(x2·cos, x1, sin)``, each in the tensor's dtype), compared bit for bit: the loop exists
to be faster without changing a single bit of what the eager passes computed.
"""

from __future__ import annotations

import shutil

import pytest
import torch

from posenc.kernels import half_pairs, rope_native
from posenc.kernels.rope import apply_rotary, rotary, rotary_cos_sin

BITS = {torch.float32: torch.int32, torch.float64: torch.int64, torch.bfloat16: torch.int16}

HAS_COMPILER = rope_native._compiler() is not None


def eager_half(x, cos, sin):
    """HF's rotate_half rotation as the eager ops posenc ran before the loop: product, then addcmul."""
    half = cos.shape[-1]
    cos, sin = cos.to(x.dtype)[:, None], sin.to(x.dtype)[:, None]
    x1, x2 = x[..., :half], x[..., half : 2 * half]
    first = torch.addcmul(x1 * cos, x2, sin, value=-1.0)
    second = torch.addcmul(x2 * cos, x1, sin)
    return torch.cat((first, second, x[..., 2 * half :]), dim=-1)


def assert_same_bits(got, want):
    assert got.shape == want.shape and got.dtype == want.dtype
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan), "NaN in other places"
    bits = BITS[want.dtype]
    assert torch.equal(got[~nan].view(bits), want[~nan].view(bits)), (
        f"{int((got[~nan].view(bits) != want[~nan].view(bits)).sum())} elements differ in their bits"
    )


@pytest.fixture
def calls(monkeypatch, request):
    """The compiled loop's runs (after its load and probe, unless the test loads it afresh)."""
    if "fresh" not in request.fixturenames:
        rope_native._load()
    count = []
    real = rope_native._call

    def counting(*args):
        count.append(1)
        return real(*args)

    monkeypatch.setattr(rope_native, "_call", counting)
    return count


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """A process that has not loaded the loop yet, keeping it in a folder of its own."""
    monkeypatch.setattr(rope_native, "_STATE", rope_native._State())
    monkeypatch.setenv(rope_native.KERNELS_ENV, str(tmp_path / "kernels"))
    monkeypatch.delenv(rope_native.DISABLE_ENV, raising=False)
    return tmp_path / "kernels"


def make_x(dtype, layout, batch, heads, length, dim, generator):
    base = torch.randn(batch, length, heads * dim + 1, generator=generator, dtype=torch.float64)
    base = (base * 10.0 ** torch.randint(-4, 5, base.shape, generator=generator)).to(dtype)
    if layout == "odd_offset":  # the pairs start at an odd element
        return base[..., 1:].unflatten(-1, (heads, dim)).transpose(1, 2)
    x = base[..., :-1].unflatten(-1, (heads, dim)).transpose(1, 2)  # the layer's projection views
    return x.contiguous() if layout == "contiguous" else x


@pytest.mark.skipif(not HAS_COMPILER, reason="no C compiler: the eager passes run")
def test_the_loop_is_built_and_used_where_a_compiler_exists(calls):
    assert rope_native.status().startswith("compiled loop"), rope_native.status()
    cos, sin = rotary_cos_sin(torch.arange(5)[None], torch.rand(4))
    apply_rotary(torch.randn(1, 2, 5, 8), cos, sin, pairing="half", inplace=True)
    assert calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("layout", ["contiguous", "projection_view", "odd_offset"])
@pytest.mark.parametrize("mode", ["inplace", "out_of_place", "out"])
def test_half_pairs_keep_every_bit_of_the_eager_operations(dtype, layout, mode, calls):
    """Row lengths that take PyTorch's scalar loop, a vector loop with a tail and whole vectors;
    shared and per-batch tables, full and partial width, values over nine decades."""
    generator = torch.Generator().manual_seed(0)
    for half, dim, per_batch in [
        (1, 2, False),
        (3, 8, True),
        (37, 74, False),
        (64, 128, True),
        (24, 64, False),
    ]:
        batch, heads, length = 2, 3, 17
        x = make_x(dtype, layout, batch, heads, length, dim, generator)
        positions = torch.randint(0, 40000, (batch if per_batch else 1, length), generator=generator)
        inv_freq = 10000.0 ** -torch.linspace(0, 1, half)
        cos, sin = rotary_cos_sin(positions, inv_freq)
        want = eager_half(x, cos, sin)
        source = x.clone()
        if mode == "inplace":
            got = apply_rotary(source, cos, sin, pairing="half", inplace=True)
            assert got.data_ptr() == source.data_ptr()
        elif mode == "out":
            got = apply_rotary(source, cos, sin, pairing="half", out=torch.full_like(x, 7.0))
        else:
            got = apply_rotary(source, cos, sin, pairing="half")
            assert_same_bits(source, x)  # the input is left alone
        assert_same_bits(got, want)
    assert calls or not HAS_COMPILER


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_signed_zeros_infinities_nans_and_subnormals_keep_their_bits(dtype, calls):
    info = torch.finfo(dtype)
    special = torch.tensor(
        [
            0.0,
            -0.0,
            float("inf"),
            -float("inf"),
            float("nan"),
            info.tiny / 4,
            -info.tiny / 3,
            info.max,
            1.0,
            -1.0,
        ],
        dtype=dtype,
    )
    x = special[torch.randint(0, len(special), (2, 3, 9, 20), generator=torch.Generator().manual_seed(1))]
    cos, sin = rotary_cos_sin(torch.tensor([[0, 1, 2, 3, 100, 1000, 7, 8, 50000]]), torch.rand(10) + 0.1)
    cos[0, 0], sin[0, 1] = -0.0, 0.0  # signed zeros in the tables too
    assert_same_bits(apply_rotary(x.clone(), cos, sin, pairing="half", inplace=True), eager_half(x, cos, sin))
    assert calls or not HAS_COMPILER


@pytest.mark.parametrize("threads", [1, 2])
def test_a_large_tensor_on_several_threads_keeps_its_bits(threads, calls):
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        x = make_x(torch.float32, "projection_view", 2, 8, 300, 64, torch.Generator().manual_seed(2))
        cos, sin = rotary_cos_sin(torch.arange(300)[None], 10000.0 ** -torch.linspace(0, 1, 32))
        assert_same_bits(
            apply_rotary(x.clone(), cos, sin, pairing="half", inplace=True), eager_half(x, cos, sin)
        )
    finally:
        torch.set_num_threads(previous)
    assert calls or not HAS_COMPILER


def test_outputs_and_gradients_under_autograd_equal_the_eager_passes_bit_for_bit(calls):
    """The fused kernel's autograd function runs the loop forward and backward (by -angle)."""
    cos, sin = rotary_cos_sin(torch.arange(11)[None], torch.rand(6) + 0.01)
    base = torch.randn(2, 3, 11, 12, requires_grad=True)
    weight = torch.randn(2, 3, 11, 12)
    results = []
    for eager in (False, True):
        with rope_native.eager_only() if eager else torch.enable_grad():
            out = rotary(base * 1.0, cos, sin, pairing="half", inplace=True)
            (grad,) = torch.autograd.grad((out * weight).sum(), base)
        results.append((out.detach(), grad))
    assert_same_bits(results[0][0], results[1][0])
    assert_same_bits(results[0][1], results[1][1])
    assert len(calls) == (2 if HAS_COMPILER else 0)  # forward and backward of the first round only


def test_a_tensor_saved_for_backward_and_then_rotated_makes_backward_raise():
    """The loop writes through a pointer; it counts the write as an in-place op would, so autograd
    refuses to use the overwritten values (as it does after the eager passes)."""
    weight = torch.randn(1, 2, 5, 8, requires_grad=True)
    x = torch.randn(1, 2, 5, 8)
    loss = (weight * x).sum()  # saves x for weight's gradient
    cos, sin = rotary_cos_sin(torch.arange(5)[None], torch.rand(4))
    apply_rotary(x, cos, sin, pairing="half", inplace=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_eager_only_and_the_environment_switch_keep_the_eager_passes(fresh, monkeypatch, calls):
    x = torch.randn(1, 2, 5, 8)
    cos, sin = rotary_cos_sin(torch.arange(5)[None], torch.rand(4))
    with rope_native.eager_only():
        assert_same_bits(apply_rotary(x.clone(), cos, sin, pairing="half"), eager_half(x, cos, sin))
    assert not calls
    monkeypatch.setenv(rope_native.DISABLE_ENV, "0")
    assert_same_bits(apply_rotary(x.clone(), cos, sin, pairing="half"), eager_half(x, cos, sin))
    assert not calls
    assert rope_native.status() == f"eager passes: {rope_native.DISABLE_ENV}=0 in the environment"


@pytest.mark.parametrize("compiler", ["no-such-compiler-posenc", "false"])
def test_no_compiler_or_a_failed_build_falls_back_to_the_eager_passes(fresh, monkeypatch, compiler, calls):
    if compiler == "false" and shutil.which("false") is None:
        pytest.skip("no `false` command")
    monkeypatch.setenv("CC", compiler)
    x = torch.randn(1, 2, 5, 8)
    cos, sin = rotary_cos_sin(torch.arange(5)[None], torch.rand(4))
    assert_same_bits(apply_rotary(x.clone(), cos, sin, pairing="half"), eager_half(x, cos, sin))
    assert not calls
    want = "no C compiler found" if compiler != "false" else "building the loop failed"
    assert want in rope_native.status()


@pytest.mark.skipif(not HAS_COMPILER, reason="no C compiler")
def test_the_loop_is_compiled_once_and_loaded_from_its_folder_afterwards(fresh, monkeypatch):
    assert rope_native.status().startswith("compiled loop")
    (kept,) = fresh.glob("rope_half_*.so")
    monkeypatch.setattr(rope_native, "_STATE", rope_native._State())  # a new process, as it were

    def no_compiling(*args, **kwargs):
        raise AssertionError("compiled again")

    monkeypatch.setattr(rope_native.subprocess, "run", no_compiling)
    assert rope_native.status().endswith(str(kept))


@pytest.mark.skipif(not HAS_COMPILER, reason="no C compiler")
def test_a_loop_that_differs_from_the_eager_passes_is_not_used(fresh, monkeypatch, calls):
    """The probe at load compares the loop with the eager passes; here they are made to round
    differently (one ulp on the first half), so neither form of the loop matches."""
    real = half_pairs.rotate_half_pairs

    def off_by_one_ulp(src, dst, cos, sin, half, inplace):
        real(src, dst, cos, sin, half, inplace)
        first = dst[..., :half]
        first.copy_(torch.nextafter(first, torch.full_like(first, float("inf"))))

    monkeypatch.setattr(half_pairs, "rotate_half_pairs", off_by_one_ulp)
    assert "differs from the eager passes" in rope_native.status()
    calls.clear()  # the probe's runs
    apply_rotary(
        torch.randn(1, 2, 5, 8), *rotary_cos_sin(torch.arange(5)[None], torch.rand(4)), pairing="half"
    )
    assert not calls


def test_a_first_load_under_a_device_context_still_probes_on_the_cpu(fresh, calls):
    """A first rotation under a default-device context still gives the eager bits, and the loop loads."""
    x = torch.randn(1, 2, 5, 8)
    cos, sin = rotary_cos_sin(torch.arange(5)[None], torch.rand(4))
    with torch.device("meta"):
        got = apply_rotary(x.clone(), cos, sin, pairing="half")
    assert_same_bits(got, eager_half(x, cos, sin))
    assert rope_native.status().startswith("compiled loop" if HAS_COMPILER else "eager passes")


def test_fake_and_batched_tensors_take_the_eager_passes(calls):
    """Tensors without memory of their own (FakeTensorMode's, torch.vmap's) are never handed to the
    loop, which would write through their pointers."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.randn(1, 2, 5, 8)
        cos, sin = rotary_cos_sin(torch.arange(5)[None], torch.rand(4))
        assert apply_rotary(x, cos, sin, pairing="half", inplace=True).shape == (1, 2, 5, 8)
    cos, sin = rotary_cos_sin(torch.arange(5)[None], torch.rand(4))
    batched = torch.randn(3, 1, 2, 5, 8)
    with pytest.raises(RuntimeError, match="Batching rule"):  # the eager passes' own limit under vmap
        torch.vmap(lambda t: apply_rotary(t, cos, sin, pairing="half"))(batched)
    assert not calls
