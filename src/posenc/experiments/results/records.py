"""Tidy result records: atomic JSONL, CSV and the summary rows.

A record is one measurement: ``{"run", "encoding", "task", "seed", "length", "metric", "value",
"train_len", "steps", "examples"}``. ``results.jsonl`` holds one record per line and is always
rewritten whole through a temporary file and ``os.replace``, so a crash leaves either the old or
the new file, never a torn line.

This module is the one reader of an experiment directory (:func:`read_records`,
:func:`load_results`, :func:`load_config`); ``posenc report`` and ``posenc plot --run`` use it too.
The figures are drawn from the folder by :mod:`posenc.viz.folder`.
"""

from __future__ import annotations

import csv
import json
import math
import os
import tempfile
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from statistics import mean
from typing import TYPE_CHECKING, Any, BinaryIO

from .stats import INTERVAL_METHOD, t_interval

if TYPE_CHECKING:
    from ..tasks.catalog import Metric

__all__ = [
    "CIRCUMSTANCE_FIELDS",
    "INTERVAL_METHOD",
    "MEASUREMENT_KEY",
    "RECORD_FIELDS",
    "DepthCell",
    "Record",
    "SummaryRow",
    "append_records",
    "as_records",
    "atomic_write",
    "atomic_write_text",
    "check_record",
    "differing_fields",
    "experiment_settings",
    "fit_notes",
    "group_records",
    "iid_record",
    "load_config",
    "load_results",
    "measurement",
    "read_records",
    "read_results",
    "read_run_records",
    "seed_interval",
    "summarize",
    "wilson_interval",
    "write_csv",
]

RECORD_FIELDS = (
    "run",
    "encoding",
    "task",
    "seed",
    "length",
    "metric",
    "value",
    "train_len",
    "steps",
    "examples",
)


#: The mode of every file an experiment writes (results, config, checkpoints): readable by all.
FILE_MODE = 0o644


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically (temporary file in the same folder, fsync, rename)."""
    atomic_write(path, lambda handle: handle.write(text.encode("utf-8")))


def atomic_write(path: Path, write: Callable[[BinaryIO], Any]) -> None:
    """Call ``write(handle)`` on a temporary file beside ``path``, fsync it, give it mode 0644 and
    rename it over ``path``: a crash leaves the old file or the new one, never a torn one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
            os.fchmod(handle.fileno(), FILE_MODE)  # mkstemp makes it 0600
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    _fsync_folder(path.parent)


def cannot_create_in(folder: Path) -> str | None:
    """Why this process cannot create files in the existing folder ``folder`` (None when it can),
    found by creating and removing an empty probe folder there: permission bits do not tell for
    root, a read-only mount or a pseudo file system such as ``/proc``."""
    if not os.access(folder, os.W_OK | os.X_OK):
        return f"{folder} is not writable by this user"
    try:
        probe = tempfile.mkdtemp(prefix=".posenc-probe-", dir=folder)
    except OSError as err:
        return f"nothing can be created in {folder} ({err.strerror or err})"
    os.rmdir(probe)
    return None


