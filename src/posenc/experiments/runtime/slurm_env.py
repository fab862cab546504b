"""Slurm's client commands and what a job reads from its environment, below the folders and the
submission: :func:`run_slurm_command` (``sbatch``, ``squeue``, ``scontrol``), whether a job still
runs (:func:`slurm_job_active`, read by the folder lock), and the static rendezvous of one DDP run
across the nodes of a job (:func:`rendezvous_from_slurm`, ``posenc slurm-torchrun``). It imports no
sibling module; see ``docs/architecture.md §8.1`` for what each piece reads.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
from collections.abc import Callable, Mapping
from dataclasses import dataclass

__all__ = [
    "ACTIVE_JOB_STATES",
    "Rendezvous",
    "Runner",
    "rendezvous_from_slurm",
    "run_slurm_command",
    "slurm_job_active",
]

#: ``run(argv) -> stdout``: runs a Slurm command (``sbatch``, ``squeue``, ``scontrol``); raises
#: ``ValueError`` naming the command and its error when it fails.
Runner = Callable[[list[str]], str]


def run_slurm_command(argv: list[str]) -> str:
    """Run ``argv`` (a Slurm client command) and return its stdout; ``ValueError`` naming the
    command, its exit status and its error output when it fails or is not installed."""
    try:
        done = subprocess.run(argv, capture_output=True, text=True, check=False, timeout=120)
    except FileNotFoundError as err:
        raise ValueError(
            f"{argv[0]} is not on PATH: run this on a Slurm login node (where sbatch, squeue and scontrol are)"
        ) from err
    except subprocess.TimeoutExpired as err:
        raise ValueError(
            f"{shlex.join(argv)} did not answer within {err.timeout:.0f} s: is slurmctld up (sinfo)?"
        ) from err
    if done.returncode != 0:
        raise ValueError(
            f"{shlex.join(argv)} failed (exit {done.returncode}): {(done.stderr or done.stdout).strip()}"
        )
    return done.stdout


#: ``squeue`` job states of a job that still runs or will run again (``man squeue``, JOB STATE
#: CODES); any other state it shows (COMPLETED, CANCELLED, FAILED, NODE_FAIL, TIMEOUT, ...) has ended.
ACTIVE_JOB_STATES = frozenset(
    {
        "PENDING", "RUNNING", "COMPLETING", "CONFIGURING", "SUSPENDED", "STOPPED", "RESIZING", "REQUEUED",
        "REQUEUE_FED", "REQUEUE_HOLD", "SIGNALING", "STAGE_OUT", "RESV_DEL_HOLD", "SPECIAL_EXIT",
    }
)  # fmt: skip


def slurm_job_active(job: str, run: Runner = run_slurm_command) -> bool | None:
    """Whether Slurm job ``job`` still runs or waits to (True), has ended (False: a final state, or
    ``squeue`` no longer knows it), or None when ``squeue`` cannot be asked (not installed, no
    controller): the folder lock then takes its writer to be alive."""
    try:
        shown = run(["squeue", "--noheader", f"--jobs={job}", "--states=all", "--format=%T"])
    except ValueError as err:
        return False if "invalid job id" in str(err).lower() else None
    states = {line.strip().upper() for line in shown.splitlines() if line.strip()}
    return bool(states & ACTIVE_JOB_STATES)


# ---------------------------------------------------------------------------- one run across nodes


@dataclass(frozen=True)
class Rendezvous:
    """Where the ``torchrun`` agents of one Slurm step meet: one agent per Slurm task."""

    #: The first node of the job (its ``NodeAddr``): agent 0 serves the rendezvous there.
    master_addr: str
    master_port: int
    #: Agents (``SLURM_NTASKS``): torchrun's ``--nnodes``.
    nnodes: int
    #: This agent (``SLURM_PROCID``): torchrun's ``--node_rank``.
    node_rank: int

    def torchrun_args(self, nproc_per_node: int) -> list[str]:
        """``torchrun``'s options for this agent (static rendezvous), ``nproc_per_node`` processes."""
        if isinstance(nproc_per_node, bool) or not isinstance(nproc_per_node, int) or nproc_per_node < 1:
            raise ValueError(f"--nproc-per-node must be an integer >= 1, got {nproc_per_node!r}")
        return [
            f"--nnodes={self.nnodes}",
            f"--node_rank={self.node_rank}",
            f"--nproc_per_node={nproc_per_node}",
            f"--master_addr={self.master_addr}",
            f"--master_port={self.master_port}",
        ]


def _scontrol_first_address(nodelist: str, run: Runner) -> str:
    """The ``NodeAddr`` of the first node of ``nodelist`` (``scontrol show hostnames`` expands it)."""
    names = run(["scontrol", "show", "hostnames", nodelist]).split()
    if not names:
        raise ValueError(f"scontrol show hostnames {nodelist} named no node")
    shown = run(["scontrol", "show", "node", "--oneliner", names[0]])
    match = re.search(r"\bNodeAddr=(\S+)", shown)
    if match is None:
        raise ValueError(f"scontrol show node {names[0]} gave no NodeAddr: {shown.strip()[:200]}")
    return match.group(1)


def rendezvous_from_slurm(
    env: Mapping[str, str] | None = None, *, master_port: int | None = None, run: Runner = run_slurm_command
) -> Rendezvous:
    """The rendezvous of this agent, from the Slurm step it runs in (``srun``, one agent per task).

    Reads ``SLURM_JOB_NODELIST`` (the master: its first node), ``SLURM_NTASKS`` (agents),
    ``SLURM_PROCID`` (this agent) and ``SLURM_JOB_ID`` (the port, ``15000 + id % 20000``, the same
    for every agent of the job; ``master_port`` overrides it). ``ValueError`` naming the variable.
    """
    env = os.environ if env is None else env

    def need(name: str) -> str:
        if not env.get(name):
            raise ValueError(
                f"posenc slurm-torchrun: {name} is not set; run it under srun inside a Slurm job "
                "(e.g. srun --nodes 2 --ntasks-per-node 1 posenc slurm-torchrun ...)"
            )
        return env[name]

    def number(name: str) -> int:
        text = need(name)
        if not text.strip().isdigit():
            raise ValueError(f"posenc slurm-torchrun: {name}={text!r} is not a whole number")
        return int(text)

    nodelist = need("SLURM_JOB_NODELIST")
    tasks, rank, job = number("SLURM_NTASKS"), number("SLURM_PROCID"), number("SLURM_JOB_ID")
    if not 0 <= rank < tasks:
        raise ValueError(f"posenc slurm-torchrun: SLURM_PROCID={rank} is not below SLURM_NTASKS={tasks}")
    port = 15000 + job % 20000 if master_port is None else master_port
    return Rendezvous(_scontrol_first_address(nodelist, run), port, tasks, rank)
