"""Slurm: ``--shard slurm``, ``posenc submit`` (job array + merge job) and ``posenc slurm-torchrun``.

The first part needs no Slurm: the environment is monkeypatched, ``sbatch``/``squeue`` are fakes,
and the generated scripts are run with ``bash`` as Slurm would run them. The tests marked ``slurm``
submit to a real Slurm (``scripts/slurm_one_node.sh start``) and are skipped when ``sinfo`` does not
answer; CI runs them in a stage of their own
(``python -m pytest -m slurm tests/experiments/cluster/test_slurm.py``).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from posenc.experiments import ExperimentConfig, run_experiment
from posenc.experiments.cluster.shards import Shard
from posenc.experiments.cluster.slurm import (
    SlurmOptions,
    missing_shards,
    shard_folder,
    submit,
)

ROOT = Path(__file__).resolve().parents[3]


# ---------------------------------------------------------------------------- --shard slurm


def _array_env(task: int, low: int, high: int, count: int | None = None, step: int | None = None) -> dict:
    env = {
        "SLURM_ARRAY_TASK_ID": str(task),
        "SLURM_ARRAY_TASK_MIN": str(low),
        "SLURM_ARRAY_TASK_MAX": str(high),
    }
    if count is not None:
        env["SLURM_ARRAY_TASK_COUNT"] = str(count)
    if step is not None:
        env["SLURM_ARRAY_TASK_STEP"] = str(step)
    return env


def test_cli_shard_slurm_in_an_array_task_runs_its_shard(tmp_path, monkeypatch):
    from posenc.cli.app import app, load_command_modules

    load_command_modules()
    # sbatch --array=1-2, its second task: shard 1/2 of nope0 alibi0 nope1 alibi1 (seed-major).
    for name, value in _array_env(2, 1, 2, 2, 1).items():
        monkeypatch.setenv(name, value)
    out = tmp_path / "part"
    result = CliRunner().invoke(
        app,
        ["extrapolate", *TINY_ARGS, "--shard", "slurm", "--workers", "1", "--no-progress", "--out", str(out)],
    )
    assert result.exit_code == 0, result.output
    assert json.loads((out / "config.json").read_text())["runtime"]["shard"] == "1/2"
    records = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert {(r["encoding"], r["seed"]) for r in records} == {("alibi", 0), ("alibi", 1)}


def test_cli_shard_slurm_outside_an_array_is_a_usage_error_naming_the_variables(tmp_path, monkeypatch):
    from posenc.cli.app import app, load_command_modules

    load_command_modules()
    for name in [k for k in os.environ if k.startswith("SLURM_")]:
        monkeypatch.delenv(name)
    result = CliRunner().invoke(app, ["extrapolate", "--shard", "slurm", "--out", str(tmp_path / "x")])
    assert result.exit_code == 2
    assert "SLURM_ARRAY_TASK_ID" in result.output and "SLURM_ARRAY_TASK_COUNT" in result.output
    assert not (tmp_path / "x").exists()


# ---------------------------------------------------------------------------- submit without Slurm

TINY = dict(
    task="copy", encodings=["nope", "alibi"], seeds=[0, 1], train_len=2, eval_len=3, num_symbols=8, d_model=8,
    num_layers=1, num_heads=1, d_ff=8, batch_size=2, steps=3, eval_examples=2,
)  # fmt: skip

#: TINY as ``posenc extrapolate`` options (warmup left at its default, as in TINY).
TINY_ARGS = [
    "--encodings", "nope,alibi", "--seeds", "0,1", "--train-len", "2", "--eval-len", "3", "--num-symbols", "8",
    "--d-model", "8", "--num-layers", "1", "--num-heads", "1", "--d-ff", "8", "--batch-size", "2",
    "--steps", "3", "--eval-examples", "2",
]  # fmt: skip


class FakeSlurm:
    """``sbatch`` and ``squeue`` answered in process: job ids from 100, a queue we set."""

    def __init__(self) -> None:
        self.calls: list[list[str]] = []
        self.queue: list[str] = []

    def __call__(self, argv: list[str]) -> str:
        self.calls.append(argv)
        if argv[0] == "sbatch":
            return f"{100 + len(self.sbatch())};cluster\n"
        if argv[0] == "squeue":
            return "".join(job + "\n" for job in self.queue)
        raise AssertionError(argv)

    def sbatch(self) -> list[list[str]]:
        return [call for call in self.calls if call[0] == "sbatch"]


def test_submit_writes_an_array_and_a_merge_job_then_resubmits_only_what_is_missing(tmp_path):
    config = ExperimentConfig(**TINY)
    out = tmp_path / "grid"
    slurm = FakeSlurm()
    options = SlurmOptions(partition="cpu", time="0:10:00", cpus=2, mem="4G", gpus="a100:1", account="lab")
    done = submit(config, out, TINY_ARGS, options=options, run=slurm)
    assert (done.array_job, done.merge_job, done.shards, done.count) == ("101", "102", [0, 1, 2, 3], 4)
    assert len(done.missing) == 4
    array, merge = slurm.sbatch()
    assert array == ["sbatch", "--parsable", "--array=0-3", str(out / "slurm" / "array.sh")]
    assert merge == [
        "sbatch", "--parsable", "--dependency=afterok:101", "--kill-on-invalid-dep=yes", str(out / "slurm" / "merge.sh")
    ]  # fmt: skip
    script = (out / "slurm" / "array.sh").read_text()
    for line in (
        "--partition=cpu",
        "--time=0:10:00",
        "--cpus-per-task=2",
        "--mem=4G",
        "--gpus-per-node=a100:1",
    ):
        assert f"#SBATCH {line}\n" in script
    assert "#SBATCH --account=lab\n" in script and "--nodes" not in script
    assert f'--shard "$i"/4 --out {out}/shards/"$i"of4 --no-progress --workers 2' in script
    assert shlex.join(TINY_ARGS) in script
    merge_script = (out / "slurm" / "merge.sh").read_text()
    assert "#SBATCH --partition=cpu\n" in merge_script and "cpus-per-task" not in merge_script
    assert "gpus" not in merge_script
    assert json.loads((out / "slurm" / "submit.json").read_text())["jobs"] == [
        {"array": "101", "merge": "102"}
    ]

    # While the array is queued, a rerun is refused (it would start a second writer per shard).
    slurm.queue = ["101", "77"]
    with pytest.raises(ValueError, match=r"job\(s\) 101 of an earlier posenc submit are still queued"):
        submit(config, out, TINY_ARGS, options=options, run=slurm)
    slurm.queue = []

    # Shards 0 and 2 finished, 1 and 3 did not (a task cancelled, one never started): only they go again.
    for index in (0, 2):
        run_experiment(config, shard_folder(out, Shard(index, 4)), workers=1, shard=Shard(index, 4))
    again = submit(config, out, TINY_ARGS, options=options, run=slurm)
    assert again.shards == [1, 3] and [(r.encoding, r.seed) for r in again.missing] == [
        ("alibi", 0),
        ("alibi", 1),
    ]
    assert slurm.sbatch()[-2][2] == "--array=1,3"
    assert slurm.sbatch()[-1][2] == f"--dependency=afterok:{again.array_job}"

    # Every shard finished, the merge job did not run: the merge alone, with no dependency.
    for index in (1, 3):
        run_experiment(config, shard_folder(out, Shard(index, 4)), workers=1, shard=Shard(index, 4))
    merge_only = submit(config, out, TINY_ARGS, options=options, run=slurm)
    assert merge_only.array_job is None and merge_only.merge_job is not None
    assert slurm.sbatch()[-1] == ["sbatch", "--parsable", str(out / "slurm" / "merge.sh")]

    # Merged: nothing to submit.
    calls = len(slurm.sbatch())
    subprocess.run(
        ["bash", str(out / "slurm" / "merge.sh")], check=True, capture_output=True, env=_python_env()
    )
    assert submit(config, out, TINY_ARGS, options=options, run=slurm).complete
    assert len(slurm.sbatch()) == calls


def test_submit_refuses_other_settings_another_array_size_and_bad_options(tmp_path):
    config = ExperimentConfig(**TINY)
    slurm = FakeSlurm()
    submit(config, tmp_path, TINY_ARGS, array_size=2, run=slurm)
    with pytest.raises(ValueError, match=r"other settings \(steps: 3 there vs 4 now\)"):
        submit(ExperimentConfig(**{**TINY, "steps": 4}), tmp_path, TINY_ARGS, array_size=2, run=slurm)
    with pytest.raises(ValueError, match=r"submitted as 2 array tasks, now --array-size 4"):
        submit(config, tmp_path, TINY_ARGS, run=slurm)
    with pytest.raises(ValueError, match=r"--array-size must be between 1 and the grid's 4 runs"):
        submit(config, tmp_path / "b", TINY_ARGS, array_size=5, run=slurm)
    with pytest.raises(ValueError, match=r"--mem must be one word"):
        SlurmOptions(mem="4 G")
    for value in ("bob's", "lab#2", 'a"b'):  # sbatch would read a quote or a comment in the #SBATCH line
        with pytest.raises(
            ValueError, match=r"--account must be one word without spaces, quotes, backslashes or '#'"
        ):
            SlurmOptions(account=value)
    with pytest.raises(ValueError, match=r"--cpus must be an integer >= 1"):
        SlurmOptions(cpus=0)
    with pytest.raises(ValueError, match=r"--workers cannot be combined with --nodes"):
        submit(config, tmp_path / "c", TINY_ARGS, options=SlurmOptions(nodes=2), workers=2, run=slurm)


class MergeRefused(FakeSlurm):
    """FakeSlurm whose ``sbatch merge.sh`` fails (a bad option, the controller down) while ``refuse``."""

    refuse = True

    def __call__(self, argv: list[str]) -> str:
        if argv[0] == "sbatch" and argv[-1].endswith("merge.sh") and self.refuse:
            self.calls.append(argv)
            raise ValueError(f"{shlex.join(argv)} failed (exit 1): Socket timed out on send/recv operation")
        return super().__call__(argv)


def test_a_rerun_after_the_merge_failed_to_submit_submits_the_merge_alone_after_the_queued_array(tmp_path):
    """The array was queued, the merge's sbatch failed: the array is recorded at once, so the rerun
    submits no second array (whose tasks would write the same shard folders) but the merge job,
    after that array."""
    config = ExperimentConfig(**TINY)
    out = tmp_path / "grid"
    slurm = MergeRefused()
    with pytest.raises(ValueError) as failed:
        submit(config, out, TINY_ARGS, run=slurm)
    slurm.refuse, slurm.queue = False, ["101"]  # the array still runs
    calls = len(slurm.sbatch())
    again = submit(config, out, TINY_ARGS, run=slurm)
    assert slurm.sbatch()[calls:] == [
        ["sbatch", "--parsable", "--dependency=afterok:101", "--kill-on-invalid-dep=yes", str(out / "slurm" / "merge.sh")]
    ]  # fmt: skip
    # The first error said so: the array is queued, rerun for the merge.
    assert "array job 101 is queued" in str(failed.value) and "Socket timed out" in str(failed.value)
    assert "run this command again: it submits the merge job alone, after array job 101" in str(failed.value)
    record = out / "slurm" / "submit.json"
    assert again.earlier_array and (again.array_job, again.merge_job) == ("101", "103")
    assert again.shards == [0, 1, 2, 3] and again.commands == slurm.sbatch()[calls:]
    assert json.loads(record.read_text())["jobs"] == [{"array": "101", "merge": "103"}]
    # Both jobs are recorded and queued now: a third run is refused as before.
    slurm.queue = ["101", "103"]
    with pytest.raises(ValueError, match=r"job\(s\) 101, 103 of an earlier posenc submit are still queued"):
        submit(config, out, TINY_ARGS, run=slurm)


def test_submit_across_nodes_runs_slurm_torchrun_under_srun(tmp_path):
    done = submit(
        ExperimentConfig(**TINY),
        tmp_path,
        TINY_ARGS,
        options=SlurmOptions(nodes=2, nproc_per_node=4),
        dry_run=True,
    )
    script = done.array_script.read_text()
    assert "#SBATCH --nodes=2\n#SBATCH --ntasks-per-node=1\n" in script
    assert (
        f"exec srun {shlex.quote(sys.executable)} -m posenc slurm-torchrun --nproc-per-node=4 -- extrapolate "
        in script
    )
    assert "--workers" not in script
    assert not (tmp_path / "slurm" / "submit.json").exists(), "a dry run submits nothing"


def _python_env() -> dict[str, str]:
    """This process's environment with this checkout's ``src`` first (the scripts run ``python -m posenc``)."""
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
    }


def test_the_generated_scripts_run_as_slurm_would_run_them(tmp_path):
    """bash array.sh with SLURM_ARRAY_TASK_ID set, per task, then bash merge.sh: the merged folder
    equals one unsharded run, record for record."""
    config = ExperimentConfig(**TINY)
    out = tmp_path / "grid"
    submit(config, out, TINY_ARGS, array_size=2, run=FakeSlurm())
    for task in (0, 1):
        env = {**_python_env(), "SLURM_ARRAY_TASK_ID": str(task), "OMP_NUM_THREADS": "1"}
        subprocess.run(["bash", str(out / "slurm" / "array.sh")], check=True, capture_output=True, env=env)
    assert missing_shards(config, out, 2) == ([], [])
    merged = subprocess.run(
        ["bash", str(out / "slurm" / "merge.sh")],
        check=True,
        capture_output=True,
        text=True,
        env=_python_env(),
    )
    assert "complete: every (encoding, seed) run" in merged.stdout
    run_experiment(config, tmp_path / "full", workers=1)
    assert _records(out) == _records(tmp_path / "full")
    assert _records(out, "runs.jsonl") == _records(tmp_path / "full", "runs.jsonl")


def _sbatch_words(line: str) -> list[str]:
    """The words sbatch reads from what follows ``#SBATCH``, split as ``_get_argument`` of Slurm's
    ``src/sbatch/opt.c`` splits them: a backslash keeps the next character (inside quotes too),
    ``"`` or ``'`` quotes up to the same quote (spaces and ``#`` kept, the quotes dropped), unquoted
    whitespace ends a word and an unquoted ``#`` the line; an unmatched quote is fatal."""
    words: list[str] = []
    word: list[str] | None = None
    quote, escaped = None, False
    for char in line:
        if escaped or (quote and char != quote and char != "\\"):
            word, escaped = [*(word or []), char], False
        elif char == "\\":
            word, escaped = word or [], True
        elif char == quote:
            quote = None
        elif char in "\"'" and not quote:
            word, quote = word or [], char
        elif char == "#":
            break
        elif char.isspace():
            if word is not None:
                words.append("".join(word))
            word = None
        else:
            word = [*(word or []), char]
    assert quote is None, f"sbatch: Unmatched `{quote}` in [{line}]"
    return words if word is None else [*words, "".join(word)]