def _fsync_folder(folder: Path) -> None:
    """Make a rename in ``folder`` durable (where the platform allows opening a folder)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


#: Fields a record must have to be read back (``task``, ``seed``, ``train_len`` are optional).
REQUIRED_FIELDS = ("encoding", "length", "metric", "value")

#: The fields that name one measurement: two records of one folder (or of the folders ``posenc
#: merge`` combines) with the same values here must be equal.
MEASUREMENT_KEY = ("run", "encoding", "task", "seed", "metric", "length", "variant")


def measurement(record: dict[str, Any]) -> tuple[Any, ...]:
    """The values of :data:`MEASUREMENT_KEY` of ``record`` (None where a field is absent)."""
    return tuple(record.get(name) for name in MEASUREMENT_KEY)


#: Fields that say how and where a record was measured, not what: how long a unit took
#: (``seconds``), the device or host it ran on. Two runs of one measurement differ in them and
#: still agree (:func:`differing_fields`); a merge keeps the first folder's.
CIRCUMSTANCE_FIELDS = frozenset({"seconds", "device", "host", "hostname"})


def differing_fields(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """The fields, in sorted order, in which records ``a`` and ``b`` of one measurement give
    different results (a field one lacks counts as different); :data:`CIRCUMSTANCE_FIELDS` are
    not compared. Empty: the two are the same result."""
    names = (a.keys() | b.keys()) - CIRCUMSTANCE_FIELDS
    return sorted(name for name in names if name not in a or name not in b or not _same(a[name], b[name]))


def _same(x: Any, y: Any) -> bool:
    """``x == y``, with nan equal to nan (a diverged run's ``value``, read twice from JSON, is one
    result: ``nan != nan`` made its exact duplicate "two different results")."""
    if isinstance(x, float) and isinstance(y, float) and math.isnan(x) and math.isnan(y):
        return True
    if isinstance(x, list) and isinstance(y, list):
        return len(x) == len(y) and all(_same(u, v) for u, v in zip(x, y))
    if isinstance(x, dict) and isinstance(y, dict):
        return x.keys() == y.keys() and all(_same(x[k], y[k]) for k in x)
    return x == y


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _json_type(value: Any) -> str:
    names = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null"}
    return names.get(type(value), "a number")


#: ``field: (check, what it must be)`` for the fields a reader uses (each optional one may be absent).
_FIELD_CHECKS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "encoding": (lambda v: isinstance(v, str) and v != "", "a non-empty string"),
    "metric": (lambda v: isinstance(v, str) and v != "", "a non-empty string"),
    "length": (lambda v: _is_int(v) and v >= 1, "a whole number >= 1"),
    "value": (_is_number, "a number"),
    "run": (lambda v: isinstance(v, str), "a string"),
    "task": (lambda v: isinstance(v, str), "a string"),
    "seed": (_is_int, "a whole number"),
    "variant": (lambda v: isinstance(v, str), "a string"),
    "train_len": (lambda v: v is None or (_is_int(v) and v >= 1), "a whole number >= 1 or null"),
    "examples": (lambda v: v is None or (_is_int(v) and v >= 0), "a whole number >= 0 or null"),
}

#: What to do about a record that cannot be read (appended to every such error).
_FIX_RECORD = (
    "correct or delete that line (deleting every record of its run makes posenc extrapolate redo the run)"
)


def check_record(raw: Any, where: str = "record") -> dict[str, Any]:
    """``raw`` if it is a well-formed record: a JSON object with :data:`REQUIRED_FIELDS`, each field
    of :data:`_FIELD_CHECKS` it holds of the right type; otherwise a ``ValueError`` naming ``where``
    (the file and line), the field, what it holds and what it must hold."""
    if not isinstance(raw, dict):
        raise ValueError(
            f"{where}: a record must be a JSON object with {', '.join(REQUIRED_FIELDS)}, got "
            f"{_json_type(raw)}; {_FIX_RECORD}"
        )
    missing = [f for f in REQUIRED_FIELDS if f not in raw]
    if missing:
        raise ValueError(
            f"{where}: record lacks {', '.join(missing)} (every record has {', '.join(REQUIRED_FIELDS)}); "
            f"{_FIX_RECORD}"
        )
    for name, (ok, what) in _FIELD_CHECKS.items():
        if name in raw and not ok(raw[name]):
            raise ValueError(
                f"{where}: field {name!r} must be {what}, got {raw[name]!r} ({_json_type(raw[name])}); "
                f"{_FIX_RECORD}"
            )
    return raw


@dataclass(frozen=True)
class DepthCell:
    """One needle-depth bucket of a retrieval record (``by_depth``, :mod:`posenc.experiments.tasks.retrieval`):
    the exact match ``value`` over the ``examples`` whose needle lay at depths ``low..high``."""

    bucket: int
    low: float
    high: float
    value: float
    examples: int

    @classmethod
    def from_dict(cls, raw: Any, where: str = "record") -> DepthCell:
        """A cell from its JSON form ``{"bucket", "depth": [low, high], "value", "examples"}``;
        ``ValueError`` naming ``where`` when it is not of that form."""
        try:
            low, high = raw["depth"]
            return cls(int(raw["bucket"]), float(low), float(high), float(raw["value"]), int(raw["examples"]))
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(
                f'{where}: field \'by_depth\' must be a list of {{"bucket", "depth": [low, high], "value", '
                f'"examples"}}, got {raw!r} ({err!r}); {_FIX_RECORD}'
            ) from err


@dataclass(frozen=True)
class Record:
    """One measurement: ``value`` of ``metric`` for ``encoding`` on ``task`` at ``length``."""

    encoding: str
    task: str
    length: int
    metric: str
    value: float
    seed: int
    train_length: int | None
    #: Examples the value was measured on (None in folders that did not record it).
    examples: int | None = None
    #: The evaluation variant the row is (``"yarn"``; a study's ``"none"``), None for a trained
    #: encoding's own row: a record *has* a variant when the file's line holds the field.
    variant: str | None = None
    #: A retrieval record's exact match per needle-depth bucket (empty without a breakdown).
    by_depth: tuple[DepthCell, ...] = ()

    @classmethod
    def from_dict(cls, raw: dict[str, Any], where: str = "record") -> Record:
        """A record from its JSON form; ``ValueError`` naming ``where`` when a field is missing or
        of the wrong type (:func:`check_record`)."""
        check_record(raw, where)
        train = raw.get("train_len", raw.get("train_length"))
        return cls(
            encoding=str(raw["encoding"]),
            task=str(raw.get("task", "")),
            length=int(raw["length"]),
            metric=str(raw["metric"]),
            value=float(raw["value"]),
            seed=int(raw.get("seed", 0)),
            train_length=None if train is None else int(train),
            examples=None if raw.get("examples") is None else int(raw["examples"]),
            variant=None if raw.get("variant") is None else str(raw["variant"]),
            by_depth=tuple(DepthCell.from_dict(cell, where) for cell in raw.get("by_depth") or ()),
        )


def as_records(records: Iterable[Record | dict[str, Any]]) -> list[Record]:
    """``records`` as :class:`Record`: the readers that take records take either form (a line of
    ``results.jsonl`` as :func:`read_records` returns it, or a :class:`Record`) and read this one."""
    return [r if isinstance(r, Record) else Record.from_dict(r) for r in records]


def _numbered_lines(path: Path) -> Iterator[tuple[int, Any]]:
    """``(line number, parsed JSON)`` for every non-blank line; ``ValueError`` naming a line that is not JSON."""
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            yield number, json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(
                f"{path}, line {number}: not a JSON record ({err.msg}), a torn or edited line; delete that "
                "line (or every record of its run) and run the same command again: runs with missing "
                "records are redone"
            ) from err


def _describe(record: dict[str, Any]) -> str:
    """``run 'rope-0', exact_match at length 4`` (the parts a record has)."""
    parts = [f"run {record['run']!r}"] if "run" in record else [f"{record.get('encoding')!r}"]
    if "seed" in record:
        parts.append(f"seed {record['seed']}")
    if record.get("variant"):
        parts.append(f"variant {record['variant']!r}")
    return ", ".join(parts) + f", {record.get('metric')} at length {record.get('length')}"


def _differences(a: dict[str, Any], b: dict[str, Any]) -> str:
    """``value 0.5 vs 0.25, steps 2 vs 3``: the fields in which ``a`` and ``b`` differ, with both values."""
    return ", ".join(f"{name} {a.get(name)!r} vs {b.get(name)!r}" for name in differing_fields(a, b))


def read_records(path: Path) -> list[dict[str, Any]]:
    """The records of ``path`` (an empty list when it does not exist), each checked
    (:func:`check_record`: a ``ValueError`` names the file, the line and the field).

    The rule ``posenc merge`` applies between folders holds inside one file too: exact duplicates
    are dropped with a warning naming the file (two writers once appended the same runs twice),
    and so are records that differ only in :data:`CIRCUMSTANCE_FIELDS` (the first is kept);
    two different records of one measurement (:data:`MEASUREMENT_KEY`) are a ``ValueError`` naming
    the file and both lines, never one silently winning."""
    if not path.exists():
        return []
    records: list[dict[str, Any]] = []
    seen: dict[tuple[Any, ...], tuple[dict[str, Any], int]] = {}
    duplicates = 0
    for number, raw in _numbered_lines(path):
        record = check_record(raw, f"{path}, line {number}")
        key = measurement(record)
        if key in seen:
            kept, line = seen[key]
            if differing_fields(kept, record):
                raise ValueError(
                    f"{path}, lines {line} and {number}: two different results of one measurement "
                    f"({_describe(record)}: {_differences(kept, record)}); keep "
                    "the right one and delete the other line (or delete every record of that run, so "
                    "posenc extrapolate redoes it)"
                )
            duplicates += 1
            continue
        seen[key] = (record, number)
        records.append(record)
    if duplicates:
        warnings.warn(f"{path}: dropped {duplicates} exact duplicate record(s)", stacklevel=2)
    return records


def read_results(directory: str | Path) -> list[dict[str, Any]]:
    """The checked records of ``directory/results.jsonl`` as the file holds them (:func:`read_records`);
    ``FileNotFoundError`` without the file, ``ValueError`` naming a malformed line or an empty file."""
    path = Path(directory) / "results.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: is {directory} an experiment directory?")
    records = read_records(path)
    if not records:
        raise ValueError(f"{path} holds no results")
    return records


def load_results(directory: str | Path) -> list[Record]:
    """The checked records of ``directory/results.jsonl`` (:func:`read_results`) as :class:`Record`."""
    return [Record.from_dict(raw) for raw in read_results(directory)]


def load_config(directory: str | Path) -> dict[str, Any]:
    """``directory/config.json`` as a dict (empty when the run wrote none)."""
    path = Path(directory) / "config.json"
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise ValueError(
            f"{path} is not valid JSON ({err.msg}, line {err.lineno}); restore it, or delete it to let the "
            "next run rewrite it (results.jsonl is kept)"
        ) from err
    if not isinstance(config, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(config).__name__}")
    return config


def experiment_settings(config: dict[str, Any]) -> dict[str, Any]:
    """The experiment's settings: the runner nests them under ``"experiment"`` (beside ``"runtime"``)."""
    settings = config.get("experiment", config)
    return settings if isinstance(settings, dict) else {}


