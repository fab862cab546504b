"""The bias benchmark (posenc.benchmarks.bench_bias): its rows name the backend auto ran."""

from __future__ import annotations


def test_bench_rows_name_the_backend_auto_ran():
    """bench_bias labelled its rows "posenc auto (blocked)" while auto ran near_far from 1024 tokens."""
    from posenc.benchmarks import bench_bias

    table = bench_bias.run([512, 1024], repeats=1, encoding="alibi", memory=False, peers_up_to=0)
    labels = {
        (row.split("|")[1].strip(), row.split("|")[2].strip()): row.split("|")[3].strip()
        for row in table.splitlines()
        if "posenc auto" in row
    }
    assert labels == {
        ("512", "fwd"): "posenc auto (blocked)",
        ("512", "fwd+bwd"): "posenc auto (blocked)",
        ("1024", "fwd"): "posenc auto (near_far)",
        ("1024", "fwd+bwd"): "posenc auto (near_far)",
    }, table
