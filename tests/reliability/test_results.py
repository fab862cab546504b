"""Nothing silent in results folders and the numbers read from them.

* Written whole: results, checkpoints and the config are written atomically with mode 0644 (a
  write that fails half way leaves the old file); a torn ``results.jsonl`` line names the file, the
  line and the fix.
* One folder, one result per measurement: a second ``results.jsonl`` (or ``runs.jsonl``) record of
  the same measurement with another value is an error naming the file and both lines (exact
  duplicates are kept once, the rule ``posenc merge`` applies between folders); every record's
  schema is checked when it is read, and an error names the file, the line and the field.
* Intervals across seeds are Student's t intervals: the quantile against tabulated values and the
  closed forms of 1 and 2 degrees of freedom, the distribution function against a numeric integral
  of the density, the coverage by simulation from a known normal (n = 3 and n = 10), and
  ``posenc compare`` on three small same-signed differences (+1%, +2%, +3%: "cannot tell").
* ``posenc merge`` keeps the shards' per-run records (``runs.jsonl``) under the same rules.
* Clear errors instead of tracebacks: an ``--out`` that cannot be created, a report that cannot be
  written, and long paths printed whole (never wrapped by the console inside a name).

Expected values come from tables (Student's t quantiles to six decimals), closed forms, numeric
integration, simulation, or sums written out by hand in the tests.
"""

from __future__ import annotations

import builtins
import errno
import json
import math
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from posenc.experiments import ExperimentConfig, run_experiment, summary_table
from posenc.experiments.cluster.shards import Shard, merge_folders
from posenc.experiments.results.compare import compare_rows
from posenc.experiments.results.records import (
    load_results,
    read_records,
    read_run_records,
    seed_interval,
)

from ._helpers import TINY_RUN

TINY = dict(
    task="copy",
    encodings=["nope", "alibi"],
    seeds=[0, 1],
    train_len=2,
    eval_len=3,
    num_symbols=8,
    d_model=16,
    num_layers=1,
    num_heads=2,
    d_ff=16,
    batch_size=4,
    steps=2,
    warmup=1,
    eval_examples=2,
    checkpoint_every=1,
    until_fit=True,
    fit_check_every=1,
)


def _app():
    from posenc.cli.app import app, load_command_modules

    load_command_modules()
    return app


def _invoke(args, columns=200):
    return CliRunner().invoke(_app(), [str(a) for a in args], env={"COLUMNS": str(columns)})


def _record(encoding, seed, length, value, train_len=2):
    return {"run": f"{encoding}__copy__seed{seed}", "encoding": encoding, "task": "copy", "seed": seed,
            "train_len": train_len, "steps": 1, "length": length, "metric": "exact_match", "value": value,
            "examples": 8}  # fmt: skip


def _write_folder(directory: Path, records, encodings=("rope", "nope"), seeds=(0,)) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    config = ExperimentConfig(
        task="copy", encodings=list(encodings), seeds=list(seeds), train_len=2, eval_len=4
    )
    (directory / "config.json").write_text(json.dumps({"experiment": config.to_dict(), "runtime": {}}))
    return directory


def _curves(encoding, seed, values):
    """Records at lengths 1..4 with ``values``."""
    return [_record(encoding, seed, n, v) for n, v in zip((1, 2, 3, 4), values)]


@pytest.fixture
def folder(tmp_path) -> Path:
    """rope fits (100% at L=2) and nope does not (0%), one seed: 8 records, lines 1..8."""
    records = _curves("rope", 0, (1.0, 1.0, 0.5, 0.25)) + _curves("nope", 0, (0.0, 0.0, 0.0, 0.0))
    return _write_folder(tmp_path / "run", records)


def _append(path: Path, line: str) -> int:
    """Append ``line`` to ``path``; its line number."""
    with path.open("a") as handle:
        handle.write(line + "\n")
    return len(path.read_text().splitlines())


def _plain(output: str) -> str:
    return " ".join(output.split())


# ---------------------------------------------------------------------------- written whole