def _sbatch_options(script: str) -> dict[str, str]:
    """``{"--output": value, ...}``: the ``--option=value`` words of the script's ``#SBATCH`` lines."""
    header = [line[len("#SBATCH") :] for line in script.splitlines() if line.startswith("#SBATCH")]
    words = [word for line in header for word in _sbatch_words(line)]
    for word in words:
        assert re.match(r"--[a-z-]+=", word), (
            f"sbatch: error: Invalid directive found in batch script: {word}"
        )
    return dict(word.split("=", 1) for word in words)


def _slurm_log_file(pattern: str, job: int, task: int) -> str:
    """The file Slurm writes array task ``task`` of job ``job`` to, from ``--output``'s pattern
    (``src/slurmd/common/fname.c``): ``%%`` is ``%``, ``%A`` the array job, ``%a`` the task,
    ``%j`` the task's own job id (``job + task + 1`` here)."""
    assert "\\" not in pattern, "a backslash turns Slurm's substitution off"
    values = {"%": "%", "A": str(job), "a": str(task), "j": str(job + task + 1)}
    return re.sub(r"%(.)", lambda match: values.get(match[1], match[0]), pattern)


@pytest.mark.parametrize("name", ["my study", "bob's", 'the "best" run', "100%done #2", "a'b\"c d"])
def test_the_sbatch_lines_and_the_scripts_carry_any_out_folder(tmp_path, name):
    """An --out with spaces, quotes, % or #: sbatch reads the #SBATCH lines as the job name and the
    log files in OUT/slurm/logs, and bash runs the scripts on OUT (a fake python logs its arguments)."""
    out = tmp_path / "runs" / name
    python = tmp_path / "my bin" / "python"
    python.parent.mkdir()
    python.write_text(f"#!/bin/sh\nprintf '%s\\n' \"$@\" >> {shlex.quote(str(tmp_path / 'argv'))}\n")
    python.chmod(0o755)
    done = submit(ExperimentConfig(**TINY), out, TINY_ARGS, python=str(python), dry_run=True)
    array, merge = (_sbatch_options(path.read_text()) for path in (done.array_script, done.merge_script))
    logs = out / "slurm" / "logs"
    assert _slurm_log_file(array["--output"], 7, 2) == str(logs / "array-7_2.out")
    assert _slurm_log_file(merge["--output"], 9, 0) == str(logs / "merge-10.out")
    assert (array["--job-name"], merge["--job-name"]) == (f"posenc-{name}", f"posenc-{name}-merge")

    env = {**os.environ, "SLURM_ARRAY_TASK_ID": "1"}
    subprocess.run(["bash", str(done.array_script)], check=True, env=env)
    (out / "shards" / "0of4").mkdir(parents=True)
    subprocess.run(["bash", str(done.merge_script)], check=True)
    argv = (tmp_path / "argv").read_text().splitlines()
    task, merged = argv[: argv.index("merge") - 2], argv[argv.index("merge") - 2 :]
    assert task[task.index("--out") + 1] == str(out / "shards" / "1of4")
    assert merged == ["-m", "posenc", "merge", str(out), str(out / "shards" / "0of4")]


