"""`.ci/stages.sh`: CI prints each stage's time at every exit and fails once a run passes its budget.

The script is sourced by `.ci/run`; these tests source it in a bash of their own and move bash's
``SECONDS`` clock by hand, so the budget guard is checked without waiting 4,000 seconds.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
STAGES = ROOT / ".ci" / "stages.sh"

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def _bash(script: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", "-c", f"set -euo pipefail; source {STAGES}; {script}"],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_every_exit_prints_each_stage_time_and_the_total():
    # SECONDS is bash's clock: set by hand, each stage lasts a known time (10 s, then 25 s).
    run = _bash('ci_begin; SECONDS=0; ci_start=0; stage "one"; SECONDS=10; stage "two"; SECONDS=35; exit 3')
    assert run.returncode == 3
    lines = run.stdout.splitlines()
    assert "=== [0 s] one" in lines and "=== [10 s] two" in lines
    table = lines[lines.index("=== stage times (s)") + 1 :]
    assert [re.split(r"\s+", line.strip(), maxsplit=1) for line in table[:2]] == [
        ["10", "one"],
        ["25", "two"],
    ]
    assert re.match(r"\s*35\s+total \(budget 4000 s\)", table[2])


def test_the_budget_fails_a_run_past_4000_s_and_passes_one_within():
    within = _bash("ci_begin; SECONDS=0; ci_start=0; SECONDS=4000; ci_within_budget")
    assert within.returncode == 0, within.stderr
    past = _bash("ci_begin; SECONDS=0; ci_start=0; SECONDS=4001; ci_within_budget")
    assert past.returncode == 1
    assert "over its budget of 4000 s" in past.stderr


def test_ci_run_uses_the_stage_clock_and_checks_the_budget_last():
    run = (ROOT / ".ci" / "run").read_text()
    assert "source .ci/stages.sh" in run and "ci_begin" in run
    # The budget check comes after the last stage that does work, so a slow Slurm stage counts too.
    assert run.rindex("ci_within_budget") > run.rindex("slurm_one_node.sh stop")
    # A trap set later (Slurm's) must keep printing the stage times.
    for trap in re.findall(r"^trap '([^']*)' EXIT$", run, flags=re.M):
        assert "ci_stage_times" in trap, trap


def test_ci_run_builds_the_site_strictly_in_environment_1_and_keeps_torch():
    """Issue 47: ``mkdocs build --strict`` runs in CI, after the docs extra, which must leave torch
    as the README's commands installed it; the site folders it writes are ignored by git."""
    run = (ROOT / ".ci" / "run").read_text()
    stages = re.findall(r'^stage "([^"]*)"$', run, flags=re.M)
    docs = next(s for s in stages if s.startswith("docs:"))
    body = run[run.index(f'stage "{docs}"') : run.index(f'stage "{stages[stages.index(docs) + 1]}"')]
    assert stages.index(docs) == stages.index(next(s for s in stages if s.startswith("environment 1"))) + 1
    assert 'pip install -q -e ".[docs]"' in body
    assert '"$(torch_version)" = "$torch_before"' in body  # the docs extra did not replace torch
    assert "mkdocs build --strict --site-dir site-ci" in body
    ignored = (ROOT / ".gitignore").read_text().splitlines()
    assert "site/" in ignored and "site-ci/" in ignored


def test_the_range_ends_read_folders_that_exist_and_leave_no_slow_test_out():
    """The floor and newest stages run the default suite on ``range_paths`` (and posenc.hf's tests on
    ``hf_paths``) and every slow test elsewhere: each named path must exist (a renamed folder would
    silently leave the range ends), and the slow call must read what the range folders do not."""
    run = (ROOT / ".ci" / "run").read_text()
    for name in ("range_paths", "hf_paths"):
        body = re.search(rf"^{name}=\(([^)]*)\)", run, flags=re.M).group(1)
        paths = body.split()
        assert paths, name
        missing = [path for path in paths if not (ROOT / path).exists()]
        assert not missing, f"{name} names {missing}, which do not exist"
    assert 'for path in "${range_paths[@]}"; do range_rest+=("--ignore=$path"); done' in run
    assert run.count('-m "slow and not real') == 2  # one slow call at each end, over range_rest