def test_results_and_checkpoints_are_written_whole_with_mode_0644(tmp_path, monkeypatch):
    import os
    import stat

    from posenc.experiments import ExperimentConfig, run_experiment
    from posenc.experiments.results import records as results

    config = ExperimentConfig(
        task="copy", encodings=["nope"], train_len=2, eval_len=3, steps=2, checkpoint_every=1, **TINY_RUN
    )
    synced: list[int] = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd))[1])
    run_experiment(config, tmp_path, workers=1)
    written = ["results.jsonl", "results.csv", "config.json", "checkpoints/nope__copy__seed0.pt"]
    for name in written:
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == 0o644, name
    assert len(synced) >= len(written)
    assert not [p for p in tmp_path.rglob("*.tmp")]  # no temporary file left behind
    # A write that fails half way leaves the old file untouched.
    before = (tmp_path / "results.jsonl").read_bytes()

    def torn(handle):
        handle.write(b'{"run": "half')
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        results.atomic_write(tmp_path / "results.jsonl", torn)
    assert (tmp_path / "results.jsonl").read_bytes() == before
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_a_torn_results_line_names_the_file_line_and_fix(tmp_path):
    from posenc.experiments import ExperimentConfig, run_experiment

    config = ExperimentConfig(task="copy", encodings=["nope"], train_len=2, eval_len=3, steps=1, **TINY_RUN)
    first = run_experiment(config, tmp_path, workers=1)
    path = tmp_path / "results.jsonl"
    lines = path.read_text().splitlines()
    path.write_text("\n".join([*lines[:-1], lines[-1][:17]]) + "\n")  # the last line cut off
    with pytest.raises(
        ValueError,
        match=rf"results\.jsonl, line {len(lines)}: not a JSON record .*delete that line .*run the same command again",
    ):
        run_experiment(config, tmp_path, workers=1)
    path.write_text("\n".join(lines[:-1]) + "\n")  # the fix the message names
    again = run_experiment(config, tmp_path, workers=1)
    assert sorted(json_key(r) for r in again) == sorted(json_key(r) for r in first)


def json_key(record):
    return (record["length"], record["metric"], record["seed"])


# ---------------------------------------------------------------------------- one result per measurement


def test_a_second_different_record_of_one_measurement_is_an_error_naming_the_file_and_both_lines(folder):
    """The issue's case: nope's in-distribution score went from 0% to 12.5% with exit 0."""
    path = folder / "results.jsonl"
    nope_at_1 = json.loads(path.read_text().splitlines()[4])
    assert (nope_at_1["encoding"], nope_at_1["length"]) == ("nope", 1)
    line = _append(path, json.dumps({**nope_at_1, "value": 0.25}))
    pattern = (
        rf"results\.jsonl, lines 5 and {line}: two different results of one measurement .*nope.*0\.0 vs 0\.25"
    )
    with pytest.raises(ValueError, match=pattern):
        read_records(path)
    with pytest.raises(ValueError, match=pattern):
        load_results(folder)
    with pytest.raises(ValueError, match=pattern):
        compare_rows(folder, "rope", "nope")
    result = _invoke(["report", folder])
    assert result.exit_code == 2 and not (folder / "report.html").exists()
    assert f"{path}, lines 5 and {line}: two different results" in result.output


def test_exact_duplicate_records_in_one_folder_are_read_once_with_a_warning(folder):
    path = folder / "results.jsonl"
    first = path.read_text().splitlines()[0]
    _append(path, first)
    with pytest.warns(UserWarning, match=r"dropped 1 exact duplicate"):
        records = read_records(path)
    assert len(records) == 8 and records[0] == json.loads(first)


def test_a_conflict_in_a_folder_is_refused_when_the_runner_resumes_it(tmp_path):
    config = ExperimentConfig(**{**TINY, "encodings": ["nope"], "seeds": [0], "until_fit": False})
    run_experiment(config, tmp_path, workers=1)
    path = tmp_path / "results.jsonl"
    last = json.loads(path.read_text().splitlines()[-1])
    line = _append(path, json.dumps({**last, "value": last["value"] + 0.5}))
    with pytest.raises(
        ValueError, match=rf"results\.jsonl, lines {line - 1} and {line}: two different results"
    ):
        run_experiment(config, tmp_path, workers=1)


def test_a_conflict_in_runs_jsonl_is_an_error_too(folder):
    iid = {**_record("rope", 0, 2, 1.0), "metric": "iid", "fit": True, "steps_trained": 2}
    (folder / "runs.jsonl").write_text(
        json.dumps(iid) + "\n" + json.dumps({**iid, "fit": False, "value": 0.5}) + "\n"
    )
    with pytest.raises(ValueError, match=r"runs\.jsonl, lines 1 and 2: two different results"):
        read_run_records(folder)


