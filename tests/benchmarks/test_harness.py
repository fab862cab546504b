"""What every benchmark shares (posenc.benchmarks._harness): each takes --threads and sets them before it
times anything."""

from __future__ import annotations

import importlib
import sys

import pytest


class _Parsed(Exception):
    """Raised in place of running a benchmark once its arguments are parsed."""


@pytest.mark.parametrize("name", sorted(__import__("posenc.cli.bench", fromlist=["BENCHMARKS"]).BENCHMARKS))
def test_every_bench_takes_threads_and_sets_them(name, monkeypatch):
    """``posenc bench NAME --threads N`` passes ``--threads N`` to the script: each must accept it and
    set torch's threads before timing anything."""
    import argparse

    import torch

    from posenc.cli.bench import BENCHMARKS

    module = importlib.import_module(f"posenc.benchmarks.{BENCHMARKS[name][0]}")
    parse = argparse.ArgumentParser.parse_args
    threads: list[int] = []

    def parse_then_stop(self, args=None, namespace=None):
        parsed = parse(self, args, namespace)
        threads.append(parsed.threads)
        return parsed

    def stop(count: int) -> None:  # the first call after parsing: record it, stop the run
        raise _Parsed(count)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    monkeypatch.setattr(torch, "set_num_threads", stop)
    monkeypatch.setattr(sys, "argv", [name, *BENCHMARKS[name][1], "--threads", "3"])
    with pytest.raises(_Parsed) as stopped:
        module.main()
    assert threads == [3] and stopped.value.args == (3,)
