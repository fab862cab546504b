"""Where posenc binds to code it does not own, which releases it supports, and a check for drift.

posenc reaches past the public API of two projects:

* **HF transformers** (``posenc.hf``): it replaces ``T5Attention.forward``,
  ``BloomAttention.forward`` and ``MPNetSelfAttention.forward`` (and a served MPNet encoder's
  ``compute_position_bias``, whose bucket defaults it reads), replaces a Llama-family model's rotary embedding (called as
  ``rotary_emb(x, position_ids)``, rebuilt as ``type(rotary_emb)(config=...)``), and serves HF's
  attention-function convention (the arguments HF's own ``sdpa_attention_forward`` takes).
  Supported: :data:`TRANSFORMERS_RANGE`, the range ``pyproject.toml`` declares for the ``hf`` and
  ``test`` extras; CI runs the HF tests at both ends.
* **torch** (the CPU flash paths): ``aten::_scaled_dot_product_flash_attention_for_cpu`` and its
  backward, called directly by the blocked, near_far, segments, clipped and sdpa-with-sinks paths.

Each :class:`Seam` records the signatures posenc was written against (every supported release's,
read off the releases themselves) and checks the installed one against them. Two uses:

* **At run time**, a bridge binds by what the installed interface offers (:meth:`Seam.parameters`),
  not by a version number, and an interface it cannot serve is refused with
  :meth:`Seam.mismatch`: the parameters posenc expected, the ones it found, and the supported range.
  A torch whose flash op has another schema makes those backends state a reason (nothing silent).
* **In the tests** (``tests/test_seams.py``), one canary per seam fails with one line naming the seam
  and what changed (:meth:`Seam.drift`) when a release moves it, before any equality test does.

Nothing here imports transformers until a seam is read.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass

__all__ = [
    "SEAMS",
    "TORCH_RANGE",
    "TRANSFORMERS_RANGE",
    "Seam",
    "drift_report",
    "parameter_names",
]

#: The transformers releases ``posenc.hf`` supports (declared in ``pyproject.toml``; both ends tested).
TRANSFORMERS_RANGE = ">=5.15,<5.25"

#: The torch releases posenc supports (``pyproject.toml``'s core requirement; ``.ci/run`` tests the
#: floor and the newest release, each from PyPI's default build). The floor is the oldest release
#: whose ``torch.compile`` traces the layer in one graph and whose FlexAttention compiles the learned
#: bias score_mods (FIRE, the MLP bias): 2.11 graph-breaks on the attention request's cached checks,
#: 2.9 also fails those score_mods, 2.6 also builds derived buffers on the meta device wrongly.
TORCH_RANGE = ">=2.12,<2.16"


def parameter_names(obj: Callable) -> tuple[str, ...]:
    """``("self", "x", "*args", "**kwargs")``: a Python callable's parameters as a flat tuple."""
    names = []
    for parameter in inspect.signature(obj).parameters.values():
        prefix = {inspect.Parameter.VAR_POSITIONAL: "*", inspect.Parameter.VAR_KEYWORD: "**"}.get(
            parameter.kind, ""
        )
        names.append(prefix + parameter.name)
    return tuple(names)


def _op_schema(obj: object) -> tuple[str, ...]:
    """A torch op's arguments and returns as ``("Tensor query", ..., "-> Tensor output", ...)``."""
    schema = obj.default._schema  # type: ignore[attr-defined]
    arguments = tuple(f"{arg.type} {arg.name}" for arg in schema.arguments)
    returns = tuple(f"-> {ret.type} {ret.name}" for ret in schema.returns)
    return arguments + returns