BAD_LINES = [
    ('"value": "high"', "field 'value' must be a number, got 'high' \\(a string\\)"),
    ('"value": true', "field 'value' must be a number, got True \\(a boolean\\)"),
    ('"value": null', "field 'value' must be a number, got None \\(null\\)"),
    ('"length": "8"', "field 'length' must be a whole number >= 1, got '8' \\(a string\\)"),
    ('"length": 2.5', "field 'length' must be a whole number >= 1, got 2.5"),
    ('"length": 0', "field 'length' must be a whole number >= 1, got 0"),
    ('"seed": "0"', "field 'seed' must be a whole number, got '0'"),
    ('"encoding": 3', "field 'encoding' must be a non-empty string, got 3"),
    (
        '"metric": ["exact_match"]',
        "field 'metric' must be a non-empty string, got \\['exact_match'\\] \\(an array\\)",
    ),
    ('"examples": -1', "field 'examples' must be a whole number >= 0 or null, got -1"),
]


@pytest.mark.parametrize("edit, message", BAD_LINES, ids=[edit for edit, _ in BAD_LINES])
def test_a_record_of_the_wrong_type_names_the_file_line_and_field(folder, edit, message):
    path = folder / "results.jsonl"
    field = edit.split(":")[0].strip('"')
    record = {**_record("rope", 1, 1, 0.5), field: json.loads(edit.split(":", 1)[1])}
    line = _append(path, json.dumps(record))
    pattern = rf"results\.jsonl, line {line}: {message}.*correct or delete that line"
    with pytest.raises(ValueError, match=pattern):
        read_records(path)
    result = _invoke(["report", folder])
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit), result.output
    assert f"{path}, line {line}: field '{field}'" in result.output


@pytest.mark.parametrize(
    "line, message",
    [
        ("[1, 2]", "a record must be a JSON object with encoding, length, metric, value, got an array"),
        ("3", "a record must be a JSON object .* got a number"),
        ('"rope"', "a record must be a JSON object .* got a string"),
        ('{"encoding": "rope"}', "record lacks length, metric, value"),
        ('{"encoding": "rope", "value": 1}', "record lacks length, metric"),
    ],
)
def test_a_line_that_is_not_a_record_names_the_file_and_line_in_every_reader(folder, tmp_path, line, message):
    """The issue's tracebacks came from ``shards.py`` (merge, the missing-runs note) and the summary."""
    path = folder / "results.jsonl"
    number = _append(path, line)
    pattern = rf"results\.jsonl, line {number}: {message}"
    with pytest.raises(ValueError, match=pattern):
        read_records(path)
    with pytest.raises(ValueError, match=pattern):
        merge_folders(tmp_path / "merged", [folder])
    assert not (tmp_path / "merged").exists()
    for args in (["report", folder], ["compare", folder, "rope", "nope"], ["merge", tmp_path / "m", folder]):
        result = _invoke(args)
        assert result.exit_code == 2 and isinstance(result.exception, SystemExit), result.output
        assert f"{path}, line {number}: " in result.output


# ---------------------------------------------------------------------------- Student's t intervals


# Student's t quantiles t(p, df), as tabulated (e.g. NIST/SEMATECH e-Handbook, Table 1.4.2.7.3.3;
# R's qt), to six decimals.
T_TABLE = [
    (0.975, 1, 12.706205),
    (0.975, 2, 4.302653),
    (0.975, 3, 3.182446),
    (0.975, 4, 2.776445),
    (0.975, 9, 2.262157),
    (0.975, 30, 2.042272),
    (0.975, 100, 1.983972),
    (0.995, 5, 4.032143),
    (0.95, 10, 1.812461),
    (0.9, 20, 1.325341),
]


@pytest.mark.parametrize("p, df, expected", T_TABLE)
def test_t_quantile_matches_the_tables(p, df, expected):
    from posenc.experiments.results.stats import t_quantile

    assert t_quantile(p, df) == pytest.approx(expected, abs=1e-6)
    assert t_quantile(1 - p, df) == pytest.approx(-expected, abs=1e-6)


def test_t_quantile_matches_the_closed_forms_of_one_and_two_degrees_of_freedom_and_the_normal_limit():
    from statistics import NormalDist

    from posenc.experiments.results.stats import t_quantile

    for p in (0.001, 0.05, 0.3, 0.5, 0.6, 0.9, 0.975, 0.999):
        assert t_quantile(p, 1) == pytest.approx(
            math.tan(math.pi * (p - 0.5)), rel=1e-10, abs=1e-12
        )  # Cauchy
        assert t_quantile(p, 2) == pytest.approx(
            (2 * p - 1) / math.sqrt(2 * p * (1 - p)), rel=1e-10, abs=1e-12
        )
    assert t_quantile(0.975, 10**7) == pytest.approx(NormalDist().inv_cdf(0.975), abs=1e-6)
    for bad in ((0.0, 3), (1.0, 3), (0.5, 0)):
        with pytest.raises(ValueError, match="t_quantile"):
            t_quantile(*bad)


