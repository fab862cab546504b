"""Shared test set-up: deterministic seeds, one thread per worker (two xdist workers on 2 cores), an empty
dispatch memo per test."""

from __future__ import annotations

import os

os.environ.setdefault("MPLBACKEND", "Agg")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest
import torch

torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture(autouse=True)
def _fresh_dispatch_memo():
    """Each test starts with an empty dispatch memo: a test that monkeypatches what a backend consults
    (``cpu_flash_available``, ``flex_available``) must not meet a choice another test memoised."""
    from posenc.backends import memo, use_backend

    memo.bump()
    yield
    use_backend("auto")  # a bare posenc.use_backend(...) in a test (or a doc snippet) ends with it