@dataclass(frozen=True)
class Seam:
    """One place posenc binds to another project's internals.

    Attributes:
        name: what is bound, e.g. ``"transformers T5Attention.forward"``.
        package: the distribution it lives in (``"transformers"``, ``"torch"``).
        supported: the release range posenc supports for it.
        module: the module that defines it.
        path: the attribute path inside ``module`` (``"T5Attention.forward"``).
        known: every signature posenc was written against, one tuple of parameter names each (a torch
            op: its schema's ``"type name"`` arguments and ``"-> type name"`` returns).
        used_by: what in posenc depends on it.
    """

    name: str
    package: str
    supported: str
    module: str
    path: str
    known: tuple[tuple[str, ...], ...]
    used_by: str

    def target(self) -> object:
        """The installed object (imports ``module``); raises ImportError / AttributeError when gone."""
        obj: object = importlib.import_module(self.module)
        for part in self.path.split("."):
            obj = getattr(obj, part)
        return obj

    def parameters(self) -> tuple[str, ...]:
        """The installed signature, in the form of :attr:`known`."""
        obj = self.target()
        return _op_schema(obj) if self.package == "torch" else parameter_names(obj)  # type: ignore[arg-type]

    def installed_version(self) -> str:
        try:
            return str(importlib.import_module(self.package).__version__)
        except ImportError:
            return "not installed"

    def drift(self) -> str | None:
        """None when the installed signature is one posenc knows; else one line naming the seam and
        what changed (added and removed parameters against the closest known signature)."""
        try:
            found = self.parameters()
        except (ImportError, AttributeError) as err:
            return f"{self.name}: not found in {self.package} {self.installed_version()} ({err})"
        if found in self.known:
            return None
        # The nearest known signature (the newest among equals: known is ordered oldest first).
        closest = min(reversed(self.known), key=lambda known: len(set(known) ^ set(found)))
        added = [p for p in found if p not in closest]
        removed = [p for p in closest if p not in found]
        change = ", ".join(
            part
            for part in (
                f"added {', '.join(added)}" if added else "",
                f"removed {', '.join(removed)}" if removed else "",
                "reordered" if not added and not removed else "",
            )
            if part
        )
        return (
            f"{self.name} changed in {self.package} {self.installed_version()}: {change} "
            f"(posenc knows ({', '.join(closest)}); supported {self.package}{self.supported}; used by {self.used_by})"
        )

    def mismatch(self, expected: str, found: object | None = None) -> str:
        """The error text for an interface a bridge cannot serve: what posenc ``expected``, what it
        ``found`` (default: the installed signature), and the supported range. Never "upgrade":
        the installed release may be newer than the range."""
        if found is None:
            try:
                found = "(" + ", ".join(self.parameters()) + ")"
            except (ImportError, AttributeError) as err:
                found = f"nothing ({err})"
        return (
            f"{self.name} in {self.package} {self.installed_version()} is not the interface posenc binds to: "
            f"posenc expected {expected}, found {found}. posenc supports {self.package}{self.supported} "
            f"(tested at both ends); install a release in that range"
        )


_T5_OLD = (
    "self",
    "hidden_states",
    "mask",
    "key_value_states",
    "position_bias",
    "past_key_values",
    "**kwargs",
)
_SDPA = (
    "module",
    "query",
    "key",
    "value",
    "attention_mask",
    "dropout",
    "scaling",
    "is_causal",
    "position_bias",
)