def append_records(path: Path, records: Iterable[dict[str, Any]]) -> None:
    """Add ``records`` to the JSONL file at ``path`` (rewritten atomically), replacing any earlier
    records of the same runs (an unfinished run that is run again)."""
    records = list(records)
    runs = {record.get("run") for record in records}
    kept = [record for record in read_records(path) if record.get("run") not in runs]
    lines = [json.dumps(record, sort_keys=False) for record in [*kept, *records]]
    atomic_write_text(path, "".join(line + "\n" for line in lines))


def write_csv(path: Path, records: list[dict[str, Any]]) -> None:
    """The records as a CSV with the columns of :data:`RECORD_FIELDS` (written atomically)."""
    import io

    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=RECORD_FIELDS, extrasaction="ignore")
    writer.writeheader()
    writer.writerows(records)
    atomic_write_text(path, buffer.getvalue())


def group_records(records: list[Record]) -> dict[tuple[str, str, str], dict[int, list[float]]]:
    """``{(task, metric, encoding): {length: [value per seed]}}``."""
    grouped: dict[tuple[str, str, str], dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    for r in records:
        grouped[(r.task, r.metric, r.encoding)][r.length].append(r.value)
    return grouped


class SummaryRow(dict):
    """``encoding``, ``at_train`` (metric at the training length), ``beyond`` (mean over lengths
    above it), ``at_next`` (at L+1), ``at_double`` (at 2L); None where not measured.

    Per seed, then summarised: ``iid`` (the in-distribution score: mean over lengths ``<= L``),
    ``fit`` (how many seeds reach ``fit_threshold`` there; None when no threshold applies),
    ``beyond_interval`` (the 95% Student's t interval of the mean beyond ``L`` across seeds,
    :func:`seed_interval`; None with fewer than two seeds)."""


def seed_interval(
    values: list[float], level: float = 0.95, bounds: tuple[float, float] | None = None
) -> tuple[float, float] | None:
    """The Student's t interval of the mean of per-seed ``values`` (None with fewer than 2):
    ``mean ± t_{(1+level)/2, n-1} · s / √n`` (:func:`posenc.experiments.results.stats.t_interval`; it keeps
    its level at the 2-10 seeds people run, where a bootstrap of the mean does not). ``bounds``: the
    range the mean cannot leave (``(0, 1)`` for a fraction such as exact match); the interval is
    cut to it, which keeps its coverage."""
    if len(values) < 2:
        return None
    low, high = t_interval(values, level)
    if bounds is not None:
        low, high = max(low, bounds[0]), min(high, bounds[1])
    return low, high


def wilson_interval(successes: float, trials: int, z: float = 1.959964) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion (95% with the default ``z``).

    ``(p + z²/2n ± z·sqrt(p(1-p)/n + z²/4n²)) / (1 + z²/n)`` with ``p = successes / trials``
    (Wilson 1927); unlike the normal interval it stays inside [0, 1] and is not empty at 0 or 1.
    """
    if trials < 1:
        raise ValueError(f"wilson_interval: trials must be >= 1, got {trials}")
    p = successes / trials
    z2 = z * z
    centre = p + z2 / (2 * trials)
    half = z * math.sqrt(p * (1 - p) / trials + z2 / (4 * trials * trials))
    scale = 1 + z2 / trials
    return max(0.0, (centre - half) / scale), min(1.0, (centre + half) / scale)


#: The ``metric`` of the one per-run record that gives the run's in-distribution score.
IID = "iid"
#: Metrics recorded once per run (at the training length), not at every evaluated length.
RUN_METRICS = (IID,)
#: The file of the per-run records (``results.jsonl`` keeps one record per length).
RUNS_FILE = "runs.jsonl"


def split_run_records(records: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """``(per-length records, per-run records)``: the latter are those of :data:`RUN_METRICS`."""
    per_run = [record for record in records if record.get("metric") in RUN_METRICS]
    return [record for record in records if record.get("metric") not in RUN_METRICS], per_run


def read_run_records(directory: str | Path) -> list[dict[str, Any]]:
    """The per-run records (``iid``) of an experiment folder; empty for folders written before them."""
    return read_records(Path(directory) / RUNS_FILE)


def iid_record(
    records: list[dict[str, Any]], metric: Metric, train_len: int, fit_threshold: float, **extra: Any
) -> dict[str, Any]:
    """The run's ``metric: "iid"`` record from its per-length ``records``.

    ``value``: for a metric that ``fits`` (exact match), the mean over lengths ``<= train_len``
    (every length has the same number of examples, so this is the exact match over all of them);
    otherwise (perplexity) the value at ``train_len``. ``fit``: ``value >= fit_threshold``, or None
    for a metric without fit. ``examples``: how many examples the value rests on. ``extra`` (the
    steps it trained, the step it fitted at) joins the record.
    """
    own = [r for r in records if r["metric"] == metric.name]
    inside = [r for r in own if r["length"] <= train_len]
    if not inside:
        raise ValueError(f"no {metric.name} records at lengths <= {train_len} to score in-distribution")
    if metric.fits:
        value = float(mean(r["value"] for r in inside))
        examples = sum(int(r.get("examples") or 0) for r in inside)
    else:
        at_train = max(inside, key=lambda r: r["length"])
        value, examples = float(at_train["value"]), int(at_train.get("examples") or 0)
    base = {k: v for k, v in own[0].items() if k not in ("length", "metric", "value", "examples")}
    base = {k: v for k, v in base.items() if k in RECORD_FIELDS or k in ("variant", "trained_encoding")}
    return {
        **base,
        "length": train_len,
        "metric": IID,
        "value": value,
        "examples": examples,
        "scored_by": metric.name,
        "fit": value >= fit_threshold if metric.fits else None,
        "fit_threshold": fit_threshold if metric.fits else None,
        **extra,
    }


def fit_notes(
    records: Sequence[Record | dict[str, Any]],
    metric: Metric,
    train_len: int,
    encodings: list[str],
    fit_threshold: float,
) -> dict[str, str]:
    """``{encoding: "did not fit: iid 4.0%"}`` for each encoding some seed of which does not reach
    ``fit_threshold`` in-distribution (empty for a metric without fit: perplexity)."""
    if not metric.fits:
        return {}
    rows = summarize(records, metric.name, train_len, encodings, fit_threshold)
    return {
        row["encoding"]: f"did not fit: iid {metric.format(row['iid'])}"
        for row in rows
        if row["fit"] is not None and row["fit"] < row["seeds"]
    }


def _per_seed(records: list[Record]) -> dict[str, dict[int, dict[int, float]]]:
    """``{encoding: {seed: {length: value}}}``."""
    table: dict[str, dict[int, dict[int, float]]] = defaultdict(lambda: defaultdict(dict))
    for r in records:
        table[r.encoding][r.seed][r.length] = r.value
    return table


def summarize(
    records: Sequence[Record | dict[str, Any]],
    metric: str,
    train_len: int,
    encodings: list[str],
    fit_threshold: float | None = None,
    bounds: tuple[float, float] | None = None,
) -> list[SummaryRow]:
    """One :class:`SummaryRow` per encoding (in ``encodings`` order), averaged over seeds.

    ``fit_threshold``: a seed fits when its in-distribution score reaches it (exact match); None for
    metrics without one (perplexity). ``bounds``: the range of the metric, which the intervals are
    cut to (``(0, 1)`` for exact match).
    """
    rows_of_metric = [r for r in as_records(records) if r.metric == metric]
    curves = {encoding: cells for (_, _, encoding), cells in group_records(rows_of_metric).items()}
    seeds = _per_seed(rows_of_metric)
    rows = []
    for encoding in encodings:
        by_length = {length: mean(values) for length, values in curves.get(encoding, {}).items()}
        beyond = [value for length, value in by_length.items() if length > train_len]
        per_seed = seeds.get(encoding, {})
        iid = [
            mean(v for n, v in c.items() if n <= train_len) for c in per_seed.values() if min(c) <= train_len
        ]
        beyond_per_seed = [
            mean(v for n, v in c.items() if n > train_len) for c in per_seed.values() if max(c) > train_len
        ]
        rows.append(
            SummaryRow(
                encoding=encoding,
                seeds=max((len(v) for v in curves.get(encoding, {}).values()), default=0),
                at_train=by_length.get(train_len),
                beyond=mean(beyond) if beyond else None,
                at_next=by_length.get(train_len + 1),
                at_double=by_length.get(2 * train_len),
                iid=mean(iid) if iid else None,
                fit=None if fit_threshold is None or not iid else sum(v >= fit_threshold for v in iid),
                beyond_interval=seed_interval(beyond_per_seed, bounds=bounds),
            )
        )
    return rows
