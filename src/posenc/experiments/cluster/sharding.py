"""Reading a shard (:class:`~posenc.experiments.shard.Shard`, part ``i`` of ``n`` of a grid's units)
from the command line (``--shard i/n``) or from the environment Slurm sets for an array task
(``--shard slurm``).

The lowest room of the cluster work: it imports no sibling module. A unit is whatever a grid splits
(a trained run, or a study's (variant, length)). :mod:`.shards` merges what shards wrote;
:mod:`.slurm` submits them.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from ..shard import Shard

__all__ = ["Shard", "parse_shard", "shard_from_slurm"]


def parse_shard(text: str, env: Mapping[str, str] | None = None) -> Shard:
    """``"2/8"`` -> ``Shard(2, 8)``; ``"slurm"`` -> this Slurm array task's shard, read from ``env``
    (default ``os.environ``; :func:`shard_from_slurm`); ``ValueError``
    naming ``--shard`` (or the Slurm variable) for anything else."""
    if text.strip().lower() == "slurm":
        return shard_from_slurm(env)
    parts = text.strip().split("/")
    if len(parts) != 2 or not all(part.strip().isdigit() for part in parts):
        raise ValueError(
            f"--shard must be i/n with whole numbers 0 <= i < n (e.g. 0/4 for the first of four parts), or "
            f"slurm in a Slurm array task, got {text!r}"
        )
    return Shard(int(parts[0]), int(parts[1]))


# ---------------------------------------------------------------------------- --shard slurm


def _int_variable(env: Mapping[str, str], name: str) -> int:
    text = env.get(name)
    if text is None:
        raise ValueError(f"--shard slurm: {name} is not set ({_ARRAY_HINT})")
    try:
        return int(text.strip())
    except ValueError:
        raise ValueError(f"--shard slurm: {name}={text!r} is not a whole number ({_ARRAY_HINT})") from None


_ARRAY_HINT = (
    "Slurm sets SLURM_ARRAY_TASK_ID, SLURM_ARRAY_TASK_COUNT, SLURM_ARRAY_TASK_MIN and SLURM_ARRAY_TASK_MAX "
    "in the tasks of a job array: run this inside `sbatch --array=0-<n-1>`, or give --shard i/n"
)


def shard_from_slurm(env: Mapping[str, str] | None = None) -> Shard:
    """The shard of this Slurm array task: ``(SLURM_ARRAY_TASK_ID - MIN) / STEP`` of the array's size.

    The size is ``SLURM_ARRAY_TASK_COUNT`` (or ``(MAX - MIN) / STEP + 1`` when Slurm does not set
    it); both must agree, so a sparse array (``--array=0,3``: 2 tasks, ids up to 3) is refused, as
    is a task id outside ``MIN..MAX``. ``ValueError`` naming the variable that is missing or wrong.
    """
    env = os.environ if env is None else env
    if "SLURM_ARRAY_TASK_ID" not in env:
        raise ValueError(
            "--shard slurm: SLURM_ARRAY_TASK_ID is not set, so this is not a task of a Slurm job array "
            f"({_ARRAY_HINT})"
        )
    task = _int_variable(env, "SLURM_ARRAY_TASK_ID")
    low = _int_variable(env, "SLURM_ARRAY_TASK_MIN")
    high = _int_variable(env, "SLURM_ARRAY_TASK_MAX")
    step = _int_variable(env, "SLURM_ARRAY_TASK_STEP") if "SLURM_ARRAY_TASK_STEP" in env else 1
    if step < 1 or high < low:
        raise ValueError(
            f"--shard slurm: SLURM_ARRAY_TASK_MIN={low}, SLURM_ARRAY_TASK_MAX={high}, "
            f"SLURM_ARRAY_TASK_STEP={step} do not describe an array"
        )
    span = (high - low) // step + 1
    count = _int_variable(env, "SLURM_ARRAY_TASK_COUNT") if "SLURM_ARRAY_TASK_COUNT" in env else span
    if count != span or (high - low) % step:
        raise ValueError(
            f"--shard slurm: SLURM_ARRAY_TASK_COUNT={count} but ids {low}..{high} step {step} span {span} "
            "tasks: a sparse array (e.g. --array=0,3) has no i/n; submit a contiguous array "
            "(--array=0-<n-1>), or give --shard $SLURM_ARRAY_TASK_ID/n with the grid's n"
        )
    if not low <= task <= high or (task - low) % step:
        raise ValueError(
            f"--shard slurm: SLURM_ARRAY_TASK_ID={task} is not one of the array's ids "
            f"{low}..{high} step {step} (SLURM_ARRAY_TASK_MIN/MAX/STEP)"
        )
    return Shard((task - low) // step, count)
