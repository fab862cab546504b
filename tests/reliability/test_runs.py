"""Nothing silent when an experiment runs: its inputs checked before anything is written, damaged
files named, and a killed process losing nothing.

* A corpus edited since the folder was started is refused on rerun; a missing, folder or empty
  corpus, a bad ``--threads``, an ``--out`` that is a file, and a backend that cannot train the
  encoding fail before anything is written.
* A damaged checkpoint (empty, truncated, random bytes, foreign, another run's) and a corrupt
  ``config.json`` name the file and the fix.
* SIGKILL of the main process or of a worker (slow): no orphaned worker, one line naming the
  worker and the fix, and a rerun completes without lost or duplicated records.
"""

from __future__ import annotations

import pytest
import torch

from ._helpers import TINY_RUN

# ---------------------------------------------------------------------------- inputs


def _lm_config(corpus, **kw):
    from posenc.experiments import ExperimentConfig

    options = dict(task="lm", encodings=["nope"], train_len=4, eval_len=5, steps=1, corpus=str(corpus))
    return ExperimentConfig(**{**options, **TINY_RUN, **kw})


def test_an_edited_corpus_is_refused_on_rerun(tmp_path):
    import hashlib
    import json

    from posenc.experiments import run_experiment

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog. " * 20)
    out = tmp_path / "out"
    run_experiment(_lm_config(corpus), out, workers=1)
    saved = json.loads((out / "config.json").read_text())["data"]
    assert saved == {"corpus": str(corpus), "sha256": hashlib.sha256(corpus.read_bytes()).hexdigest()}
    run_experiment(_lm_config(corpus), out, workers=1)  # unchanged: resumes (all done)
    corpus.write_text("another text entirely, of another length. " * 20)
    with pytest.raises(
        ValueError, match=r"corpus .*corpus\.txt changed since .*config\.json.*restore the file"
    ):
        run_experiment(_lm_config(corpus), out, workers=1)


@pytest.mark.parametrize("problem", ["missing", "folder", "empty"])
def test_a_bad_corpus_fails_before_anything_is_written(problem, tmp_path):
    from posenc.experiments import run_experiment

    corpus = tmp_path / "corpus.txt"
    if problem == "folder":
        corpus.mkdir()
    elif problem == "empty":
        corpus.write_bytes(b"")
    match = {"missing": "does not exist", "folder": "is not a file", "empty": "is empty"}[problem]
    out = tmp_path / "out"
    with pytest.raises(ValueError, match=rf"--corpus .*corpus\.txt {match}"):
        run_experiment(_lm_config(corpus), out, workers=1)
    assert not out.exists()


def test_threads_and_an_unwritable_out_fail_before_anything_is_written(tmp_path):
    from posenc.experiments import ExperimentConfig, run_experiment

    config = ExperimentConfig(task="copy", encodings=["nope"], train_len=2, eval_len=3, steps=1, **TINY_RUN)
    out = tmp_path / "out"
    for threads in (0, -1):
        with pytest.raises(ValueError, match=rf"threads must be an int >= 1 \(--threads\), got {threads}"):
            run_experiment(config, out, workers=1, threads=threads)
    assert not out.exists()
    a_file = tmp_path / "file.txt"
    a_file.write_text("x")
    with pytest.raises(ValueError, match=r"--out .*file\.txt is not a folder"):
        run_experiment(config, a_file, workers=1)
    with pytest.raises(
        ValueError, match=r"--out .*file\.txt/sub is inside .*file\.txt, which is not a folder"
    ):
        run_experiment(config, a_file / "sub", workers=1)
    assert a_file.read_text() == "x"


def test_a_backend_that_cannot_train_an_encoding_fails_before_anything_is_written(tmp_path):
    from posenc.experiments import ExperimentConfig, run_experiment

    config = ExperimentConfig(
        task="copy", encodings=["rope"], train_len=2, eval_len=3, steps=1, backend="flex", **TINY_RUN
    )
    with pytest.raises(ValueError, match=r"--backend 'flex' cannot train --encodings 'rope': .*serves BIAS"):
        run_experiment(config, tmp_path / "out", workers=1)
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------- damaged files


