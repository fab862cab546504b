"""Sharding a grid (posenc.experiments.cluster.sharding): --shard slurm reads the array task from Slurm's
environment, and outside an array names the variable it lacks."""

from __future__ import annotations

from itertools import combinations

import pytest

from posenc.experiments.cluster.shards import Shard, parse_shard
from posenc.experiments.cluster.slurm import (
    shard_from_slurm,
)
from posenc.experiments.train import RunSpec

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


@pytest.mark.parametrize(
    "env, expected",
    [
        (_array_env(0, 0, 3, 4, 1), (0, 4)),  # sbatch --array=0-3, first task
        (_array_env(3, 0, 3, 4, 1), (3, 4)),
        (_array_env(1, 1, 4, 4, 1), (0, 4)),  # --array=1-4: ids start at 1, shards at 0
        (_array_env(4, 1, 4, 4, 1), (3, 4)),
        (_array_env(7, 5, 9, 5), (2, 5)),  # no SLURM_ARRAY_TASK_STEP: step 1
        (_array_env(6, 0, 6, 4, 2), (3, 4)),  # --array=0-6:2 is ids 0 2 4 6
        (_array_env(2, 0, 2, None, 1), (2, 3)),  # no SLURM_ARRAY_TASK_COUNT: MIN..MAX
    ],
)
def test_shard_slurm_reads_the_array_task(env, expected):
    shard = shard_from_slurm(env)
    assert (shard.index, shard.count) == expected
    assert parse_shard("slurm", env) == Shard(*expected)


@pytest.mark.parametrize(
    "env, named",
    [
        ({}, "SLURM_ARRAY_TASK_ID is not set"),
        ({"SLURM_JOB_ID": "12"}, "not a task of a Slurm job array"),  # a job, but not an array
        ({"SLURM_ARRAY_TASK_ID": "1", "SLURM_ARRAY_TASK_MAX": "3"}, "SLURM_ARRAY_TASK_MIN is not set"),
        ({"SLURM_ARRAY_TASK_ID": "1", "SLURM_ARRAY_TASK_MIN": "0"}, "SLURM_ARRAY_TASK_MAX is not set"),
        (_array_env(1, 1, 3, 2, 1), "sparse array"),  # --array=1,3: two tasks, ids 1..3
        (
            {**_array_env(1, 0, 3, 4), "SLURM_ARRAY_TASK_ID": "x"},
            "SLURM_ARRAY_TASK_ID='x' is not a whole number",
        ),
        (_array_env(5, 0, 3, 4), "SLURM_ARRAY_TASK_ID=5 is not one of the array's ids"),
        (_array_env(1, 0, 6, 4, 2), "SLURM_ARRAY_TASK_ID=1 is not one of the array's ids"),
        (_array_env(1, 3, 0, 4), "do not describe an array"),
    ],
)
def test_shard_slurm_outside_an_array_names_the_variable(env, named):
    with pytest.raises(ValueError, match=r"--shard slurm: .*") as caught:
        shard_from_slurm(env)
    assert named in str(caught.value)


# ----------------------------------------------------------------------------
# ``--shard i/n`` and ``posenc merge``: disjoint parts of the grid, merged back record for record.


@pytest.mark.parametrize("text, expected", [("0/1", (0, 1)), ("3/4", (3, 4)), (" 0/12 ", (0, 12))])
def test_parse_shard_reads_i_of_n(text, expected):
    shard = parse_shard(text)
    assert (shard.index, shard.count) == expected and str(shard) == f"{expected[0]}/{expected[1]}"


@pytest.mark.parametrize(
    "text", ["4/4", "5/4", "-1/2", "1/0", "0/0", "1", "a/b", "1/2/3", "", "1.0/2", "1/-2"]
)
def test_parse_shard_refuses_anything_but_i_of_n_with_i_below_n(text):
    with pytest.raises(ValueError, match=r"--shard"):
        parse_shard(text)


@pytest.mark.parametrize("count", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("size", [0, 1, 5, 6, 14])
def test_shards_partition_the_grid(count, size):
    grid = [RunSpec(f"enc{k % 5}", k // 5) for k in range(size)]
    parts = [Shard(index, count).select(grid) for index in range(count)]
    # Every run in exactly one shard: the union is the grid, no two shards share a run.
    key = lambda run: (run.seed, run.encoding)  # noqa: E731
    assert sorted((run for part in parts for run in part), key=key) == sorted(grid, key=key)
    for first, second in combinations(parts, 2):
        assert not set(first) & set(second)
    sizes = [len(part) for part in parts]
    assert max(sizes) - min(sizes) <= 1
    # Deterministic: the same command gives the same part.
    assert parts == [Shard(index, count).select(list(grid)) for index in range(count)]