@pytest.mark.parametrize(
    "name, named",
    [
        ("two\nlines", r"holds '\n', a control character"),
        ("back\\slash", r"holds '\\', a backslash"),
        ("my-HetJob-study", "holds the word 'hetjob'"),
    ],
)
def test_submit_refuses_an_out_the_sbatch_lines_cannot_carry_before_writing_anything(tmp_path, name, named):
    slurm = FakeSlurm()
    out = tmp_path / name
    with pytest.raises(ValueError) as refused:
        submit(ExperimentConfig(**TINY), out, TINY_ARGS, run=slurm)
    assert str(refused.value).startswith(f"--out {str(out)!r} ") and named in str(refused.value)
    assert "choose an --out path without it" in str(refused.value)
    assert not out.exists() and slurm.calls == []


def _fake_slurm_on_path(tmp_path: Path, monkeypatch) -> Path:
    """``sbatch`` (prints job ids from 41, logs its arguments) and ``squeue`` (an empty queue) on PATH."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "sbatch.log"
    (bin_dir / "sbatch").write_text(f'#!/bin/sh\necho "$@" >> {log}\necho $((40 + $(wc -l < {log})))\n')
    (bin_dir / "squeue").write_text("#!/bin/sh\nexit 0\n")
    for tool in ("sbatch", "squeue"):
        (bin_dir / tool).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return log


def test_cli_submit_with_a_fake_sbatch_on_path(tmp_path, monkeypatch):
    from posenc.cli.app import app, load_command_modules

    load_command_modules()
    log = _fake_slurm_on_path(tmp_path, monkeypatch)
    out = tmp_path / "grid"
    command = ["submit", *TINY_ARGS, "--no-distinct", "--out", str(out), "--time", "5", "--threads", "2"]
    result = CliRunner().invoke(app, command, env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "submitted array job 41: shard(s) 0, 1, 2, 3 of 4, 4 run(s) to train" in result.output
    assert "submitted merge job 42 (afterok:41)" in result.output and f"results: {out}" in result.output
    assert log.read_text().splitlines() == [
        f"--parsable --array=0-3 {out}/slurm/array.sh",
        f"--parsable --dependency=afterok:41 --kill-on-invalid-dep=yes {out}/slurm/merge.sh",
    ]
    script = (out / "slurm" / "array.sh").read_text()
    assert "--no-distinct" in script and "--threads 2" in script and "#SBATCH --time=5\n" in script
    bad = CliRunner().invoke(app, ["submit", *TINY_ARGS, "--out", str(tmp_path / "b"), "--mem", "4 G"])
    assert bad.exit_code == 2 and "--mem must be one word" in bad.output
    monkeypatch.setenv("PATH", str(tmp_path / "nothing"))
    missing = CliRunner().invoke(app, ["submit", *TINY_ARGS, "--out", str(tmp_path / "c")])
    assert missing.exit_code == 2 and "sbatch is not on PATH" in missing.output


def test_cli_submit_says_the_array_is_queued_when_the_merge_fails_and_the_rerun_submits_the_merge(
    tmp_path, monkeypatch
):
    from posenc.cli.app import app, load_command_modules

    load_command_modules()
    log = _fake_slurm_on_path(tmp_path, monkeypatch)
    bin_dir = tmp_path / "bin"
    sbatch = (bin_dir / "sbatch").read_text()
    refuse = tmp_path / "refuse"
    refuse.touch()
    # sbatch merge.sh fails while `refuse` exists; squeue lists array job 41 once the merge is refused.
    failing = f'case "$*" in *merge.sh) if [ -e {refuse} ]; then echo "sbatch: error: Batch job submission failed: Invalid account" >&2; exit 1; fi;; esac\n'
    (bin_dir / "sbatch").write_text(sbatch.replace("\n", "\n" + failing, 1))
    (bin_dir / "squeue").write_text(f"#!/bin/sh\n[ -e {refuse} ] || echo 41\n")
    out = tmp_path / "grid"
    command = ["submit", *TINY_ARGS, "--out", str(out)]
    first = CliRunner().invoke(app, command, env={"COLUMNS": "200"})
    refuse.unlink()
    again = CliRunner().invoke(app, command, env={"COLUMNS": "200"})
    assert log.read_text().splitlines() == [
        f"--parsable --array=0-3 {out}/slurm/array.sh",
        f"--parsable --dependency=afterok:41 --kill-on-invalid-dep=yes {out}/slurm/merge.sh",
    ]
    assert first.exit_code == 2, first.output
    assert "array job 41 is queued" in first.output and "Invalid account" in first.output
    assert again.exit_code == 0, again.output
    assert "array job 41 of the earlier posenc submit is still queued" in again.output
    assert "submitted merge job 42 (afterok:41)" in again.output


# ---------------------------------------------------------------------------- the folder lock across nodes


def _squeue_says(tmp_path: Path, monkeypatch, *, prints: str = "", status: int = 0, error: str = "") -> Path:
    """A fake ``squeue`` alone on PATH that logs its arguments, prints ``prints`` and exits ``status``."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    log = tmp_path / "squeue.log"
    script = f'#!/bin/sh\necho "$@" >> {log}\nprintf "{prints}"\necho "{error}" >&2\nexit {status}\n'
    (bin_dir / "squeue").write_text(script)
    (bin_dir / "squeue").chmod(0o755)
    monkeypatch.setenv("PATH", str(bin_dir))
    return log


