"""What the parts of :mod:`posenc.hf` share: the backend setting, the last backend that served a call,
the HF interface checks, and HF masks read as bool masks."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from ..encodings.registry import build
from ..seams import SEAMS, parameter_names

#: NoPE: what runs when HF has put its own positions into q and k already.
NOPE = build("nope")
#: The posenc backend every HF call uses (``"auto"``: the dispatcher's choice per call); set by ``register``.
BACKEND = {"name": "auto"}
_state = threading.local()


def transformers_module() -> Any:
    try:
        import transformers
    except ImportError as err:  # pragma: no cover - transformers is installed for the tests
        raise ImportError("posenc.hf needs HF transformers: pip install 'posenc[hf]'") from err
    return transformers


def note_backend(name: str) -> None:
    """Record the backend that served the last HF attention call in this thread."""
    _state.last_backend = name


def last_backend() -> str | None:
    """The posenc backend that served the last HF attention call in this thread (None before any)."""
    return getattr(_state, "last_backend", None)


def check_interface(
    module: nn.Module,
    seam: str,
    parameters: Sequence[str],
    attributes: Sequence[str],
    one_of: Sequence[str] = (),
    instead: str = "attn_implementation='posenc' (dense position_bias)",
) -> None:
    """Bind by what the installed module offers, not by a version number: its ``forward`` must take
    ``parameters`` (and one of ``one_of``, when given) and the module must have ``attributes``.
    Anything else is refused naming what posenc expected, what it found, the supported range
    (:data:`posenc.seams.SEAMS` ``[seam]``) and what to use ``instead``."""
    found = [name for name in parameter_names(type(module).forward) if name != "self"]
    missing = [name for name in parameters if name not in found]
    if one_of and not any(name in found for name in one_of):
        missing.append(" or ".join(one_of))
    missing += [f"attribute {name}" for name in attributes if not hasattr(module, name)]
    if missing:
        wanted = [*parameters, *([" or ".join(one_of)] if one_of else [])]
        expected = f"forward({', '.join(wanted)}, ...) and attributes {', '.join(attributes)}"
        raise ValueError(
            "use_posenc_attention: "
            + SEAMS[seam].mismatch(expected, f"forward({', '.join(found)}), lacking {', '.join(missing)}")
            + f"; or use {instead}"
        )


def allowed_keys(mask: Tensor | None) -> Tensor | None:
    """HF's 4-D attention mask as a bool mask (True = attend): a bool mask as it is; HF's eager float
    mask (0 where allowed, the dtype's minimum or -inf where not) compared with half that minimum."""
    if mask is not None and not isinstance(mask, Tensor):
        raise ValueError(
            f"use_posenc_attention: the model passed its attention a {type(mask).__name__} mask; posenc reads "
            "tensor masks: set the model's attn_implementation to 'posenc' (or 'sdpa' / 'eager')"
        )
    if mask is None or mask.dtype == torch.bool:
        return mask
    return mask > torch.finfo(mask.dtype).min / 2
