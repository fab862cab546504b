"""The plan of a context-extension study (``posenc extrapolate --hf-model M --task text``), from the
model's config alone: its settings, its (variant, length) units in ``--shard`` order, and the grid
``posenc submit`` splits into a Slurm job array (:class:`StudyGrid`). Running the units is
:mod:`.hf_study`; nothing here loads weights, so a login node can plan a study it will not run.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ...pretrained.loading import causal_lm_class_name, load_config, reference_text
from ..results.records import RUNS_FILE, read_records
from .hf_methods import parse_variants, variant_parameters
from .hf_scaling import check_hf_folder, model_label, scaled_layer_types
from .precision import study_dtype
from .sweep import expand_grid, is_grid, split_windows

__all__ = [
    "CORPORA",
    "STUDY_TASKS",
    "TASK_PARTS",
    "StudyGrid",
    "StudyPlan",
    "Unit",
    "default_lengths",
    "expand_variants",
    "longppl_settings",
    "missing_units",
    "parse_depths",
    "plan_study",
    "runs_lm",
    "runs_needles",
    "shard_units",
    "study_command",
    "study_grid",
    "study_text",
    "study_units",
    "unit_id",
    "variant_word",
]

#: The study's tasks (``text`` runs perplexity and the passkey; ``text-multikey`` the passkey and,
#: beside it on the same lengths and depths, RULER's multi-key needle).
STUDY_TASKS = ("text", "text-lm", "text-passkey", "text-multikey", "text-vt", "text-jsonkv", "text-retrieval")
#: What each task runs: perplexity by position (``lm``) and which needles, by task (``vt``: RULER's
#: variable tracking; ``jsonkv``: HELMET's JSON key-value retrieval, :mod:`..tasks.haystack`).
TASK_PARTS: dict[str, tuple[str, ...]] = {
    "text": ("lm", "passkey"),
    "text-lm": ("lm",),
    "text-passkey": ("passkey",),
    "text-multikey": ("passkey", "multikey"),
    "text-vt": ("vt",),
    "text-jsonkv": ("jsonkv",),
    "text-retrieval": ("passkey", "multikey", "vt", "jsonkv"),
}


def runs_lm(task: str) -> bool:
    """Whether ``task`` scores perplexity by position (and so reads ``--corpus``)."""
    return "lm" in TASK_PARTS[task]


def runs_needles(task: str) -> bool:
    """Whether ``task`` runs needle prompts (over ``--lengths`` and ``--depths``)."""
    return any(part != "lm" for part in TASK_PARTS[task])


#: Built-in evaluation texts by ``--corpus`` name.
CORPORA: dict[str, Callable[[], str]] = {}


def _reference() -> str:
    return reference_text()


CORPORA["python-reference"] = _reference


def _corpus_label(corpus: str | None) -> str:
    """The label of ``--corpus`` (a built-in name, default ``python-reference``, or a file's path);
    ``ValueError`` when it is neither."""
    name = corpus or "python-reference"
    if name not in CORPORA and not Path(name).is_file():
        raise ValueError(f"--corpus {name}: neither a file nor a built-in text ({', '.join(CORPORA)})")
    return name if name in CORPORA else str(Path(name))


def study_text(corpus: str | None) -> tuple[str, str]:
    """``(text, label)`` of ``--corpus``: a built-in name (default ``python-reference``) or a file."""
    label = _corpus_label(corpus)
    if label in CORPORA:
        return CORPORA[label](), label
    return Path(label).read_text(encoding="utf-8", errors="replace"), label


def parse_depths(text: str | Sequence[float] | None) -> list[float]:
    """``"0,0.5,1"`` -> ``[0.0, 0.5, 1.0]``; each in [0, 1] (``ValueError`` naming ``--depths``)."""
    if text is None:
        return [0.0, 0.25, 0.5, 0.75, 1.0]
    items = [s.strip() for s in text.split(",") if s.strip()] if isinstance(text, str) else list(text)
    depths = []
    for item in items:
        try:
            depth = float(item)
        except ValueError as err:
            raise ValueError(f"--depths {item!r}: a depth is a number in [0, 1]") from err
        if not 0.0 <= depth <= 1.0:
            raise ValueError(f"--depths {item}: a needle depth must lie in [0, 1] (0: start, 1: end)")
        depths.append(depth)
    if not depths:
        raise ValueError("--depths: give at least one depth in [0, 1]")
    return depths


def expand_variants(variants: Sequence[str]) -> list[str]:
    """A factor sweep ``NAME:F1/F2/F3`` -> ``NAME:F1, NAME:F2, NAME:F3`` (one row each, none chosen);
    a grid (``|``, :func:`.sweep.expand_grid`) -> its settings; other items as they are."""
    out: list[str] = []
    for variant in variants:
        name, _, factors = variant.partition(":")
        if is_grid(variant):
            out += expand_grid(variant)
        else:
            out += [f"{name}:{f.strip()}" for f in factors.split("/")] if "/" in factors else [variant]
    return list(dict.fromkeys(out))


def _sweeps(
    variants: Sequence[str], tuning_windows: int, eval_examples: int, seed: int, task: str
) -> dict[str, Any]:
    """The settings' ``sweeps`` (grid item -> its settings) and ``tuning_windows`` (the tuning
    windows' indices); ``ValueError`` naming ``--tuning-windows`` where a grid has no split to be
    chosen on, or a split has no grid or no perplexity windows."""
    sweeps = {item: expand_grid(item) for item in variants if is_grid(item)}
    if not isinstance(tuning_windows, int) or isinstance(tuning_windows, bool) or tuning_windows < 0:
        raise ValueError(f"--tuning-windows must be a whole number >= 0, got {tuning_windows!r}")
    if sweeps and not tuning_windows:
        raise ValueError(
            f"--eval-variants {next(iter(sweeps))!r} is a grid: give --tuning-windows K, the windows its setting "
            "is chosen on (the rest are held out for every reported number and test)"
        )
    if tuning_windows and not sweeps:
        raise ValueError(
            "--tuning-windows chooses a grid's setting: give a grid in --eval-variants (OPTION=A|B)"
        )
    if tuning_windows and not runs_lm(task):
        raise ValueError(
            f"--tuning-windows splits perplexity windows: give --task text or text-lm, not {task}"
        )
    return {"sweeps": sweeps, "tuning_windows": split_windows(eval_examples, tuning_windows, seed)}


def default_lengths(context: int, eval_len: int) -> list[int]:
    lengths = [context // 2, context, 3 * context // 2, 2 * context, eval_len]
    return sorted({n for n in lengths if 0 < n <= eval_len})


def study_units(variants: Sequence[str], lengths: Sequence[int]) -> list[tuple[str, int]]:
    """Every (variant, length) unit, variant-major: the order ``--shard`` splits."""
    return [(variant, length) for variant in variants for length in lengths]


def shard_units(units: Sequence[tuple[str, int]], index: int, count: int) -> list[tuple[str, int]]:
    """The units of shard ``index`` of ``count``: those at positions ``index, index + count, ...``."""
    return [unit for position, unit in enumerate(units) if position % count == index]


@dataclass(frozen=True)
class Unit:
    """One (variant, length) unit of a study, by its row label."""

    encoding: str
    length: int

    @property
    def label(self) -> str:
        return f"{self.encoding} @ {self.length}"


def missing_units(settings: dict[str, Any], runs: list[dict[str, Any]]) -> list[Unit]:
    """The (variant, length) units of a study folder's settings that have no ``unit`` record."""
    done = {r.get("run") for r in runs if r.get("metric") == "unit"}
    return [
        Unit(label, length)
        for label, variant in settings["variant_names"].items()
        for length in settings["lengths"]
        if unit_id(variant, length) not in done
    ]


def unit_id(variant: str, length: int) -> str:
    """The ``run`` of unit ``(variant, length)``: ``hf__text__yarnx4__128``, a method's options joined
    (``self_extendxgroup_size-4_neighbor_window-8``)."""
    return f"hf__text__{variant_word(variant)}__{length}"


def variant_word(variant: str) -> str:
    """``variant`` as one word of a run id: ``:`` -> ``x``, ``=`` -> ``-``, ``,`` -> ``_``."""
    return variant.replace(":", "x").replace("=", "-").replace(",", "_")


@dataclass(frozen=True)
class StudyPlan:
    """What a study will run, from the model's config alone (no weights): its settings (as
    ``config.json`` records them), its (variant, length) units in ``--shard`` order, each variant's
    ``rope_parameters`` and row label."""

    settings: dict[str, Any]
    units: list[tuple[str, int]]
    scalings: dict[str, dict[str, Any] | None]
    labels: dict[str, str]


def plan_study(
    config: Any,
    model_class: str,
    model_ref: str | Path,
    *,
    task: str = "text",
    eval_len: int | None = None,
    lengths: Sequence[int] | None = None,
    depths: Sequence[float] | str | None = None,
    eval_examples: int = 1,
    seeds: Sequence[int] | None = None,
    corpus: str | None = None,
    variants: Sequence[str] | None = None,
    longppl: bool = False,
    tuning_windows: int = 0,
    dtype: str = "float32",
    trials: int | None = None,
) -> StudyPlan:
    """The plan of the study of the model whose HF ``config`` (and ``AutoModelForCausalLM`` class
    name) is given; :func:`run_study` and ``posenc submit`` both use it. ``ValueError`` names the
    option at fault."""
    depth_list, seeds = _check_trials(task, depths, eval_examples, seeds)
    if trials is not None and (isinstance(trials, bool) or not isinstance(trials, int) or trials < 1):
        raise ValueError(f"--trials must be a positive integer, got {trials!r}")
    context, eval_len, length_list = _study_lengths(config, model_ref, task, eval_len, lengths)
    items = parse_variants(",".join(variants) if variants else None)
    sweeps = _sweeps(items, tuning_windows, eval_examples, seeds[0], task)
    variant_list = expand_variants(items)
    scalings = {v: variant_parameters(v, config, context, eval_len) for v in variant_list}
    if not getattr(config, "rope_parameters", None) and any(scalings.values()):
        raise ValueError(f"--eval-variants: {model_class} has no rope_parameters to scale")
    scaled_types = scaled_layer_types(config, "--eval-variants") if any(scalings.values()) else None
    name = model_label(model_ref)
    labels = {v: name if v == "none" else f"{name} + {v}" for v in variant_list}
    settings = {
        "task": task,
        "study": True,
        "hf_model": str(model_ref),
        "model_class": model_class,
        "train_len": context,
        "eval_len": eval_len,
        "lengths": length_list if runs_needles(task) else [eval_len],
        "depths": depth_list if runs_needles(task) else None,
        "eval_examples": eval_examples,
        "corpus": _corpus_label(corpus) if runs_lm(task) else None,
        "encodings": list(labels.values()),
        "variants": {labels[v]: scalings[v] for v in variant_list},
        "variant_names": {labels[v]: v for v in variant_list},
        "seeds": seeds,
        "steps": 0,
    }
    if sweeps["sweeps"]:  # absent otherwise: a folder from before grids keeps its settings
        settings.update(sweeps)
    if trials is not None and runs_needles(task):  # the needle prompts per cell, apart from the windows
        settings["trials"] = trials
    if scaled_types is not None:  # a hybrid model: the scalings rescale these layers only
        settings["scaled_layer_types"] = scaled_types
    if study_dtype(dtype) != torch.float32:  # likewise: a float32 folder from before keeps its settings
        settings["dtype"] = dtype
    if longppl:
        settings["longppl"] = longppl_settings(task, context, eval_len)
    return StudyPlan(settings, study_units(variant_list, settings["lengths"]), scalings, labels)


def longppl_settings(task: str, context: int, eval_len: int) -> dict[str, int]:
    """LongPPL's short context (:mod:`posenc.experiments.tasks.longppl`): ``trunc = c/2`` tokens,
    blocks of ``stride = c/8``; ``ValueError`` naming ``--longppl`` when the task scores no perplexity
    or the windows are no longer than the short context."""
    if not runs_lm(task):
        raise ValueError(f"--longppl scores perplexity windows: give --task text or text-lm, not {task}")
    trunc, stride = max(1, context // 2), max(1, context // 8)
    if eval_len <= trunc:
        raise ValueError(
            f"--longppl: --eval-len {eval_len} is no longer than LongPPL's short context c/2 = {trunc}; "
            "give a longer --eval-len"
        )
    return {"trunc": trunc, "stride": stride}


def _check_trials(
    task: str, depths: Sequence[float] | str | None, eval_examples: int, seeds: Sequence[int] | None
) -> tuple[list[float], list[int]]:
    """:func:`plan_study`'s ``task``, ``depths``, ``seeds`` and ``eval_examples`` checked (in that
    order): the needle depths and the one seed."""
    if task not in STUDY_TASKS:
        raise ValueError(
            f"--task {task!r}: the text study's tasks are {', '.join(STUDY_TASKS)}, not {task!r}"
        )
    depth_list = parse_depths(depths if depths is None or isinstance(depths, str) else list(depths))
    seed_list = [0] if seeds is None else list(seeds)
    if len(seed_list) != 1:
        raise ValueError("--seeds: the text study takes one seed; use --eval-examples for more trials")
    if isinstance(eval_examples, bool) or not isinstance(eval_examples, int) or eval_examples < 1:
        raise ValueError(f"--eval-examples must be a positive integer, got {eval_examples!r}")
    return depth_list, seed_list


def _study_lengths(
    config: Any, model_ref: str | Path, task: str, eval_len: int | None, lengths: Sequence[int] | None
) -> tuple[int, int, list[int]]:
    """``(context, eval_len, lengths)`` of :func:`plan_study`: the model's context, ``--eval-len``
    (default twice the context) and the evaluated lengths, checked (``--eval-len`` among them but
    for the passkey task)."""
    context = int(getattr(config, "max_position_embeddings", 0) or 0)
    if context < 1:
        raise ValueError(f"--hf-model {model_ref}: its config has no max_position_embeddings")
    eval_len = 2 * context if eval_len is None else int(eval_len)
    if eval_len < 2:  # 0 reached the model as an empty window (a reshape error), -5 the passkey's check
        raise ValueError(
            f"--eval-len {eval_len}: the study scores positions 2..--eval-len (the first token has no "
            f"prediction); give at least 2 (default: twice the model's context, {2 * context})"
        )
    length_list = sorted(set(lengths)) if lengths else default_lengths(context, eval_len)
    if any(n < 2 or n > eval_len for n in length_list):
        raise ValueError(f"--lengths {length_list}: every length must lie in [2, --eval-len {eval_len}]")
    if eval_len not in length_list and runs_lm(task):
        length_list.append(eval_len)
    return context, eval_len, length_list


@dataclass(frozen=True)
class StudyGrid:
    """A study as ``posenc submit`` splits it into array tasks: shard ``i`` of ``n`` runs the units
    at positions ``i, i + n, ...`` (as ``extrapolate --shard i/n`` does); a unit is finished in a
    folder whose ``runs.jsonl`` records it. The protocol is :class:`.grid.Grid`."""

    plan: StudyPlan
    #: The sub-folder of ``OUT`` (and of each shard folder) the study writes: none.
    inside: str = ""
    #: Array tasks run one process (a study has no ``--workers``).
    takes_workers: bool = False

    def size(self) -> int:
        return len(self.plan.units)

    def settings(self) -> dict[str, Any]:
        return dict(self.plan.settings)

    def check(self, folder: Path) -> None:
        check_hf_folder(folder, self.plan.settings)

    def units(self, index: int, count: int) -> list[Unit]:
        return [self._unit(*pair) for pair in shard_units(self.plan.units, index, count)]

    def unit_ids(self, unit: Unit) -> set[str]:
        return {unit_id(self.plan.settings["variant_names"][unit.encoding], unit.length)}

    def finished(self, folder: Path) -> set[str]:
        path = folder / RUNS_FILE
        runs = read_records(path) if path.is_file() and path.stat().st_size else []
        return {str(r["run"]) for r in runs if r.get("metric") == "unit"}

    def _unit(self, variant: str, length: int) -> Unit:
        return Unit(self.plan.labels[variant], length)


def study_grid(model_ref: str | Path, **options: Any) -> StudyGrid:
    """The :class:`StudyGrid` of the study of ``model_ref`` (``options``: :func:`plan_study`'s), read
    from the model's config (:func:`posenc.pretrained.loading.load_config`) without loading its weights."""
    config = load_config(model_ref)
    return StudyGrid(plan_study(config, causal_lm_class_name(config), model_ref, **options))


def study_command(settings: dict[str, Any], out: str | Path) -> str:
    """The ``posenc study`` command that plans the study of ``settings`` (a study folder's
    ``config.json`` ``experiment``) into ``out``: what a report shows to reproduce the folder."""
    import shlex

    words = ["posenc", "study", str(settings["hf_model"]), "--tasks", str(settings["task"])]
    words += ["--eval-len", str(settings["eval_len"])]
    if runs_needles(settings["task"]):
        words += ["--lengths", ",".join(str(n) for n in settings["lengths"])]
        words += ["--depths", ",".join(f"{d:g}" for d in settings["depths"])]
    if settings.get("corpus") is not None:
        words += ["--corpus", str(settings["corpus"])]
    words += ["--windows", str(settings["eval_examples"])]
    if settings.get("trials") is not None:
        words += ["--trials", str(settings["trials"])]
    if settings.get("longppl"):
        words.append("--longppl")
    if settings.get("tuning_windows"):
        words += ["--tuning-windows", str(len(settings["tuning_windows"]))]
    if settings.get("dtype"):
        words += ["--dtype", str(settings["dtype"])]
    if list(settings["seeds"]) != [0]:
        words += ["--seed", str(settings["seeds"][0])]
    grid_of = {m: grid for grid, members in (settings.get("sweeps") or {}).items() for m in members}
    items = dict.fromkeys(grid_of.get(v, v) for v in settings["variant_names"].values())  # rows' order
    words += ["--variants", ",".join(items), "--out", str(out)]
    return shlex.join(words)