#: Every seam, by a short key. The signatures are those of the releases in the supported range.
SEAMS: dict[str, Seam] = {
    seam.name.split(" ", 1)[1]: seam
    for seam in (
        Seam(
            name="transformers T5Attention.forward",
            package="transformers",
            supported=TRANSFORMERS_RANGE,
            module="transformers.models.t5.modeling_t5",
            path="T5Attention.forward",
            known=(_T5_OLD, (*_T5_OLD[:5], "cache", "**kwargs")),  # 5.15-5.23: past_key_values; 5.24: cache
            used_by="posenc.hf.use_posenc_attention (T5, mT5), which replaces it",
        ),
        Seam(
            name="transformers BloomAttention.forward",
            package="transformers",
            supported=TRANSFORMERS_RANGE,
            module="transformers.models.bloom.modeling_bloom",
            path="BloomAttention.forward",
            known=(
                (
                    "self",
                    "hidden_states",
                    "residual",
                    "alibi",
                    "attention_mask",
                    "layer_past",
                    "use_cache",
                    "output_attentions",
                    "**kwargs",
                ),
            ),
            used_by="posenc.hf.use_posenc_attention (BLOOM), which replaces it",
        ),
        Seam(
            name="transformers MPNetSelfAttention.forward",
            package="transformers",
            supported=TRANSFORMERS_RANGE,
            module="transformers.models.mpnet.modeling_mpnet",
            path="MPNetSelfAttention.forward",
            known=(
                ("self", "hidden_states", "attention_mask", "position_bias", "output_attentions", "**kwargs"),
            ),
            used_by="posenc.hf.use_posenc_attention (MPNet), which replaces it",
        ),
        Seam(
            name="transformers MPNetEncoder.compute_position_bias",
            package="transformers",
            supported=TRANSFORMERS_RANGE,
            module="transformers.models.mpnet.modeling_mpnet",
            path="MPNetEncoder.compute_position_bias",
            known=(("self", "x", "position_ids", "num_buckets"),),
            used_by="posenc.hf.use_posenc_attention (MPNet): reads its num_buckets default, and stands in "
            "for it on a served encoder (no dense bias)",
        ),
        Seam(
            name="transformers MPNetEncoder.relative_position_bucket",
            package="transformers",
            supported=TRANSFORMERS_RANGE,
            module="transformers.models.mpnet.modeling_mpnet",
            path="MPNetEncoder.relative_position_bucket",
            known=(("relative_position", "num_buckets", "max_distance"),),
            used_by="posenc.hf.use_posenc_attention (MPNet): reads its max_distance default (posenc's t5 "
            "buckets equal it)",
        ),
        Seam(
            name="transformers LlamaRotaryEmbedding.forward",
            package="transformers",
            supported=TRANSFORMERS_RANGE,
            module="transformers.models.llama.modeling_llama",
            path="LlamaRotaryEmbedding.forward",
            known=(("self", "x", "position_ids"),),
            used_by="posenc.hf.swap_encoding, which replaces the rotary embedding by the identity",
        ),
        Seam(
            name="transformers LlamaRotaryEmbedding.__init__",
            package="transformers",
            supported=TRANSFORMERS_RANGE,
            module="transformers.models.llama.modeling_llama",
            path="LlamaRotaryEmbedding.__init__",
            known=(("self", "config", "device"), ("self", "config")),  # device dropped in 5.19
            used_by="posenc.hf.set_rope_scaling, which rebuilds it from the changed config",
        ),
        Seam(
            name="transformers sdpa_attention_forward",
            package="transformers",
            supported=TRANSFORMERS_RANGE,
            module="transformers.integrations.sdpa_attention",
            path="sdpa_attention_forward",
            # 5.19-5.23 passed the paged cache as `cache`; posenc refuses it (posenc.hf).
            known=((*_SDPA, "**kwargs"), (*_SDPA, "cache", "**kwargs")),
            used_by="posenc.hf.attention_forward, which serves the same calls",
        ),
        Seam(
            name="torch aten::_scaled_dot_product_flash_attention_for_cpu",
            package="torch",
            supported=TORCH_RANGE,
            module="torch",
            path="ops.aten._scaled_dot_product_flash_attention_for_cpu",
            known=(
                (
                    "Tensor query",
                    "Tensor key",
                    "Tensor value",
                    "float dropout_p",
                    "bool is_causal",
                    "Optional[Tensor] attn_mask",
                    "Optional[float] scale",
                    "-> Tensor output",
                    "-> Tensor logsumexp",
                ),
            ),
            used_by="the CPU flash paths (blocked, near/far, segment and clipped splits, sdpa with sinks)",
        ),
        Seam(
            name="torch aten::_scaled_dot_product_flash_attention_for_cpu_backward",
            package="torch",
            supported=TORCH_RANGE,
            module="torch",
            path="ops.aten._scaled_dot_product_flash_attention_for_cpu_backward",
            known=(
                (
                    "Tensor grad_out",
                    "Tensor query",
                    "Tensor key",
                    "Tensor value",
                    "Tensor out",
                    "Tensor logsumexp",
                    "float dropout_p",
                    "bool is_causal",
                    "Optional[Tensor] attn_mask",
                    "Optional[float] scale",
                    "-> Tensor grad_query",
                    "-> Tensor grad_key",
                    "-> Tensor grad_value",
                ),
            ),
            used_by="the backward of the CPU flash paths",
        ),
    )
}


def cpu_flash_drift() -> str | None:
    """None when this torch's CPU flash op and its backward have the schemas posenc calls them with;
    else the first drift line (the backends that call them then state it as their reason)."""
    for key in (
        "aten::_scaled_dot_product_flash_attention_for_cpu",
        "aten::_scaled_dot_product_flash_attention_for_cpu_backward",
    ):
        line = SEAMS[key].drift()
        if line is not None:
            return line
    return None


def drift_report(package: str | None = None) -> list[str]:
    """One line per seam whose installed signature posenc does not know (``package`` limits the check
    to one project's seams); empty when everything matches. Imports what it checks."""
    lines = []
    for seam in SEAMS.values():
        if package is not None and seam.package != package:
            continue
        line = seam.drift()
        if line is not None:
            lines.append(line)
    return lines