@pytest.mark.parametrize("df, t", [(3, 1.5), (7, -0.8), (2.5, 4.0), (30, 2.0)])
def test_t_cdf_equals_the_integral_of_the_density(df, t):
    """P(T <= t) = 1/2 + the integral of Γ((ν+1)/2) / (√(νπ) Γ(ν/2)) (1 + x²/ν)^(-(ν+1)/2) from 0 to t
    (Simpson's rule on 20,001 points)."""
    from posenc.experiments.results.stats import t_cdf

    x = np.linspace(0.0, t, 20_001)
    log_c = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)
    density = np.exp(log_c - (df + 1) / 2 * np.log1p(x * x / df))
    h = (x[1] - x[0]) if t else 0.0
    integral = h / 3 * (density[0] + density[-1] + 4 * density[1:-1:2].sum() + 2 * density[2:-1:2].sum())
    assert t_cdf(t, df) == pytest.approx(0.5 + integral, abs=1e-10)


@pytest.mark.parametrize("n", [3, 10])
def test_the_interval_across_seeds_covers_the_true_mean_95_percent_of_the_time(n):
    """Draws from a known normal (mean 0.3, sd 0.1), 40,000 samples of n: the share of intervals that
    hold 0.3 is 95% ± 2% (the simulation's own standard error is 0.1%). A percentile bootstrap of the
    mean (2,000 resamples, what `seed_interval` was) covers about 75% at n = 3 and 91% at n = 10."""
    from posenc.experiments.results.stats import t_interval

    rng = np.random.default_rng(22)
    samples = rng.normal(0.3, 0.1, size=(40_000, n))
    low, high = t_interval(samples)
    coverage = float(np.mean((low <= 0.3) & (high >= 0.3)))
    assert abs(coverage - 0.95) <= 0.02, coverage
    for k in range(3):  # seed_interval is the same interval, one sample at a time
        assert seed_interval(list(samples[k])) == pytest.approx((low[k], high[k]))


def test_seed_interval_by_hand_and_cut_to_bounds():
    # 0.01, 0.02, 0.03: mean 0.02, s = 0.01, so 0.02 ± 4.302653 · 0.01 / √3.
    half = 4.302653 * 0.01 / math.sqrt(3)
    assert seed_interval([0.01, 0.02, 0.03]) == pytest.approx((0.02 - half, 0.02 + half), abs=1e-8)
    assert seed_interval([0.01, 0.02, 0.03], bounds=(0.0, 1.0)) == pytest.approx((0.0, 0.02 + half), abs=1e-8)
    assert seed_interval([0.5]) is None and seed_interval([]) is None


def test_compare_three_small_same_signed_differences_cannot_tell(tmp_path):
    """Per-seed differences +1%, +2%, +3% (the issue's case): 0.02 ± t(0.975, 2)·0.01/√3 =
    [-0.48%, +4.48%], so "cannot tell" (the bootstrap said "a beats b")."""
    records = []
    for seed, diff in enumerate((0.01, 0.02, 0.03)):
        records += _curves("a", seed, (1.0, 1.0, 0.5 + diff, 0.5 + diff))
        records += _curves("b", seed, (1.0, 1.0, 0.5, 0.5))
    _write_folder(tmp_path, records, encodings=("a", "b"), seeds=(0, 1, 2))
    result = compare_rows(tmp_path, "a", "b")
    half = 4.302653 * 0.01 / math.sqrt(3)
    assert result.differences == pytest.approx([0.01, 0.02, 0.03])
    assert result.interval == pytest.approx((0.02 - half, 0.02 + half), abs=1e-8)
    assert result.verdict == "cannot tell"
    output = _invoke(["compare", tmp_path, "a", "b"])
    assert output.exit_code == 0, output.output
    assert (
        "mean difference a - b: +2.0% [95% interval -0.5%, +4.5%: Student's t on the 3 paired differences, "
        "2 degrees of freedom]" in output.output
    )
    assert "cannot tell: the interval contains 0" in output.output
    # Larger differences with the same spread do beat: +10%, +11%, +12% -> [+8.5%, +13.5%].
    records = []
    for seed, diff in enumerate((0.10, 0.11, 0.12)):
        records += _curves("a", seed, (1.0, 1.0, 0.5 + diff, 0.5 + diff)) + _curves(
            "b", seed, (1.0, 1.0, 0.5, 0.5)
        )
    _write_folder(tmp_path, records, encodings=("a", "b"), seeds=(0, 1, 2))
    assert compare_rows(tmp_path, "a", "b").verdict == "a"


