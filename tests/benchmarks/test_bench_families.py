"""``posenc bench families``: the issue-37 families, auto vs the eager reference, at tiny sizes on the CPU."""

from __future__ import annotations

from posenc.benchmarks import bench_families
from posenc.cli.bench import BENCHMARKS, QUICK_ARGS


def _rows(table: str, length: int) -> list[list[str]]:
    return [
        [cell.strip() for cell in line.strip("|").split("|")]
        for line in table.splitlines()
        if line.startswith(f"| {length} |")
    ]


def test_every_family_is_timed_both_ways_in_both_passes(capsys):
    table = bench_families.main(["--sizes", "16", "--long", "", "--repeats", "1", "--no-memory"])
    rows = _rows(table, 16)
    assert len(rows) == 2 * len(bench_families.FAMILIES)
    assert [row[1] for row in rows] == ["fwd"] * 10 + ["fwd+bwd"] * 10
    for row, spec in zip(rows, bench_families.FAMILIES * 2):
        assert row[2].startswith(f"{spec} (") and row[2].endswith(")")  # the backend auto ran on
        assert row[3].endswith(")") and "ms" in row[3] and "ms" in row[4] and row[5].endswith("×")
    assert "path (householder)" in {row[2] for row in rows}
    assert "H=4, d=64" in table and "1 threads" in table


def test_path_eager_past_its_limit_is_marked_and_memory_is_measured():
    table = bench_families.main(
        ["--sizes", "", "--long", "24", "--no-memory", "--path-eager", "32", "--families", "path;rope"]
    )
    rows = _rows(table, 24)
    path_fwd, _rope_fwd, path_train, rope_train = rows
    assert "ms" in path_fwd[4]  # forward: 24 <= 32
    assert path_train[4].startswith("— (PaTH eager") and "L=16" in path_train[4] and path_train[5] == "—"
    assert "ms" in rope_train[4]
    table = bench_families.main(["--sizes", "", "--long", "8", "--families", "rope"])
    train = _rows(table, 8)[1]
    assert train[6].endswith("MiB") and train[7].endswith("MiB")  # peak memory of both, fresh processes


def test_the_cli_lists_it():
    assert BENCHMARKS["families"][0] == "bench_families" and "--no-memory" in QUICK_ARGS["families"]