def test_a_lock_inside_a_slurm_job_names_the_job_and_its_restart(monkeypatch):
    import socket

    from posenc.experiments.results.folders import lock_text

    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    assert lock_text() == f"{os.getpid()} {socket.gethostname()}"
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "2")
    assert lock_text() == f"{os.getpid()} {socket.gethostname()} slurm=77.2"


@pytest.mark.parametrize(
    "squeue, taken_over",
    [
        ({"prints": "RUNNING\\n"}, False),
        ({"prints": "PENDING\\n"}, False),
        ({"prints": "NODE_FAIL\\n"}, True),  # its node died: the writer is gone
        ({"prints": "CANCELLED\\n"}, True),
        ({"prints": ""}, True),
        ({"status": 1, "error": "slurm_load_jobs error: Invalid job id specified"}, True),  # long gone
        ({"status": 1, "error": "slurm_load_jobs error: Unable to contact slurm controller"}, False),
    ],
)
def test_a_lock_from_another_node_is_taken_over_once_slurm_says_its_job_ended(
    tmp_path, monkeypatch, squeue, taken_over
):
    from posenc.experiments.results.folders import LOCK_NAME, folder_lock

    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    log = _squeue_says(tmp_path, monkeypatch, **squeue)
    out = tmp_path / "shard"
    out.mkdir()
    (out / LOCK_NAME).write_text("4242 node-that-died slurm=77.0\n")
    if taken_over:
        with folder_lock(out):
            assert (out / LOCK_NAME).read_text().split()[0] == str(os.getpid())
        assert not (out / LOCK_NAME).exists()
    else:
        with pytest.raises(ValueError, match="being written by another posenc process"), folder_lock(out):
            pass
        assert (out / LOCK_NAME).read_text() == "4242 node-that-died slurm=77.0\n"
    assert log.read_text().split() == ["--noheader", "--jobs=77", "--states=all", "--format=%T"]