@pytest.mark.parametrize("damage", ["empty", "truncated", "random", "foreign", "other_run"])
def test_a_damaged_checkpoint_names_the_file(damage, tmp_path):
    from posenc.experiments import ExperimentConfig, run_experiment

    tiny = dict(d_model=16, num_layers=1, num_heads=2, d_ff=16, batch_size=4, warmup=1, eval_examples=3)
    config = ExperimentConfig(task="copy", encodings=["nope"], train_len=2, eval_len=3, steps=3, **tiny)
    checkpoint = tmp_path / "checkpoints" / "nope__copy__seed0.pt"
    checkpoint.parent.mkdir(parents=True)
    if damage == "empty":
        checkpoint.write_bytes(b"")
    elif damage == "random":
        checkpoint.write_bytes(bytes(range(256)) * 4)
    elif damage == "foreign":
        torch.save({"weights": torch.zeros(2)}, checkpoint)
    else:
        good = tmp_path / "good"
        run_experiment(
            ExperimentConfig(**{**config.__dict__, "steps": 2, "checkpoint_every": 1}), good, workers=1
        )
        data = (good / "checkpoints" / "nope__copy__seed0.pt").read_bytes()
        if damage == "truncated":
            checkpoint.write_bytes(data[: len(data) // 2])
        else:  # a checkpoint of another run under this run's name
            state = torch.load(good / "checkpoints" / "nope__copy__seed0.pt", weights_only=False)
            state["run"] = {"encoding": "rope", "seed": 3}
            torch.save(state, checkpoint)
    with pytest.raises(
        ValueError, match=r"checkpoint .*nope__copy__seed0\.pt .*delete it to restart nope seed 0"
    ):
        run_experiment(config, tmp_path, workers=1)


def test_a_corrupt_config_names_the_file(tmp_path):
    from posenc.experiments import ExperimentConfig, run_experiment

    (tmp_path / "config.json").write_text('{"experiment": {"task": "copy",')
    config = ExperimentConfig(task="copy", encodings=["nope"], train_len=2, eval_len=3, steps=1)
    with pytest.raises(ValueError, match=r"config\.json is not valid JSON"):
        run_experiment(config, tmp_path, workers=1)


# ---------------------------------------------------------------------------- killed processes


def _alive_children(pid: int) -> list[int]:
    """Live (not zombie) processes whose parent is ``pid`` (from /proc)."""
    from pathlib import Path

    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            found.append(int(stat.parent.name))
    return found


def _alive(pid: int) -> bool:
    from pathlib import Path

    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def _extrapolate_command(out) -> list[str]:
    import sys

    tiny = "--d-model 16 --num-layers 1 --num-heads 2 --d-ff 16 --batch-size 2 --eval-examples 2"
    return [
        sys.executable,
        "-m",
        "posenc",
        "extrapolate",
        *f"--task copy --encodings alibi --seeds 0,1 --train-len 2 --eval-len 3 {tiny}".split(),
        *["--steps", "150", "--checkpoint-every", "5", "--workers", "2", "--threads", "1", "--no-progress"],
        "--out",
        str(out),
    ]


def _start_and_wait_for_training(out):
    """Start the command with two workers; return (process, worker pids) once both train."""
    import subprocess
    import time

    process = subprocess.Popen(
        _extrapolate_command(out), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        workers = _worker_pids(process.pid)
        checkpoints = list((out / "checkpoints").glob("*.pt")) if (out / "checkpoints").exists() else []
        if len(checkpoints) >= 2 and len(workers) >= 2:
            return process, workers
        assert process.poll() is None, process.communicate()[0]
        time.sleep(0.05)
    process.kill()
    raise AssertionError("the workers never started training")


def _cmdline(pid: int) -> str:
    from pathlib import Path

    try:
        return Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")
    except OSError:
        return ""


def _worker_pids(parent: int) -> list[int]:
    """The pool's workers (spawned with multiprocessing's spawn_main), not its resource tracker."""
    return sorted(p for p in _alive_children(parent) if "spawn_main" in _cmdline(p))  # start order


def _wait_gone(pids, seconds=10.0) -> list[int]:
    import time

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.05)
    return [p for p in pids if _alive(p)]


def _check_rerun_completes_without_loss_or_duplicates(out):
    import json
    import subprocess

    done = subprocess.run(_extrapolate_command(out), capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = [line for line in (out / "results.jsonl").read_text().splitlines() if line.strip()]
    keys = [(r["run"], r["length"], r["metric"]) for r in map(json.loads, lines)]
    assert len(keys) == len(set(keys)), "duplicated records"
    runs = {key[0] for key in keys}
    metrics = {key[2] for key in keys}
    assert len(runs) == 2
    assert set(keys) == {(run, n, m) for run in runs for n in (1, 2, 3) for m in metrics}, "lost records"


@pytest.mark.slow
@pytest.mark.skipif(not __import__("os").path.isdir("/proc"), reason="reads /proc")
def test_sigkill_of_the_main_process_or_a_worker_loses_nothing_and_leaves_no_orphan(tmp_path):
    import os
    import signal

    # The main process killed: both workers notice their parent is gone and exit.
    out = tmp_path / "main"
    process, workers = _start_and_wait_for_training(out)
    assert len(workers) == 2
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    assert _wait_gone(workers) == [], "orphaned workers survive their killed parent"
    _check_rerun_completes_without_loss_or_duplicates(out)

    # A worker killed: one line naming it and the fix, no traceback; the other worker ends too.
    out = tmp_path / "worker"
    process, workers = _start_and_wait_for_training(out)
    os.kill(workers[1], signal.SIGKILL)
    # up to 300 s, as the rerun above: on a loaded 2-core CI the surviving worker ran past 60 s
    output = process.communicate(timeout=300)[0]
    assert process.returncode == 1, output
    line = next(line for line in output.splitlines() if "died" in line)  # one line, the cause and the fix
    assert f"worker 2 (pid {workers[1]}) died (signal 9)" in line, output
    assert line.endswith("run the same command again to resume"), output
    assert "Traceback" not in output and "BrokenProcessPool" not in output, output
    assert _wait_gone(workers) == []
    _check_rerun_completes_without_loss_or_duplicates(out)


_IDLE_WORKER_SCRIPT = """
import sys
from pathlib import Path

import torch

from posenc.experiments.cluster import workers
from posenc.experiments.train import ExperimentConfig, RunSpec

# Run by the spawned workers too (as __mp_main__): seed 0's job ends at once, so its worker waits
# for more work (holding the pool's reader lock) while seed 1's trains.
real_train = workers.train_and_evaluate
workers.train_and_evaluate = lambda config, run, *a, **k: [] if run.seed == 0 else real_train(config, run, *a, **k)

if __name__ == "__main__":
    out = Path(sys.argv[1])
    (out / "checkpoints").mkdir(parents=True)
    config = ExperimentConfig(
        task="copy", encodings=["alibi"], seeds=[0, 1], train_len=2, eval_len=3, steps=10**6,
        checkpoint_every=5, d_model=16, num_layers=1, num_heads=2, d_ff=16, batch_size=2, eval_examples=2,
    )
    runs = [RunSpec("alibi", 0), RunSpec("alibi", 1)]
    try:
        workers.run_in_workers(config, runs, out, 2, 1, torch.device("cpu"), lambda *a: None, print, lambda *a: None)
    except workers.WorkerDied as err:
        print(err)
        sys.exit(3)
"""


def _cpu_ticks(pid: int) -> int:
    from pathlib import Path

    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime


@pytest.mark.slow
@pytest.mark.skipif(not __import__("os").path.isdir("/proc"), reason="reads /proc")
def test_a_worker_killed_while_waiting_for_work_does_not_hang_the_survivor(tmp_path):
    # An idle worker blocks on the pool's queue holding its cross-process reader lock; killed
    # there, the lock stays held for good. The survivor used to stop its run (the pool's SIGTERM),
    # then block on that lock forever, and the main process waited for it forever.
    import os
    import signal
    import subprocess
    import sys
    import time

    out, script = tmp_path / "out", tmp_path / "idle_worker.py"
    script.write_text(_IDLE_WORKER_SCRIPT)
    process = subprocess.Popen(
        [sys.executable, str(script), str(out)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            workers = _worker_pids(process.pid)
            if len(workers) == 2 and list((out / "checkpoints").glob("*.pt")):
                break
            assert process.poll() is None, process.communicate()[0]
            time.sleep(0.05)
        else:
            raise AssertionError("the workers never started training")
        before = {pid: _cpu_ticks(pid) for pid in workers}
        time.sleep(1.0)
        (idle_ticks, idle), (training_ticks, training) = sorted(
            (_cpu_ticks(p) - before[p], p) for p in workers
        )
        assert idle_ticks < training_ticks, "no worker stands out as idle"
        os.kill(idle, signal.SIGKILL)
        output = process.communicate(timeout=120)[0]
    finally:
        if process.poll() is None:
            for pid in _worker_pids(process.pid):
                os.kill(pid, signal.SIGKILL)
            process.kill()
            process.wait()
    assert process.returncode == 3, output
    assert f"(pid {idle}) died (signal 9)" in output, output
    assert _wait_gone([training]) == [], "the surviving worker outlived the command"
    assert len(list((out / "checkpoints").glob("*.pt"))) == 1  # the survivor's run resumes from it