def test_the_summary_table_names_its_interval_method():
    records = [
        r
        for seed, d in enumerate((0.01, 0.02, 0.03))
        for r in _curves("a", seed, (1.0, 1.0, 0.5 + d, 0.5 + d))
    ]
    config = ExperimentConfig(task="copy", encodings=["a"], seeds=[0, 1, 2], train_len=2, eval_len=4)
    table = summary_table(config, records, config.make_task().metric)
    # Beyond L per seed: 0.51, 0.52, 0.53 -> 0.52 ± 4.302653 · 0.01/√3 = [49.5%, 54.5%].
    assert table.rows[0][3] == "52.0% [49.5%, 54.5%]"
    assert any("95% Student's t interval of the mean across the n seeds" in note for note in table.notes)


# ---------------------------------------------------------------------------- merge keeps runs.jsonl


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    """Two shards of nope, alibi x seeds 0, 1 with --until-fit (their iid records have steps_to_fit)."""
    root = tmp_path_factory.mktemp("shards")
    config = ExperimentConfig(**TINY)
    for index in (0, 1):
        run_experiment(config, root / f"s{index}", workers=1, shard=Shard(index, 2))
    return root


def _lines(path: Path) -> list[str]:
    return sorted(json.dumps(json.loads(line), sort_keys=True) for line in path.read_text().splitlines())


def test_merge_keeps_every_shards_runs_records(shards, tmp_path):
    summary = merge_folders(tmp_path / "merged", [shards / "s0", shards / "s1"])
    expected = _lines(shards / "s0" / "runs.jsonl") + _lines(shards / "s1" / "runs.jsonl")
    assert len(expected) == 4 and summary.runs == 4  # one per (encoding, seed)
    assert _lines(tmp_path / "merged" / "runs.jsonl") == sorted(expected)
    runs = read_run_records(tmp_path / "merged")
    assert {(r["encoding"], r["seed"]) for r in runs} == {(e, s) for e in ("nope", "alibi") for s in (0, 1)}
    assert all(
        r["metric"] == "iid" and "steps_to_fit" in r and "steps_trained" in r and "fit" in r for r in runs
    )
    # The merged folder's table gives the steps each run took to fit, as an unsharded folder's does.
    config = ExperimentConfig(**TINY)
    table = summary_table(
        config, read_records(tmp_path / "merged" / "results.jsonl"), config.make_task().metric, runs
    )
    assert any("fit check passed at step" in note for note in table.notes)
    # Merging the merge with a shard again keeps each per-run record once.
    again = merge_folders(tmp_path / "again", [tmp_path / "merged", shards / "s0"])
    assert again.runs == 4 and _lines(tmp_path / "again" / "runs.jsonl") == sorted(expected)
    output = _invoke(["merge", tmp_path / "cli", shards / "s0", shards / "s1"])
    assert output.exit_code == 0 and "4 per-run records (runs.jsonl)" in output.output


def test_merge_refuses_two_different_runs_records_of_one_run(shards, tmp_path):
    shutil.copytree(shards / "s1", tmp_path / "other")
    path = tmp_path / "other" / "runs.jsonl"
    first, *rest = path.read_text().splitlines()
    edited = {**json.loads(first), "steps_to_fit": 12345}
    path.write_text("\n".join([json.dumps(edited), *rest]) + "\n")
    with pytest.raises(
        ValueError, match=r"other/runs\.jsonl and .*s1/runs\.jsonl both hold run .* different results"
    ):
        merge_folders(tmp_path / "merged", [shards / "s0", shards / "s1", tmp_path / "other"])
    assert not (tmp_path / "merged").exists()


# ---------------------------------------------------------------------------- clear errors


needs_proc = pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc")


