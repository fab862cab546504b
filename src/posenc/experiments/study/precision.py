"""The precision a study runs in (``--dtype``) and the machine it ran on.

``float32`` is the default, for exactness; ``bfloat16`` runs the model's weights and activations in
bfloat16 (the NLL is still taken in float32 from the bfloat16 logits: :func:`posenc.experiments.tasks.text.position_nll`
casts each chunk of logits before ``log_softmax``). On a CPU, bfloat16 matrix products are fast where
the ISA has them (AVX-512 BF16, AMX-BF16) and emulated elsewhere; :func:`cpu_description` says which
the machine has, and the study records it beside its results (``config.json``'s ``runtime``).
"""

from __future__ import annotations

import platform
from pathlib import Path

import torch

__all__ = [
    "ISA_FLAGS",
    "STUDY_DTYPES",
    "cast_weights",
    "check_dtype_runs",
    "cpu_description",
    "emulated_note",
    "study_dtype",
]

#: ``--dtype`` names and their torch dtypes.
STUDY_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}

#: The ``/proc/cpuinfo`` flags that decide a CPU forward's speed by precision.
ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_fp16")


def study_dtype(name: str) -> torch.dtype:
    """The torch dtype of ``--dtype name``; ``ValueError`` naming ``--dtype`` and the choices."""
    if name not in STUDY_DTYPES:
        raise ValueError(f"--dtype {name!r}: the study runs in one of {', '.join(STUDY_DTYPES)}")
    return STUDY_DTYPES[name]


def cast_weights(model: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """``model`` on ``device`` with its floating parameters in ``dtype`` and every buffer as it was:
    the rotary tables (HF's ``inv_freq``) stay float32, where ``model.to(torch.bfloat16)`` would round
    them to 8 bits of mantissa and turn the angle at position 16k by up to ``16k · θ · 2⁻⁹``."""
    model.to(device)
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None and param.is_floating_point() and param.dtype != dtype:
                module._parameters[name] = torch.nn.Parameter(
                    param.data.to(dtype), requires_grad=param.requires_grad
                )
    return model


def check_dtype_runs(name: str, device: torch.device) -> None:
    """Refuse ``--dtype name`` where ``device`` cannot multiply matrices in it (before any weight loads)."""
    dtype = study_dtype(name)
    try:
        probe = torch.ones(4, 4, dtype=dtype, device=device)
        torch.nn.functional.linear(probe, probe).float().sum().item()
    except (RuntimeError, TypeError) as err:
        raise ValueError(f"--dtype {name}: {device} cannot run it ({err}); give --dtype float32") from err


def cpu_description() -> dict[str, object]:
    """``{"cpu": model name, "isa": [flags of ISA_FLAGS it has], "torch_cpu_capability": ...}``."""
    model, flags = "", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and not model:
                model = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(value.split())
    except OSError:  # not Linux: the platform's word for it, and no flags
        pass
    model = model or platform.processor() or "unknown CPU"
    return {
        "cpu": model,
        "isa": [flag for flag in ISA_FLAGS if flag in flags],
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
    }


#: The flags under which a half-precision dtype multiplies natively on a CPU (else oneDNN emulates it).
NATIVE_FLAGS = {"bfloat16": ("avx512_bf16", "amx_bf16"), "float16": ("avx512_fp16", "amx_fp16")}


def emulated_note(name: str, device: torch.device | str = "cpu") -> str | None:
    """A line saying that ``--dtype name`` is emulated on this CPU and slower than float32, or None
    (float32, another device, or a CPU with the dtype's native instructions). The study prints it
    when it starts: it runs as asked, and the user learns why it is slow."""
    if name not in NATIVE_FLAGS or torch.device(device).type != "cpu":
        return None
    cpu = cpu_description()
    if any(flag in cpu["isa"] for flag in NATIVE_FLAGS[name]):
        return None
    isa = ", ".join(cpu["isa"]) or "none of " + ", ".join(ISA_FLAGS)  # type: ignore[arg-type]
    return (
        f"--dtype {name}: this CPU ({cpu['cpu']}; {isa}) has no {' or '.join(NATIVE_FLAGS[name])}, so {name} "
        "matrix products are emulated and slower than float32 (a 2048-token SmolLM2-135M forward took 4.9x "
        "float32's time on an AVX2-only AMD EPYC); --dtype float32 is faster here"
    )
