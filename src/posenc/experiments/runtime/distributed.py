"""Under ``torchrun``: this process's rank, its device, and the process group of one experiment.

Every process of a ``torchrun`` job (``WORLD_SIZE > 1``) trains each run together with the others
under DistributedDataParallel (gloo on CPU, nccl on GPU); rank 0 evaluates and writes the results.
Without ``torchrun`` this process is rank 0 of 1 and nothing here starts a group.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass

import torch

__all__ = ["Distributed", "process_group", "resolve_device"]


@dataclass(frozen=True)
class Distributed:
    """This process's place in a ``torchrun`` job (rank 0 of 1 without one)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @classmethod
    def from_env(cls) -> Distributed:
        return cls(
            int(os.environ.get("RANK", 0)),
            int(os.environ.get("WORLD_SIZE", 1)),
            int(os.environ.get("LOCAL_RANK", 0)),
        )

    @property
    def enabled(self) -> bool:
        return self.world_size > 1


def resolve_device(requested: str, dist: Distributed) -> torch.device:
    """``"auto"``, ``"cpu"`` or ``"cuda"`` as this process's device (under DDP: its local rank's GPU)."""
    if requested == "auto":
        requested = "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("device='cuda' but no CUDA device is available")
        return torch.device("cuda", dist.local_rank if dist.enabled else torch.cuda.current_device())
    if requested != "cpu":
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {requested!r}")
    return torch.device("cpu")


@contextmanager
def process_group(dist: Distributed, device: torch.device):
    """Join the job's process group for the block (nothing without ``torchrun``).

    When the block ends normally every rank waits for the others first: rank 0 evaluates after
    training while the others return at once, and tearing the gloo group down under a peer that is
    still connected aborts the process ("terminate called without an active exception").
    """
    if not dist.enabled:
        yield
        return
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group("nccl" if device.type == "cuda" else "gloo")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    try:
        yield
        torch.distributed.barrier()
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