@needs_proc
def test_an_out_folder_that_cannot_be_created_is_a_clear_error(folder):
    """``--out /proc/x``: the permission bits say writable to root, but nothing can be created."""
    from posenc.experiments.results.folders import folder_lock

    tiny = ["--encodings", "nope", "--train-len", "2", "--eval-len", "3", "--steps", "1", "--d-model", "16"]
    tiny += ["--num-layers", "1", "--d-ff", "16", "--eval-examples", "2", "--workers", "1", "--no-progress"]
    result = _invoke(["extrapolate", *tiny, "--out", "/proc/posenc-x"])
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit), result.output
    assert "--out /proc/posenc-x: nothing can be created in /proc" in result.output
    assert "give a writable folder" in result.output
    result = _invoke(["merge", "/proc/posenc-x", folder])
    assert result.exit_code == 2 and "--out /proc/posenc-x: nothing can be created in /proc" in result.output
    with (
        pytest.raises(ValueError, match=r"--out /proc/posenc-x/run: cannot create the folder"),
        folder_lock(Path("/proc/posenc-x/run")),
    ):
        pass


def _deny_writes_under(folder: Path, monkeypatch) -> None:
    """Make ``folder`` read-only: chmod, and where that does not bind (root), refuse writes under it
    as the kernel does for other users (EACCES from open, os.open and mkdir)."""
    folder.chmod(0o555)
    if os.geteuid() != 0:
        return
    inside = str(folder.resolve()) + os.sep

    def denied(path) -> bool:
        return str(Path(path).resolve()).startswith(inside) or Path(path).resolve() == folder.resolve()

    def refuse(path):
        raise PermissionError(errno.EACCES, "Permission denied", str(path))

    real_open, real_os_open, real_mkdir = builtins.open, os.open, os.mkdir

    def fake_open(file, mode="r", *args, **kwargs):
        if isinstance(file, (str, os.PathLike)) and any(c in mode for c in "wax+") and denied(file):
            refuse(file)
        return real_open(file, mode, *args, **kwargs)

    def fake_os_open(path, flags, *args, **kwargs):
        if flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT) and denied(path):
            refuse(path)
        return real_os_open(path, flags, *args, **kwargs)

    def fake_mkdir(path, *args, **kwargs):
        if denied(path):
            refuse(path)
        return real_mkdir(path, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", fake_open)
    monkeypatch.setattr(os, "open", fake_os_open)
    monkeypatch.setattr(os, "mkdir", fake_mkdir)
    monkeypatch.setattr(os, "access", lambda path, mode, **kw: not (mode & os.W_OK and denied(path)))


def test_report_on_a_read_only_folder_names_the_file_and_what_to_do(folder, tmp_path, monkeypatch):
    _deny_writes_under(folder, monkeypatch)
    try:
        result = _invoke(["report", folder])
        assert result.exit_code == 2 and isinstance(result.exception, SystemExit), result.output
        text = _plain(result.output)
        assert (
            f"cannot write the report to {folder / 'report.html'} (the default, inside the experiment folder)"
            in text
        )
        assert "write it elsewhere with --out FILE.html" in text
        result = _invoke(["report", folder, "--out", tmp_path / "elsewhere" / "report.html"])
        assert result.exit_code == 0, result.output
    finally:
        monkeypatch.undo()
        folder.chmod(0o755)
    assert (tmp_path / "elsewhere" / "report.html").read_text().startswith("<!DOCTYPE html>")


@needs_proc
def test_report_to_an_out_that_cannot_be_written_names_it(folder):
    result = _invoke(["report", folder, "--out", "/proc/posenc-report.html"])
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit), result.output
    assert (
        "cannot write the report to /proc/posenc-report.html: nothing can be created in /proc"
        in result.output
    )
    assert "give --out a writable FILE.html" in result.output


def test_long_paths_in_cli_errors_are_printed_whole(tmp_path):
    """On an 60-column console a 200-character path stays on one line (the console once broke it
    inside a name), and brackets in it are printed as they are, not read as Rich markup."""
    deep = tmp_path / ("a_long_folder_name_" * 6) / "[bold]results_of_the_sweep" / ("x" * 40)
    assert len(str(deep)) > 150
    result = _invoke(["report", deep], columns=60)
    assert result.exit_code == 2
    assert f"{deep / 'results.jsonl'} not found: is {deep} an experiment directory?" in result.output
    deep.parent.mkdir(parents=True)
    deep.write_text("a file, not a folder")
    tiny = ["--encodings", "nope", "--train-len", "2", "--eval-len", "3", "--steps", "1", "--no-progress"]
    result = _invoke(["extrapolate", *tiny, "--out", deep], columns=60)
    assert result.exit_code == 2, result.output
    assert f"--out {deep} is not a folder" in result.output
    result = _invoke(["compare", deep.parent, "a", "b"], columns=60)
    assert result.exit_code == 2 and f"{deep.parent / 'results.jsonl'} not found" in result.output
