"""Slurm's environment (posenc.experiments.runtime.slurm_env): the rendezvous of a job step read from Slurm
(a fake scontrol), and outside a step the variable it lacks named."""

from __future__ import annotations

import pytest

from posenc.experiments.cluster.slurm import (
    Rendezvous,
    rendezvous_from_slurm,
)

# ---------------------------------------------------------------------------- rendezvous


def _fake_scontrol(calls: list[list[str]]):
    def run(argv: list[str]) -> str:
        calls.append(argv)
        if argv[:3] == ["scontrol", "show", "hostnames"]:
            assert argv[3] == "gpu[07-08]"
            return "gpu07\ngpu08\n"
        if argv[:3] == ["scontrol", "show", "node"]:
            return (
                f"NodeName={argv[-1]} Arch=x86_64 NodeAddr=10.0.0.7 NodeHostName={argv[-1]} Version=22.05\n"
            )
        raise AssertionError(argv)

    return run


def test_rendezvous_from_slurm_reads_the_step():
    env = {
        "SLURM_JOB_NODELIST": "gpu[07-08]",
        "SLURM_NTASKS": "2",
        "SLURM_PROCID": "1",
        "SLURM_JOB_ID": "123456",
    }
    calls: list[list[str]] = []
    found = rendezvous_from_slurm(env, run=_fake_scontrol(calls))
    # 15000 + 123456 % 20000 = 15000 + 3456
    assert found == Rendezvous("10.0.0.7", 18456, 2, 1)
    assert calls[1] == ["scontrol", "show", "node", "--oneliner", "gpu07"], "the first node hosts it"
    assert found.torchrun_args(4) == [
        "--nnodes=2",
        "--node_rank=1",
        "--nproc_per_node=4",
        "--master_addr=10.0.0.7",
        "--master_port=18456",
    ]
    assert rendezvous_from_slurm(env, master_port=29400, run=_fake_scontrol([])).master_port == 29400
    with pytest.raises(ValueError, match="--nproc-per-node"):
        found.torchrun_args(0)


@pytest.mark.parametrize("missing", ["SLURM_JOB_NODELIST", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_JOB_ID"])
def test_rendezvous_outside_a_slurm_step_names_the_variable(missing):
    env = {"SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_NTASKS": "2", "SLURM_PROCID": "0", "SLURM_JOB_ID": "9"}
    with pytest.raises(ValueError, match=r"SLURM_PROCID=2 is not below SLURM_NTASKS=2"):
        rendezvous_from_slurm({**env, "SLURM_PROCID": "2"}, run=_fake_scontrol([]))
    del env[missing]
    with pytest.raises(ValueError, match=f"{missing} is not set; run it under srun"):
        rendezvous_from_slurm(env, run=_fake_scontrol([]))
