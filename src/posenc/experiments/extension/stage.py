"""The extension stage: continue every trained run of a folder at a longer length, one recipe at a time.

:func:`run_extension` reads a finished ``posenc extrapolate`` folder (its ``config.json`` and every
run's checkpoint), and for each (encoding, seed) run and each recipe (:mod:`.recipes`): builds the
model the recipe describes, loads the run's trained weights into it (a learned table keeps its rows;
rows the base model lacked keep a seeded initialisation), applies the recipe's weight change, trains
``steps`` more steps with a new AdamW (peak ``lr``, ``warmup`` steps, then cosine to 10%), and
evaluates every length up to ``eval_len`` on the examples the base run was scored on. Each run is
also scored as it was trained (the row named by its encoding), so every recipe pairs by seed with
the base run and with every other recipe.

The extension folder is an experiment folder whose ``train_len`` is the target ``L2``: ``posenc
compare``, ``posenc report`` and the summary table rank its rows beyond ``L2`` as they rank
encodings beyond ``L``. Its ``config.json`` also records the extension's settings and the base
folder's identity; a rerun resumes (finished rows are kept, an interrupted one continues from its
checkpoint) and a folder of another extension or experiment is refused. Each row's ``runs.jsonl``
record says its compute: ``positions_seen`` (rows x padded width over its batches) and ``wall_s``.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..config import ExperimentConfig, RunSpec, run_id_for
from ..results.folders import checkpoint_path, finished_runs, folder_lock, write_outputs
from ..results.records import (
    RUNS_FILE,
    append_records,
    atomic_write_text,
    experiment_settings,
    iid_record,
    load_config,
    read_records,
    split_run_records,
)
from ..tasks.catalog import Task, mix_seed
from ..train import Reporter, build_model, continue_training, evaluate, load_checkpoint
from .recipes import Recipe, RecipeContext, interpolate_tables, learned_tables, parse_recipes, recipe_layers

__all__ = ["ExtensionConfig", "extension_folder_config", "load_base_config", "run_extension"]


@dataclass
class ExtensionConfig:
    """What ``posenc extend`` does to each run: continue it at task size ``to_len`` (``L2``) for
    ``steps`` steps under each of ``recipes``, then evaluate every size up to ``eval_len``
    (default ``2·L2``). ``lr`` (default: a tenth of the run's peak) and ``warmup`` (default: a tenth
    of ``steps``, at most the run's) shape the continued training's schedule."""

    to_len: int
    recipes: list[str]
    steps: int
    eval_len: int | None = None
    lr: float | None = None
    warmup: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def resolved(self, base: ExperimentConfig) -> ExtensionConfig:
        """These settings with every default filled in from the base run's ``base``, checked."""
        if self.to_len <= base.train_len:
            raise ValueError(
                f"--to {self.to_len} must be larger than the run's train_len L={base.train_len}: "
                "the extension continues training at a longer length"
            )
        if isinstance(self.steps, bool) or not isinstance(self.steps, int) or self.steps < 1:
            raise ValueError(f"--steps must be a positive integer, got {self.steps!r}")
        eval_len = 2 * self.to_len if self.eval_len is None else self.eval_len
        if eval_len < self.to_len:
            raise ValueError(f"--eval-len {eval_len} must be at least --to {self.to_len}")
        lr = base.lr / 10 if self.lr is None else self.lr
        if not 0 < lr < float("inf"):
            raise ValueError(f"--lr must be positive and finite, got {lr!r}")
        warmup = min(base.warmup, self.steps // 10) if self.warmup is None else self.warmup
        if warmup < 0:
            raise ValueError(f"--warmup must be 0 or more, got {warmup!r}")
        parse_recipes(self.recipes)
        return dataclasses.replace(self, eval_len=eval_len, lr=lr, warmup=warmup)

    def identity(self) -> dict[str, Any]:
        """What a resumed extension must share with the folder's (recipes may be added)."""
        return {k: v for k, v in dataclasses.asdict(self).items() if k != "recipes"}


def load_base_config(folder: Path) -> ExperimentConfig:
    """The experiment of a finished ``posenc extrapolate`` folder; ``ValueError`` naming the folder
    when it has no config.json or holds an extension already."""
    folder = Path(folder)
    saved = load_config(folder)
    if not saved:
        raise ValueError(
            f"{folder} has no config.json: give the folder a `posenc extrapolate` run wrote (its checkpoints "
            "are what the extension continues)"
        )
    if "extension" in saved:
        raise ValueError(
            f"{folder} is an extension folder; extend the folder it continues ({saved['extension']['base']['folder']})"
        )
    config = ExperimentConfig.from_settings(experiment_settings(saved))
    config.validate()
    return config


def extension_folder_config(folder: Path) -> ExperimentConfig:
    """The experiment an extension folder's ``config.json`` records (rows, ``train_len`` = ``L2``)."""
    return ExperimentConfig.from_settings(experiment_settings(load_config(folder)))


def _row_labels(base: ExperimentConfig, recipes: list[Recipe]) -> list[str]:
    return [label for enc in base.encodings for label in [enc] + [r.label(enc) for r in recipes]]


def _folder_config(base: ExperimentConfig, ext: ExtensionConfig, recipes: list[Recipe]) -> ExperimentConfig:
    """The extension folder's experiment: its rows, trained (as far as the reports read it) to ``L2``."""
    return dataclasses.replace(
        base,
        train_len=ext.to_len,
        eval_len=ext.eval_len,
        steps=ext.steps,
        encodings=_row_labels(base, recipes),
        eval_variants=[],
        until_fit=False,
    )


def _training_config(base: ExperimentConfig, ext: ExtensionConfig, recipe: Recipe) -> ExperimentConfig:
    """How ``recipe`` trains: at ``L2`` (sizes drawn as the run drew them), or at exactly ``L`` with
    PoSE's or CREAM's position ids; ``full`` trains from scratch as long as the run did."""
    kind = recipe.kind
    short = kind.trains_short
    return dataclasses.replace(
        base,
        train_len=base.train_len if short else ext.to_len,
        min_train_len=base.train_len if short else base.min_train_len,
        eval_len=ext.eval_len,
        steps=base.steps if kind.fresh else ext.steps,
        lr=base.lr if kind.fresh else ext.lr,
        warmup=base.warmup if kind.fresh else ext.warmup,
        until_fit=False,
        eval_variants=[],
    )


def _recipe_context(base: ExperimentConfig, ext: ExtensionConfig, task: Task) -> RecipeContext:
    return RecipeContext(
        task.sequence_length(base.train_len), task.sequence_length(ext.to_len), base.d_model // base.num_heads
    )


def _slug(text: str) -> str:
    return "".join(c if c.isalnum() or c == "_" else "x" for c in text)


def _run_id(base: ExperimentConfig, run: RunSpec, recipe: Recipe | None) -> str:
    return f"{run_id_for(base, run)}__to__{'base' if recipe is None else _slug(recipe.text)}"


def _load_trained(model: nn.Module, state: dict[str, torch.Tensor], source: Path) -> None:
    """The run's weights into ``model``: tables of another length (a learned table sized for the
    longer evaluation) share their first rows; anything else must match."""
    own = model.state_dict()
    merged = {}
    for key, value in state.items():
        if key not in own:
            raise ValueError(f"{source}: its weight {key} has no place in the extended model")
        target = own[key]
        if value.shape != target.shape:
            if value.dim() != 2 or value.shape[1] != target.shape[1]:
                raise ValueError(
                    f"{source}: weight {key} is {tuple(value.shape)}, the model's {tuple(target.shape)}"
                )
            rows = min(value.shape[0], target.shape[0])
            value = torch.cat([value[:rows], target[rows:]])
        merged[key] = value
    model.load_state_dict(merged)


def _recipe_model(
    base: ExperimentConfig,
    train: ExperimentConfig,
    task: Task,
    run: RunSpec,
    recipe: Recipe,
    ctx: RecipeContext,
    state: dict[str, Any] | None,
    source: Path,
) -> nn.Module:
    """The model ``recipe`` continues (fresh for ``full``): built, the run's weights loaded, changed."""
    encoding, pattern = recipe_layers(run.encoding, base.num_layers, recipe, ctx)
    torch.manual_seed(mix_seed(run.seed, "init" if recipe.kind.fresh else "extend-init"))
    model = build_model(train, task, encoding, pattern)
    if state is not None and not recipe.kind.fresh:
        _load_trained(model, state["model"], source)
    if recipe.kind.resamples_tables:
        interpolate_tables(model, run.encoding, ctx)
    return model


def _check_recipes(base: ExperimentConfig, ext: ExtensionConfig, task: Task, recipes: list[Recipe]) -> None:
    """Every recipe on every encoding, built on the meta device: one that does not apply is refused
    before anything is written."""
    ctx = _recipe_context(base, ext, task)
    for recipe in recipes:
        train = _training_config(base, ext, recipe)
        if recipe.kind.trains_short:
            # one row drawn now: CREAM refuses a length too short for its continuity head
            recipe.position_sampler(ctx)(1, ctx.train_tokens, torch.Generator().manual_seed(0))
        for encoding in base.encodings:
            encoding_spec, pattern = recipe_layers(encoding, base.num_layers, recipe, ctx)
            if recipe.kind.resamples_tables:
                with torch.device("meta"):
                    learned_tables(build_model(train, task, encoding_spec, pattern), encoding)


def _base_checkpoints(folder: Path, base: ExperimentConfig) -> dict[RunSpec, Path]:
    """Every run's finished checkpoint; ``ValueError`` naming the first run without one."""
    paths = {}
    for encoding in base.encodings:
        for seed in base.seeds:
            run = RunSpec(encoding, seed)
            path = checkpoint_path(folder, base, run)
            if not path.is_file():
                raise ValueError(
                    f"{folder} has no checkpoint for {run.label} ({path}): run its `posenc extrapolate` command "
                    "to the end first (the extension continues the trained runs)"
                )
            paths[run] = path
    return paths


def _check_out(out: Path, payload: dict[str, Any]) -> None:
    """An extension folder holds one extension of one base: refuse anything else already there."""
    saved = load_config(out)
    if not saved:
        return
    if "extension" not in saved:
        raise ValueError(
            f"{out} holds a `posenc extrapolate` experiment, not an extension; give another --out"
        )
    mine, theirs = payload["extension"], saved["extension"]
    if theirs.get("base") != mine["base"]:
        raise ValueError(
            f"{out} extends another run ({theirs.get('base', {}).get('folder')}), not {mine['base']['folder']}; "
            "give another --out"
        )
    if theirs.get("settings") != mine["settings"]:
        diff = {
            k: (theirs.get("settings", {}).get(k), v)
            for k, v in mine["settings"].items()
            if theirs.get("settings", {}).get(k) != v
        }
        details = ", ".join(f"{k}: {old!r} there vs {new!r} now" for k, (old, new) in diff.items())
        raise ValueError(f"{out} holds an extension with other settings ({details}); give another --out")


def run_extension(
    base_folder: Path,
    ext: ExtensionConfig,
    out: Path | None = None,
    *,
    report: Reporter | None = None,
    log: Callable[[str], None] | None = None,
    device: str = "cpu",
    figures: Callable[[Path], list[Path]] | None = None,
) -> list[dict[str, Any]]:
    """Extend every run of ``base_folder`` into ``out`` (default ``<base_folder>-to<L2>``); return the
    folder's records. See the module docstring; ``ValueError`` names the bad setting or file."""
    base_folder = Path(base_folder)
    base = load_base_config(base_folder)
    ext = ext.resolved(base)
    recipes = parse_recipes(ext.recipes)
    task = base.make_task()
    out = Path(out) if out is not None else base_folder.with_name(f"{base_folder.name}-to{ext.to_len}")
    if out.resolve() == base_folder.resolve():
        raise ValueError(f"--out {out} is the run's own folder; give another one")
    checkpoints = _base_checkpoints(base_folder, base)
    _check_recipes(base, ext, task, recipes)
    report = report or (lambda *args: None)
    log = log or (lambda message: None)
    folder_config = _folder_config(base, ext, recipes)
    payload = {
        "experiment": folder_config.to_dict(),
        "extension": {
            "settings": ext.identity(),
            "recipes": ext.recipes,
            "base": {"folder": str(base_folder.resolve()), "identity": base.identity()},
        },
    }
    torch_device = torch.device(device)
    with folder_lock(out):
        _check_out(out, payload)
        atomic_write_text(out / "config.json", json.dumps(payload, indent=2) + "\n")
        finished = finished_runs(out, folder_config, task.metric)
        ctx = _recipe_context(base, ext, task)
        for run, source in checkpoints.items():
            state = load_checkpoint(source, run, torch_device)
            for recipe in [None, *recipes]:
                run_id = _run_id(base, run, recipe)
                if run_id in finished:
                    continue
                records = _extend_one(
                    base,
                    ext,
                    folder_config,
                    task,
                    run,
                    recipe,
                    ctx,
                    state,
                    source,
                    out,
                    run_id,
                    torch_device,
                    report,
                    log,
                )
                per_length, per_run = split_run_records(records)
                append_records(out / RUNS_FILE, per_run)
                append_records(out / "results.jsonl", per_length)
        labels = set(folder_config.encodings)
        records = [r for r in read_records(out / "results.jsonl") if r["encoding"] in labels]
        written = write_outputs(out, records, figures)
        log(f"results: {', '.join(str(p) for p in [out / 'results.jsonl', *written])}")
        return records


def _extend_one(
    base: ExperimentConfig,
    ext: ExtensionConfig,
    folder_config: ExperimentConfig,
    task: Task,
    run: RunSpec,
    recipe: Recipe | None,
    ctx: RecipeContext,
    state: dict[str, Any],
    source: Path,
    out: Path,
    run_id: str,
    device: torch.device,
    report: Reporter,
    log: Callable[[str], None],
) -> list[dict[str, Any]]:
    """One row of one run: the base run scored as trained (``recipe`` None), or a recipe continued
    and scored; its records, tagged and with the compute in its ``iid`` record."""
    label = run.encoding if recipe is None else recipe.label(run.encoding)
    row = RunSpec(label, run.seed)
    started = time.perf_counter()
    steps, seen = int(state["step"]), 0
    if recipe is None:
        torch.manual_seed(mix_seed(run.seed, "extend-init"))
        model = build_model(folder_config, task, run.encoding)
        _load_trained(model, state["model"], source)
    else:
        train = _training_config(base, ext, recipe)
        model = _recipe_model(base, train, task, run, recipe, ctx, state, source)
        steps, seen = continue_training(
            model,
            train,
            task,
            row,
            out / "checkpoints" / f"{run_id}.pt",
            report,
            sample_positions=recipe.position_sampler(ctx),
            device=device,
            log=log,
        )
    model.to(device)
    records = evaluate(model, folder_config, task, row, report)
    tags = {"run": run_id, "base_encoding": run.encoding, "recipe": "none" if recipe is None else recipe.text}
    records = [{**record, **tags} for record in records]
    compute = {
        "base_encoding": run.encoding,
        "recipe": tags["recipe"],
        "steps_trained": steps,
        "positions_seen": seen,
        "wall_s": round(time.perf_counter() - started, 3),
    }
    return [*records, iid_record(records, task.metric, ext.to_len, base.fit_threshold, **compute)]