def test_a_lock_from_another_node_stays_alive_without_squeue_or_a_slurm_job(tmp_path, monkeypatch):
    from posenc.experiments.results.folders import LOCK_NAME, folder_lock

    monkeypatch.setenv("PATH", str(tmp_path / "nothing"))
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    for owner in ("4242 node-that-died slurm=77.0", "4242 node-that-died"):
        (tmp_path / LOCK_NAME).write_text(owner + "\n")
        with pytest.raises(ValueError, match="delete the lock file"), folder_lock(tmp_path):
            pass


def test_a_requeued_job_takes_over_its_earlier_runs_lock(tmp_path, monkeypatch):
    """Requeued after its node failed, a job keeps its id: squeue shows it RUNNING (this very run),
    yet the lock of its earlier run (restart 0) on the dead node is stale."""
    from posenc.experiments.results.folders import LOCK_NAME, folder_lock

    _squeue_says(tmp_path, monkeypatch, prints="RUNNING\\n")
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    (tmp_path / LOCK_NAME).write_text("4242 node-that-died slurm=77.0\n")
    with folder_lock(tmp_path):
        assert (tmp_path / LOCK_NAME).read_text().strip().endswith("slurm=77.1")
    (tmp_path / LOCK_NAME).write_text("4242 node-that-died slurm=77.1\n")  # the same run on another node
    with pytest.raises(ValueError, match="being written by another posenc process"), folder_lock(tmp_path):
        pass


# ---------------------------------------------------------------------------- submit --preset

#: nope-paper at a test's scale: the preset fixes the encodings, lengths and seeds (a subset of
#: them may be named); everything else is an explicit option.
PRESET_ARGS = [
    "--seeds", "0", "--steps", "2", "--no-until-fit", "--num-symbols", "40", "--d-model", "8", "--num-layers",
    "1", "--num-heads", "1", "--d-ff", "8", "--batch-size", "2", "--eval-examples", "1",
]  # fmt: skip


