"""What the report shows, read once from the experiment folder: :func:`read_folder` builds the
:class:`FolderView` that every section of the page renders.

The folder is read here and nowhere else in :mod:`posenc.viz.report`: ``results.jsonl`` once, as
:class:`~posenc.experiments.results.records.Record` (the one form every section and every experiment
function the report calls reads), ``config.json``, ``runs.jsonl``, and the ranking
(:func:`posenc.experiments.results.compare.rank_rows`). The sections draw figures from the view; only the
diagnostics open the checkpoints, and the published comparison the preset's sibling folders.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...experiments.cluster.shards import missing_units_note
from ...experiments.results.compare import Ranking, rank_rows
from ...experiments.results.records import (
    Record,
    as_records,
    experiment_settings,
    fit_notes,
    load_config,
    read_results,
    read_run_records,
)
from ...experiments.results.summary import SummaryTable, missing_runs_note, summary_table
from ...experiments.study.hf_study import study_summary
from ...experiments.study.reading import verdict_table
from ...experiments.tasks.catalog import TASKS, Metric
from ...experiments.train import ExperimentConfig
from ...experiments.variant_specs import row_labels

__all__ = ["FolderView", "Summary", "read_folder"]


@dataclass(frozen=True)
class Summary:
    """The fit table of a folder whose config names a known task and whose records score it."""

    table: SummaryTable
    #: The task's metric: the headline of the page.
    metric: Metric
    #: ``{row: "did not fit: iid 4.0%"}``.
    unfit: dict[str, str]
    #: The folder's settings as an :class:`ExperimentConfig` (rows, ``train_len``).
    experiment: ExperimentConfig


@dataclass(frozen=True)
class FolderView:
    """One experiment folder as the report reads it."""

    directory: Path
    #: ``config.json`` (empty when the folder has none) and its experiment settings.
    config: dict[str, Any]
    settings: dict[str, Any]
    #: ``results.jsonl``, one :class:`Record` per line (the summary, the missing-runs note and the
    #: depth map read these too).
    records: list[Record]
    #: The encodings in the config's order, then any others the records hold.
    encodings: list[str]
    #: The rows in the ranking's order, then the rest (the order of everything below the verdict).
    rows: list[str]
    #: Rows that are evaluation variants of an encoding (no untrained figure of their own).
    variants: frozenset[str]
    summary: Summary | None
    ranking: Ranking | None
    #: Why there is no ranking ("" when there is one or no summary to rank).
    why_unranked: str
    #: Which runs of the grid (a study's units) the folder lacks (a shard), or None.
    missing: str | None
    #: A context-extension study's table (perplexity by position, passkey by length: the table
    #: ``posenc extrapolate --hf-model M --task text`` prints), or None for other folders.
    study_table: SummaryTable | None = None
    #: A study's paired verdict (:func:`posenc.experiments.study.reading.verdict_table`), shown first;
    #: None for other folders and for a study with nothing past its context to compare.
    study_verdict: SummaryTable | None = None

    @property
    def headline(self) -> Metric | None:
        """The task's metric, when the folder has a summary."""
        return self.summary.metric if self.summary is not None else None

    @property
    def train_len(self) -> int | None:
        return self.summary.experiment.train_len if self.summary is not None else None

    @property
    def unfit(self) -> dict[str, str]:
        return self.summary.unfit if self.summary is not None else {}

    @property
    def pretrained(self) -> bool:
        """A pretrained model scored as it is (``--hf-model``): no trained checkpoints."""
        return "hf_model" in self.settings

    @property
    def study(self) -> bool:
        """A pretrained model's context-extension study, whose prompts are measured in tokens."""
        return bool(self.settings.get("study"))

    @property
    def preset(self) -> str | None:
        """The paper preset the folder was run with (``--preset``), if any."""
        return self.config.get("preset") or None


def read_folder(directory: str | Path) -> FolderView:
    """The :class:`FolderView` of experiment ``directory``; ``FileNotFoundError`` or ``ValueError``
    (:func:`~posenc.experiments.results.records.read_results`) when it holds no readable results."""
    directory = Path(directory)
    raw = read_results(directory)
    records = as_records(raw)
    config = load_config(directory)
    settings = experiment_settings(config)
    runs = read_run_records(directory)
    encodings = _encodings_in_order(records, settings)
    study = bool(settings.get("study"))
    summary = None if study else _summary(settings, records, runs)
    ranking, why = _ranking(directory) if summary is not None else (None, "")
    return FolderView(
        directory=directory,
        config=config,
        settings=settings,
        records=records,
        encodings=encodings,
        rows=_ranked_first(encodings, ranking),
        variants=frozenset(r.encoding for r in records if r.variant is not None),
        summary=summary,
        ranking=ranking,
        why_unranked=why,
        missing=missing_units_note(settings, runs) if study else _missing(settings, records),
        study_table=_study_table(settings, raw) if study else None,
        study_verdict=verdict_table(settings, raw) if study else None,
    )


def experiment_config(settings: dict[str, Any]) -> ExperimentConfig:
    """The :class:`ExperimentConfig` of ``settings`` (fields this version does not know are left out)."""
    return ExperimentConfig.from_settings(settings)


def _encodings_in_order(records: list[Record], settings: dict[str, Any]) -> list[str]:
    seen = list(dict.fromkeys(r.encoding for r in records))
    listed = [str(e) for e in settings.get("encodings", []) if str(e) in seen]
    return listed + [e for e in seen if e not in listed]


def _ranked_first(encodings: list[str], ranking: Ranking | None) -> list[str]:
    if ranking is None:
        return encodings
    return [r for r in ranking.rows if r in encodings] + [r for r in encodings if r not in ranking.rows]


def _study_table(settings: dict[str, Any], records: list[dict[str, Any]]) -> SummaryTable:
    """The study's table, as ``posenc extrapolate`` prints it (a study's ``task`` is ``text``,
    ``text-lm`` or ``text-passkey``: no synthetic task's fit table applies)."""
    return study_summary(settings, records)


def _summary(settings: dict[str, Any], records: list[Record], runs: list[dict[str, Any]]) -> Summary | None:
    """The fit table, when the settings name a known task and ``train_len`` and the records score it."""
    task = settings.get("task")
    if task not in TASKS or "train_len" not in settings:
        return None
    metric = TASKS[task].metric
    scored = [r for r in records if r.metric == metric.name]
    if not scored:
        return None
    experiment = experiment_config(settings)
    seen = list(dict.fromkeys(r.encoding for r in scored))
    listed = row_labels(experiment)  # the encodings, each followed by its variants
    rows = [e for e in listed if e in seen] + [e for e in seen if e not in listed]
    experiment = dataclasses.replace(
        experiment, encodings=rows, eval_variants=[], eval_len=max(experiment.eval_len, experiment.train_len)
    )
    table = summary_table(experiment, scored, metric, runs)
    unfit = fit_notes(scored, metric, experiment.train_len, rows, experiment.fit_threshold)
    return Summary(table, metric, unfit, experiment)


def _ranking(directory: Path) -> tuple[Ranking | None, str]:
    """``(ranking or None, why not)`` (:func:`posenc.experiments.results.compare.rank_rows`)."""
    try:
        return rank_rows(directory), ""
    except (ValueError, FileNotFoundError) as err:
        return None, str(err)


def _missing(settings: dict[str, Any], records: list[Record]) -> str | None:
    """Which runs of the (encoding x seed) grid have no results (a shard), or None."""
    if not {"task", "encodings", "seeds"} <= settings.keys():
        return None
    return missing_runs_note(settings["task"], settings["encodings"], settings["seeds"], records)
