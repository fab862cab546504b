"""Published orderings of extension recipes, checked at toy scale: ``posenc extend --preset NAME``.

Each preset trains one base run per seed (a byte-level LM with RoPE on the embedded corpus), extends
every run under the recipes the paper compares, and says for each published ordering whether it
holds: A beats B beyond ``L2``, paired by seed (:func:`~posenc.experiments.results.compare.compare_rows`,
a 95% Student's t interval over the seeds' differences). An interval on A's side: "holds"; on B's:
"contradicted"; across 0: "cannot tell".

==============  ==========================================================  ===========================
preset          the published ordering                                      rows compared
==============  ==========================================================  ===========================
``pose-paper``  Zhu et al. 2024 (PoSE, Table 1): training at the short      ``pose:scaling=pi`` against
                length with skipped positions reads past it, and comes      the run as trained;
                near full-length fine-tuning at a fraction of its tokens    ``pi`` (full length)
                                                                            against ``pose:scaling=pi``
``yarn-paper``  Peng et al. 2023 (YaRN): after the same continued           ``yarn`` > ``pi`` >
                training, YaRN reads farther than PI, and PI farther than   ``continue``
                continuing unchanged
``abf-paper``   Xiong et al. 2023 (ABF): raising RoPE's base before         ``abf:base=500000`` >
                continuing beats continuing at the old base                 ``continue``
==============  ==========================================================  ===========================

The scale (steps, seeds, sizes) is posenc's, on CPU; the documented runs are in ``docs/studies.md``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..config import ExperimentConfig
from ..results.compare import compare_rows
from ..results.records import read_run_records
from .recipes import LABEL_SEPARATOR
from .stage import ExtensionConfig, run_extension

__all__ = [
    "EXTENSION_PRESETS",
    "Claim",
    "ExtensionPreset",
    "Verdict",
    "check_claims",
    "mean_positions_seen",
    "run_extension_preset",
]


@dataclass(frozen=True)
class Claim:
    """A published ordering: recipe ``a`` reads past ``L2`` better than ``b`` (``"none"``: the run as
    trained), in the paper's words ``says``."""

    a: str
    b: str
    says: str


@dataclass(frozen=True)
class ExtensionPreset:
    """A published comparison of recipes: the base run, the extension and the orderings to check."""

    name: str
    citation: str
    base: ExperimentConfig
    extension: ExtensionConfig
    claims: tuple[Claim, ...]


def _base(**changes: Any) -> ExperimentConfig:
    settings = dict(
        task="lm", encodings=["rope"], seeds=[0, 1, 2], train_len=64, eval_len=64, steps=1500, batch_size=16,
        lr=3e-3, warmup=100, d_model=64, num_layers=2, num_heads=4, d_ff=256, eval_examples=16,
        checkpoint_every=250,
    )  # fmt: skip
    return ExperimentConfig(**{**settings, **changes})


EXTENSION_PRESETS: dict[str, ExtensionPreset] = {
    preset.name: preset
    for preset in (
        ExtensionPreset(
            "pose-paper",
            "Zhu et al. 2024, PoSE: Efficient Context Window Extension of LLMs via Positional Skip-wise Training (ICLR)",
            _base(),
            ExtensionConfig(to_len=128, recipes=["pi", "pose:scaling=pi"], steps=300, eval_len=256),
            (
                Claim("pose:scaling=pi", "none", "PoSE at the short length reads past it"),
                Claim("pi", "pose:scaling=pi", "full-length fine-tuning stays at least as good as PoSE"),
            ),
        ),
        ExtensionPreset(
            "yarn-paper",
            "Peng et al. 2023, YaRN: Efficient Context Window Extension of Large Language Models (ICLR 2024)",
            _base(),
            ExtensionConfig(to_len=128, recipes=["continue", "pi", "yarn"], steps=300, eval_len=256),
            (
                Claim("yarn", "pi", "YaRN reads farther than PI after the same training"),
                Claim("pi", "continue", "PI reads farther than continuing unchanged"),
            ),
        ),
        ExtensionPreset(
            "abf-paper",
            "Xiong et al. 2023, Effective Long-Context Scaling of Foundation Models (NAACL 2024)",
            _base(),
            ExtensionConfig(to_len=128, recipes=["continue", "abf:base=500000"], steps=300, eval_len=256),
            (Claim("abf:base=500000", "continue", "a raised base before continuing beats the old base"),),
        ),
    )
}


@dataclass(frozen=True)
class Verdict:
    """One claim checked: ``outcome`` is ``"holds"``, ``"contradicted"`` or ``"cannot tell"``;
    ``mean`` and ``interval`` are A − B beyond ``L2`` (None: one seed)."""

    claim: Claim
    outcome: str
    mean: float
    interval: tuple[float, float] | None
    sentence: str


def _row(encoding: str, recipe: str) -> str:
    return encoding if recipe == "none" else f"{encoding}{LABEL_SEPARATOR}{recipe}"


def check_claims(folder: Path, preset: ExtensionPreset) -> list[Verdict]:
    """Each claim of ``preset`` on the extension ``folder``, paired by seed."""
    verdicts = []
    encoding = preset.base.encodings[0]
    for claim in preset.claims:
        comparison = compare_rows(
            folder, _row(encoding, claim.a), _row(encoding, claim.b), fit_threshold=1e-12
        )
        outcome = {"a": "holds", "b": "contradicted"}.get(comparison.verdict, "cannot tell")
        verdicts.append(Verdict(claim, outcome, comparison.mean, comparison.interval, comparison.sentence()))
    return verdicts


def mean_positions_seen(folder: Path) -> dict[str, float]:
    """Each recipe's mean ``positions_seen`` over its seeds (the compute it spent)."""
    seen: dict[str, list[int]] = {}
    for record in read_run_records(folder):
        if record.get("recipe") not in (None, "none"):
            seen.setdefault(record["recipe"], []).append(int(record["positions_seen"]))
    return {recipe: sum(values) / len(values) for recipe, values in seen.items()}


def run_extension_preset(
    name: str,
    out: Path,
    *,
    scale: Callable[[ExperimentConfig, ExtensionConfig], tuple[ExperimentConfig, ExtensionConfig]]
    | None = None,
    report: Any = None,
    log: Callable[[str], None] | None = None,
) -> tuple[Path, list[Verdict]]:
    """Run preset ``name`` into ``out`` (``out/base``, then ``out/base-to<L2>``) and check its claims;
    ``scale(base, extension)`` may change the scale (steps, seeds, sizes), not what is compared.
    Returns the extension folder and the verdicts. Re-running resumes both stages."""
    from ..runner import run_experiment

    if name not in EXTENSION_PRESETS:
        raise ValueError(f"--preset {name!r}: unknown; choose from {', '.join(EXTENSION_PRESETS)}")
    preset = EXTENSION_PRESETS[name]
    base, extension = preset.base, preset.extension
    if scale is not None:
        base, extension = scale(base, extension)
    if extension.recipes != preset.extension.recipes or base.encodings != preset.base.encodings:
        raise ValueError(
            f"--preset {name}: the recipes and encodings are the preset's; change only the scale"
        )
    out = Path(out)
    run_experiment(base, out / "base", workers=1, report=report, log=log)
    folder = out / f"base-to{extension.to_len}"
    run_extension(out / "base", dataclasses.replace(extension), folder, report=report, log=log)
    return folder, check_claims(folder, preset)