def test_submit_preset_runs_every_task_and_merges_each_into_its_folder(tmp_path, monkeypatch):
    """posenc submit --preset nope-paper: array task i runs shard i/n of all three tasks; the merge
    job writes OUT/<task>; each equals ``extrapolate --preset`` without Slurm, record for record,
    preset recorded; a rerun submits nothing."""
    from posenc.cli.app import app, load_command_modules

    load_command_modules()
    log = _fake_slurm_on_path(tmp_path, monkeypatch)
    out = tmp_path / "paper"
    command = ["submit", "--preset", "nope-paper", *PRESET_ARGS, "--array-size", "2", "--out", str(out)]
    result = CliRunner().invoke(app, command, env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "submitted array job 41: shard(s) 0, 1 of 2, 15 run(s) to train" in result.output
    assert f"results: {out}/<task>" in result.output
    assert log.read_text().splitlines()[0] == f"--parsable --array=0-1 {out}/slurm/array.sh"
    script = (out / "slurm" / "array.sh").read_text()
    assert "-m posenc extrapolate --preset nope-paper " in script
    assert all(f" {word} " in script for word in PRESET_ARGS)
    for task in (0, 1):
        env = {**_python_env(), "SLURM_ARRAY_TASK_ID": str(task), "OMP_NUM_THREADS": "1"}
        done = subprocess.run(
            ["bash", str(out / "slurm" / "array.sh")], capture_output=True, text=True, env=env
        )
        assert done.returncode == 0, done.stderr[-2000:]
    tasks = ("copy", "count_copy", "reverse")
    assert sorted(p.name for p in (out / "shards" / "0of2").iterdir()) == list(tasks)
    merged = subprocess.run(
        ["bash", str(out / "slurm" / "merge.sh")], capture_output=True, text=True, env=_python_env()
    )
    assert merged.returncode == 0, merged.stderr[-2000:]
    assert merged.stdout.count("complete: every (encoding, seed) run") == 3

    reference = tmp_path / "reference"
    plain = CliRunner().invoke(
        app,
        [
            "extrapolate",
            "--preset",
            "nope-paper",
            *PRESET_ARGS,
            "--workers",
            "1",
            "--no-progress",
            "--out",
            str(reference),
        ],
        env={"COLUMNS": "200"},
    )
    assert plain.exit_code == 0, plain.output
    for task in tasks:
        assert json.loads((out / task / "config.json").read_text())["preset"] == "nope-paper"
        assert _records(out / task) == _records(reference / task) and _records(out / task)
        assert _records(out / task, "runs.jsonl") == _records(reference / task, "runs.jsonl")

    again = CliRunner().invoke(app, command, env={"COLUMNS": "200"})
    assert again.exit_code == 0 and "nothing to submit" in again.output, again.output
    assert len(log.read_text().splitlines()) == 2


def test_submit_preset_resubmits_a_shard_any_task_lacks_and_names_a_changed_task_setting(tmp_path):
    from posenc.experiments.presets import apply_preset

    small = {"seeds": [0], "steps": 2, "until_fit": False, "num_symbols": 40, "d_model": 8, "num_layers": 1,
             "num_heads": 1, "d_ff": 8, "batch_size": 2, "eval_examples": 1}  # fmt: skip
    configs = apply_preset("nope-paper", ExperimentConfig(**small), dict(small))
    out = tmp_path / "paper"
    slurm = FakeSlurm()
    first = submit(configs, out, ["--preset", "nope-paper"], preset="nope-paper", array_size=5, run=slurm)
    assert first.shards == [0, 1, 2, 3, 4] and len(first.missing) == 15
    # Shard 3 finished for copy and count_copy only: reverse still needs it, so it goes again.
    for one in configs[:2]:
        run_experiment(one, shard_folder(out, Shard(3, 5)) / one.task, workers=1, shard=Shard(3, 5))
    again = submit(configs, out, ["--preset", "nope-paper"], preset="nope-paper", array_size=5, run=slurm)
    assert again.shards == [0, 1, 2, 3, 4] and len(again.missing) == 13
    for one in configs[2:]:
        run_experiment(one, shard_folder(out, Shard(3, 5)) / one.task, workers=1, shard=Shard(3, 5))
    third = submit(configs, out, ["--preset", "nope-paper"], preset="nope-paper", array_size=5, run=slurm)
    assert third.shards == [0, 1, 2, 4] and len(third.missing) == 12
    changed = [configs[0], configs[1], dataclasses.replace(configs[2], lr=0.5)]
    with pytest.raises(ValueError, match=r"other settings \(reverse\.lr: 0\.001 there vs 0\.5 now\)"):
        submit(changed, out, ["--preset", "nope-paper"], preset="nope-paper", array_size=5, run=slurm)
    with pytest.raises(ValueError, match="grids differ"):
        submit(
            [configs[0], dataclasses.replace(configs[1], seeds=[0, 1])], tmp_path / "b", [], preset="nope-paper",
            run=slurm,
        )  # fmt: skip
    with pytest.raises(ValueError, match="pass preset=NAME"):
        submit(configs, tmp_path / "c", [], run=slurm)


def _records(folder: Path, name: str = "results.jsonl") -> list[str]:
    return sorted(
        json.dumps(json.loads(line), sort_keys=True) for line in (folder / name).read_text().splitlines()
    )


# ---------------------------------------------------------------------------- the README's commands


def _readme_cluster_section() -> str:
    """The page that shows the cluster commands (the README's section moved to docs/cluster.md)."""
    return (ROOT / "docs" / "cluster.md").read_text(encoding="utf-8")


def test_the_readme_shows_the_commands_the_slurm_tests_run():
    section = _readme_cluster_section()
    for words in (SUBMIT, TORCHRUN_ACROSS_NODES, SUBMIT_ACROSS_NODES):
        assert shlex.join(["posenc", *words]) in section, shlex.join(["posenc", *words])
    assert "scripts/slurm_one_node.sh start" in section


# ---------------------------------------------------------------------------- on a real Slurm

#: The grid the real-Slurm tests submit (the README's "On a cluster" commands): 2 encodings x 2
#: seeds as 2 array tasks; long enough (600 steps) for a task to be cancelled mid-run.
GRID = [
    "--task", "copy", "--encodings", "nope,alibi", "--seeds", "0,1", "--train-len", "2", "--eval-len", "3",
    "--num-symbols", "8", "--d-model", "8", "--num-layers", "1", "--num-heads", "1", "--d-ff", "8",
    "--batch-size", "2", "--eval-examples", "2",
]  # fmt: skip

SCALE = [*GRID, "--steps", "600", "--checkpoint-every", "20"]

SUBMIT = ["submit", *SCALE, "--array-size", "2", "--time", "0:10:00", "--out", "runs/cluster"]

DDP_RUN = ["extrapolate", *GRID, "--steps", "20", "--no-progress"]

TORCHRUN_ACROSS_NODES = ["slurm-torchrun", "--", *DDP_RUN, "--out", "runs/ddp-slurm"]

SUBMIT_ACROSS_NODES = [
    "submit",
    *GRID,
    "--steps",
    "20",
    "--nodes",
    "2",
    "--array-size",
    "1",
    "--out",
    "runs/ddp-array",
]


@functools.cache
def _slurm_answers() -> bool:
    """Whether ``sinfo`` lists a partition (asked once, and only when a ``slurm`` test is selected)."""
    if shutil.which("sinfo") is None or shutil.which("sbatch") is None:
        return False
    try:
        done = subprocess.run(["sinfo", "--noheader"], capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0 and bool(done.stdout.strip())


#: CI sets it in its Slurm stage: a cluster that does not answer fails the tests instead of skipping them.
REQUIRE_SLURM = os.environ.get("POSENC_REQUIRE_SLURM") == "1"


def _require_slurm() -> None:
    """Skip when no Slurm answers (fail instead under POSENC_REQUIRE_SLURM=1)."""
    if not _slurm_answers():
        if REQUIRE_SLURM:
            pytest.fail("POSENC_REQUIRE_SLURM=1 but sinfo does not answer: start scripts/slurm_one_node.sh")
        pytest.skip("no Slurm answers (scripts/slurm_one_node.sh start)")


@pytest.fixture(autouse=True)
def _slurm_or_skip(request):
    if request.node.get_closest_marker("slurm") is not None:
        _require_slurm()
    yield


def _posenc(words: list[str], cwd: Path, **kwargs) -> subprocess.CompletedProcess:
    env = {**_python_env(), "COLUMNS": "200", "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "posenc", *words], cwd=cwd, env=env, capture_output=True, text=True, **kwargs
    )


def _job_ids(output: str) -> list[str]:
    return [line.split()[3].rstrip(":") for line in output.splitlines() if line.startswith("submitted ")]


def _wait_for(jobs: list[str], timeout: float = 300) -> None:
    """Until ``squeue`` lists none of ``jobs`` (pending, running or completing)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        listed = subprocess.run(
            ["squeue", "--noheader", "--format=%F"], capture_output=True, text=True, check=True
        ).stdout.split()
        if not set(jobs) & set(listed):
            return
        time.sleep(1)
    raise AssertionError(
        f"jobs {jobs} still queued after {timeout} s: {subprocess.run(['squeue'], capture_output=True, text=True).stdout}"
    )


def _submit_and_wait(words: list[str], cwd: Path) -> None:
    """Run ``posenc submit``, then wait until its array and merge jobs have left the queue."""
    done = _posenc(words, cwd, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    jobs = _job_ids(done.stdout)
    assert len(jobs) == 2, done.stdout
    _wait_for(jobs)


@pytest.fixture(scope="module")
def unsharded(tmp_path_factory) -> Path:
    """The grid run in one command, no Slurm, no shards: what a merged folder must equal."""
    _require_slurm()  # before the run: a module fixture is set up before the tests' own skip
    cwd = tmp_path_factory.mktemp("unsharded")
    done = _posenc(
        ["extrapolate", *SCALE, "--no-progress", "--workers", "1", "--out", "runs/cluster"], cwd, timeout=600
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return cwd / "runs" / "cluster"


@pytest.mark.slurm
def test_slurm_array_merged_equals_an_unsharded_run(tmp_path, unsharded):
    _submit_and_wait(SUBMIT, tmp_path)
    out = tmp_path / "runs" / "cluster"
    assert sorted(p.name for p in (out / "shards").iterdir()) == ["0of2", "1of2"]
    assert _records(out) == _records(unsharded) and len(_records(out)) == 2 * 2 * 3 * 2
    assert _records(out, "runs.jsonl") == _records(unsharded, "runs.jsonl")
    merge_log = next((out / "slurm" / "logs").glob("merge-*.out")).read_text()
    assert "complete: every (encoding, seed) run of the grid has results" in merge_log
    again = _posenc(SUBMIT, tmp_path, timeout=120)
    assert again.returncode == 0 and "nothing to submit" in again.stdout, again.stdout + again.stderr


@pytest.mark.slurm
def test_a_cancelled_array_task_is_completed_by_the_rerun(tmp_path, unsharded):
    done = _posenc(SUBMIT, tmp_path, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    array, merge = _job_ids(done.stdout)
    out = tmp_path / "runs" / "cluster"
    checkpoints = out / "shards" / "1of2" / "checkpoints"
    deadline = time.monotonic() + 120
    while not any(checkpoints.glob("*.pt")) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert any(checkpoints.glob("*.pt")), "task 1 never wrote a checkpoint"
    subprocess.run(["scancel", f"{array}_1"], check=True)  # mid-run: its first run has a checkpoint only
    _wait_for([array, merge])
    assert not (out / "results.jsonl").exists(), "the merge job depends on every task (afterok)"
    log_1 = (out / "slurm" / "logs" / f"array-{array}_1.out").read_text()
    assert "CANCELLED" in log_1 and "interrupted" in log_1, log_1

    rerun = _posenc(SUBMIT, tmp_path, timeout=120)
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    assert "shard(s) 1 of 2, 2 run(s) to train" in rerun.stdout, rerun.stdout
    array_2, merge_2 = _job_ids(rerun.stdout)
    _wait_for([array_2, merge_2])
    log_2 = (out / "slurm" / "logs" / f"array-{array_2}_1.out").read_text()
    assert "resumed from its checkpoint at step" in log_2, log_2
    assert not list((out / "slurm" / "logs").glob(f"array-{array_2}_0.out")), "shard 0 was not resubmitted"
    # Nothing lost, nothing twice: the merged folder equals the unsharded run, record for record.
    assert _records(out) == _records(unsharded)
    assert _records(out, "runs.jsonl") == _records(unsharded, "runs.jsonl")
    for name in ("results.jsonl", "runs.jsonl"):
        lines = (out / name).read_text().splitlines()
        assert len(lines) == len(set(lines))


@pytest.mark.slurm
def test_one_run_across_two_slurm_nodes_equals_torchrun_on_one(tmp_path):
    """srun (2 nodes when the cluster has 2, else 2 tasks on one) + slurm-torchrun: one DDP job of
    world size 2, whose results equal ``torchrun --standalone --nproc_per_node 2`` on one machine;
    and so do ``posenc submit --nodes 2``'s (with 2 nodes)."""
    nodes = len(
        subprocess.run(
            ["sinfo", "--noheader", "--Node", "--format=%N"], capture_output=True, text=True, check=True
        ).stdout.split()
    )
    layout = ["--nodes", "2", "--ntasks-per-node", "1"] if nodes >= 2 else ["--nodes", "1", "--ntasks", "2"]
    env = {**_python_env(), "COLUMNS": "200", "OMP_NUM_THREADS": "1"}
    command = ["srun", *layout, sys.executable, "-m", "posenc", *TORCHRUN_ACROSS_NODES]
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "DDP world size 2" in done.stdout
    assert done.stderr.count("slurm-torchrun: --nnodes=2") == 2 and "--node_rank=1" in done.stderr
    out = tmp_path / "runs" / "ddp-slurm"
    assert json.loads((out / "config.json").read_text())["runtime"]["world_size"] == 2
    reference = tmp_path / "reference"
    standalone = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    standalone += ["-m", "posenc", *DDP_RUN, "--out", str(reference)]
    done = subprocess.run(standalone, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert _records(out) == _records(reference)
    if nodes < 2:
        return
    # posenc submit --nodes 2: the array task runs srun slurm-torchrun itself; merged, the same records.
    done = _posenc(SUBMIT_ACROSS_NODES, tmp_path, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    _wait_for(_job_ids(done.stdout))
    merged = tmp_path / "runs" / "ddp-array"
    assert json.loads((merged / "shards" / "0of1" / "config.json").read_text())["runtime"]["world_size"] == 2
    assert _records(merged) == _records(reference)


#: A published setup through the real Slurm, at a test's scale (the README's command at PRESET_ARGS).
SUBMIT_PRESET = [
    "submit",
    "--preset",
    "nope-paper",
    *PRESET_ARGS,
    "--array-size",
    "2",
    "--out",
    "runs/nope-paper",
]


@pytest.mark.slurm
def test_slurm_preset_submission_gives_the_preset_folders(tmp_path):
    """posenc submit --preset nope-paper on a real Slurm: the merged OUT/<task> folders equal
    ``extrapolate --preset`` on one machine, the report shows the paper beside ours, a rerun submits nothing."""
    _submit_and_wait(SUBMIT_PRESET, tmp_path)
    out = tmp_path / "runs" / "nope-paper"
    merge_log = next((out / "slurm" / "logs").glob("merge-*.out")).read_text()
    assert merge_log.count("complete: every (encoding, seed) run of the grid has results") == 3, merge_log
    reference = tmp_path / "reference"
    plain = ["extrapolate", "--preset", "nope-paper", *PRESET_ARGS, "--workers", "1", "--no-progress"]
    done = _posenc([*plain, "--out", str(reference)], tmp_path, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    for task in ("copy", "count_copy", "reverse"):
        assert _records(out / task) == _records(reference / task) and _records(out / task)
        assert _records(out / task, "runs.jsonl") == _records(reference / task, "runs.jsonl")
    shown = _posenc(["report", str(out / "reverse")], tmp_path, timeout=120)
    assert shown.returncode == 0, shown.stdout + shown.stderr
    assert "Kazemnejad" in (out / "reverse" / "report.html").read_text()  # the paper's numbers beside ours
    again = _posenc(SUBMIT_PRESET, tmp_path, timeout=120)
    assert again.returncode == 0 and "nothing to submit" in again.stdout, again.stdout + again.stderr


@pytest.mark.slurm
def test_the_lock_asks_the_real_squeue_about_a_writer_on_another_node(tmp_path):
    """The seam with squeue's own output: a lock naming a running job holds, one naming a job that
    ended is taken over."""
    from posenc.experiments.results.folders import lock_owner_alive

    def job(command: str) -> str:
        done = subprocess.run(
            ["sbatch", "--parsable", f"--output={tmp_path}/%j.out", "--wrap", command],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        return done.stdout.strip().split(";")[0]

    running, ended = job("sleep 60"), job("true")
    _wait_for([ended])
    try:
        deadline = time.monotonic() + 60
        while (
            "RUNNING"
            not in subprocess.run(
                ["squeue", "--noheader", f"--jobs={running}", "--format=%T"], capture_output=True, text=True
            ).stdout
        ):
            assert time.monotonic() < deadline, "the sleep job never started"
            time.sleep(0.5)
        assert lock_owner_alive(f"4242 node-that-died slurm={running}.0")
        assert not lock_owner_alive(f"4242 node-that-died slurm={ended}.0")
    finally:
        subprocess.run(["scancel", running], check=False)
