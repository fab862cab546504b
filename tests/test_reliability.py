"""Nothing silent: each case a realistic misuse that once gave a wrong result without an error.

Every test asserts either the clear error (naming the parameter or object at fault) or the correct
result, computed independently (a fresh cache, a separate layer).
"""

from __future__ import annotations

import pytest
import torch

import posenc

E, H = 16, 2


def _layer(encoding="rope", **kw):
    torch.manual_seed(0)
    return posenc.MultiheadAttention(E, H, encoding, **kw).eval()


# ---------------------------------------------------------------------------- KV cache


def test_self_and_cross_attention_with_one_layer_idx_keep_separate_entries():
    """A decoder block's self- and cross-attention both at layer_idx=0 share one cache."""
    self_attn = _layer(causal=True)
    cross_attn = _layer("nope")
    x, ctx = torch.randn(1, 4, E), torch.randn(1, 6, E)
    shared = posenc.KVCache()
    self_attn(x, cache=shared)
    got = cross_attn(x, ctx, cache=shared)
    want = cross_attn(x, ctx, cache=posenc.KVCache())
    torch.testing.assert_close(got, want)
    assert shared.length(0, cross=False) == 4 and shared.length(0, cross=True) == 6


def test_a_cache_entry_serves_only_the_layer_that_wrote_it():
    rope, alibi = _layer("rope", causal=True), _layer("alibi", causal=True)
    cache = posenc.KVCache()
    rope(torch.randn(1, 3, E), cache=cache)
    with pytest.raises(
        ValueError, match=r"layer_idx=0 was written by MultiheadAttention\(.*'rope:.*own layer_idx"
    ):
        alibi(torch.randn(1, 1, E), cache=cache)
    sinks = _layer("rope", causal=True, sinks=True)
    with pytest.raises(ValueError, match="was written by"):
        sinks(torch.randn(1, 1, E), cache=cache)


def test_a_batch_change_mid_cache_is_refused():
    layer = _layer(causal=True)
    cache = posenc.KVCache()
    layer(torch.randn(2, 3, E), cache=cache)
    with pytest.raises(ValueError, match="holds a batch of 2, this call has 3"):
        layer(torch.randn(3, 1, E), cache=cache)


def test_cross_attention_cache_refuses_another_context():
    layer = _layer("nope")
    cache = posenc.KVCache()
    q, ctx = torch.randn(1, 2, E), torch.randn(1, 5, E)
    first = layer(q, ctx, cache=cache)
    torch.testing.assert_close(layer(q, ctx, cache=cache), first)  # the same context: served
    with pytest.raises(ValueError, match="keys of another context"):
        layer(q, torch.randn(1, 5, E), cache=cache)
    ctx.add_(1.0)  # edited in place: its keys in the cache are stale
    with pytest.raises(ValueError, match="keys of another context"):
        layer(q, ctx, cache=cache)


def test_cache_must_be_a_kv_cache():
    with pytest.raises(ValueError, match=r"cache must be a posenc\.KVCache"):
        _layer(causal=True)(torch.randn(1, 2, E), cache={})


# ---------------------------------------------------------------------------- masks


@pytest.mark.parametrize("backend", ["eager", "sdpa", "blocked"])
def test_a_float_mask_row_of_minus_inf_never_unmasks_future_keys(backend):
    """A row hidden entirely by -inf in a causal layer gives zeros, not attention to future keys."""
    layer = _layer("alibi", causal=True)
    x = torch.randn(1, 6, E, requires_grad=True)
    mask = torch.zeros(6, 6)
    mask[2] = float("-inf")
    with posenc.use_backend(backend):
        out, weights = layer(x, attn_mask=mask, need_weights=True)
    assert torch.isfinite(out).all() and torch.isfinite(weights).all()
    assert (weights[0, :, 2] == 0).all()
    assert (weights.triu(1) == 0).all()
    # The row's output is the output projection's bias alone: nothing was attended to.
    torch.testing.assert_close(out[0, 2], layer.out_proj.bias.detach())
    out.sum().backward()
    assert torch.isfinite(x.grad).all()


@pytest.mark.parametrize("encoding", ["rope", "alibi"])
def test_nan_in_the_input_is_never_turned_into_finite_numbers(encoding):
    """PyTorch's CPU flash kernel returns zeros for a query row whose logits are nan; auto must not
    pick it for such a request (it goes to eager, which propagates nan)."""
    layer = _layer(encoding, causal=True)
    x = torch.randn(1, 300, E)  # large enough that auto would take a fused kernel
    x[0, 5, 3] = float("nan")
    out = layer(x)
    assert layer.last_backend == "eager"
    assert bool(torch.isnan(out[0, 5]).all())
    for backend in ("sdpa", "blocked"):
        with (
            pytest.raises(posenc.backends.NoBackendError, match="nan or inf in the inputs"),
            posenc.use_backend(backend),
        ):
            layer(x)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"embed_dim": 64.0, "num_heads": 4}, "embed_dim must be an int, got 64.0"),
        ({"embed_dim": 64, "num_heads": "4"}, "num_heads must be an int, got '4'"),
        ({"embed_dim": 64, "num_heads": 4, "num_kv_heads": 2.0}, "num_kv_heads must be an int"),
    ],
)
def test_layer_sizes_of_the_wrong_type_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        posenc.MultiheadAttention(**kwargs)


def test_token_ids_outside_the_vocabulary_name_vocab_size():
    model = posenc.TransformerLM(10, 16, 1, 2)
    with pytest.raises(ValueError, match=r"ids in \[0, vocab_size=10\), got values from 0 to 10"):
        model(torch.tensor([[0, 3, 10]]))
    with pytest.raises(ValueError, match="got values from -1"):
        model(torch.tensor([[-1, 3]]))


def test_key_padding_at_length_never_builds_a_dense_mask_on_auto(monkeypatch):
    """sdpa turns a padding mask into a dense [B, 1, L, L] tensor (10 GB at L=50,000); past a size
    auto takes the blocked backend instead, with the same result."""
    monkeypatch.setattr("posenc.backends.blocked.MAX_DENSE_MASK_BYTES", 300 * 300 * 4 - 1)
    layer = _layer("rope", causal=True).double()
    x = torch.randn(2, 300, E, dtype=torch.float64)
    pad = torch.zeros(2, 300, dtype=torch.bool)
    pad[1, :7] = True
    out = layer(x, key_padding_mask=pad)
    assert layer.last_backend == "segments"  # the padding mask split into segments, no dense mask
    with posenc.use_backend("sdpa"):
        torch.testing.assert_close(out, layer(x, key_padding_mask=pad), rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("name", posenc.available())
def test_an_empty_sequence_gives_an_empty_output_on_every_encoding(name):
    from posenc.examples import build_example

    layer = posenc.MultiheadAttention(E, H, build_example(name, num_heads=H, head_dim=E // H), causal=True)
    out = layer(torch.randn(2, 0, E))
    assert out.shape == (2, 0, E)


def test_xpos_past_its_float32_range_is_a_clear_error():
    """ζ^(-p/B) overflows float32 near p = 36,000 with the defaults: refuse, naming the fix."""
    layer = _layer("xpos", causal=True)
    limit = layer.encoding.max_offset
    zeta = float(layer.encoding.zeta.min())
    assert torch.isfinite(torch.tensor(zeta, dtype=torch.float32) ** torch.tensor(-limit / 512.0))
    assert not torch.isfinite(
        torch.tensor(zeta, dtype=torch.float32) ** torch.tensor(-(limit * 1.02) / 512.0)
    )
    x = torch.randn(1, 3, E)
    layer(x, positions=torch.arange(3) + limit - 2)  # at the edge: served
    with pytest.raises(ValueError, match="past the float32 range of its scale"):
        layer(x, positions=torch.arange(3) + limit)


@pytest.mark.parametrize(
    "spec,match",
    [
        ("learned:max_len=10000000000,dim=64", r"learned: max_len=10000000000 needs a table of 2384\.2 GiB"),
        ("shaw:max_len=1000000000,head_dim=16,num_heads=2,k=None", r"shaw: max_len=1000000000 needs a table"),
        ("rope:cache_size=10000000000", r"rope: cache_size=10000000000 needs a table of 74\.5 GiB"),
    ],
)
def test_huge_tables_fail_up_front_naming_the_memory(spec, match):
    with pytest.raises(ValueError, match=match):
        posenc.build(spec)


@pytest.mark.parametrize("damage", ["empty", "truncated", "random", "foreign", "other_run"])
def test_a_damaged_checkpoint_names_the_file(damage, tmp_path):
    from posenc.experiments import ExperimentConfig, run_experiment

    tiny = dict(d_model=16, num_layers=1, num_heads=2, d_ff=16, batch_size=4, warmup=1, eval_examples=3)
    config = ExperimentConfig(task="copy", encodings=["nope"], train_len=2, eval_len=3, steps=3, **tiny)
    checkpoint = tmp_path / "checkpoints" / "nope__copy__seed0.pt"
    checkpoint.parent.mkdir(parents=True)
    if damage == "empty":
        checkpoint.write_bytes(b"")
    elif damage == "random":
        checkpoint.write_bytes(bytes(range(256)) * 4)
    elif damage == "foreign":
        torch.save({"weights": torch.zeros(2)}, checkpoint)
    else:
        good = tmp_path / "good"
        run_experiment(
            ExperimentConfig(**{**config.__dict__, "steps": 2, "checkpoint_every": 1}), good, workers=1
        )
        data = (good / "checkpoints" / "nope__copy__seed0.pt").read_bytes()
        if damage == "truncated":
            checkpoint.write_bytes(data[: len(data) // 2])
        else:  # a checkpoint of another run under this run's name
            state = torch.load(good / "checkpoints" / "nope__copy__seed0.pt", weights_only=False)
            state["run"] = {"encoding": "rope", "seed": 3}
            torch.save(state, checkpoint)
    with pytest.raises(
        ValueError, match=r"checkpoint .*nope__copy__seed0\.pt .*delete it to restart nope seed 0"
    ):
        run_experiment(config, tmp_path, workers=1)


def test_a_corrupt_config_names_the_file(tmp_path):
    from posenc.experiments import ExperimentConfig, run_experiment

    (tmp_path / "config.json").write_text('{"experiment": {"task": "copy",')
    config = ExperimentConfig(task="copy", encodings=["nope"], train_len=2, eval_len=3, steps=1)
    with pytest.raises(ValueError, match=r"config\.json is not valid JSON"):
        run_experiment(config, tmp_path, workers=1)


# ---------------------------------------------------------------------------- option ranges


def _declared_ranges():
    for name in posenc.available():
        for option, allowed in posenc.get_class(name).option_ranges.items():
            yield pytest.param(name, option, allowed, id=f"{name}-{option}")


def _outside(allowed) -> list[float]:
    """Values just outside a declared range: the excluded bound itself, or one step past it."""
    values = []
    if allowed.low is not None:
        values.append(allowed.low - 1 if allowed.low_inclusive else allowed.low)
    if allowed.high is not None:
        values.append(allowed.high + 1 if allowed.high_inclusive else allowed.high)
    return values


def test_every_encoding_with_numeric_options_declares_their_ranges():
    families = [n for n in posenc.available() if n != "nope"]
    assert all(posenc.get_class(n).option_ranges for n in families)


@pytest.mark.parametrize("name,option,allowed", list(_declared_ranges()))
def test_an_option_outside_its_declared_range_is_refused_naming_it(name, option, allowed):
    """Generated from every encoding's ``option_ranges``: a value outside is a ValueError naming
    the option and the range, whether the encoding is built from a spec or constructed directly."""
    import re

    from posenc.examples import build_example

    cls = posenc.get_class(name)
    good = build_example(name, num_heads=H, head_dim=8).config()
    for bad in _outside(allowed):
        is_list = isinstance(good.get(option), list) or option in ("short_factor", "long_factor")
        value = [bad] if is_list else bad
        pattern = rf"{name}: option '{option}' must be {re.escape(str(allowed))}, got {option}="
        with pytest.raises(ValueError, match=pattern):
            cls(**{**good, option: value})


@pytest.mark.parametrize(
    "spec,match",
    [
        (
            "deberta:layer_norm_eps=-1",
            r"deberta: option 'layer_norm_eps' must be > 0, got layer_norm_eps=-1\.0",
        ),
        ("deberta:pos_dropout=1", r"option 'pos_dropout' must be in \[0, 1\), got pos_dropout=1\.0"),
        ("rope:base=0", r"rope: option 'base' must be > 1, got base=0\.0"),
        ("rope:base=-5", r"option 'base' must be > 1"),
        ("rope:scaling=linear,factor=0", r"option 'factor' must be > 0, got factor=0\.0"),
        ("rope:scaling=yarn,factor=-2,original_max_position_embeddings=8", r"option 'factor' must be > 0"),
        (
            "rope:scaling=yarn,factor=2,original_max_position_embeddings=0",
            r"'original_max_position_embeddings' must be >= 1",
        ),
        (
            "rope:scaling=yarn,factor=2,original_max_position_embeddings=8,attention_factor=0",
            r"'attention_factor' must be > 0",
        ),
        ("t5:max_distance=0", r"t5: option 'max_distance' must be >= 1, got max_distance=0"),
        ("t5:num_buckets=0", r"t5: option 'num_buckets' must be >= 2"),
        ("xpos:gamma=-0.5", r"xpos: option 'gamma' must be > 0"),
        ("fire:eps=0", r"fire: option 'eps' must be > 0"),
        ("sinusoidal:base=-1", r"sinusoidal: option 'base' must be > 0"),
        ("mrope:factor=0,scaling=linear", r"mrope: option 'factor' must be > 0"),
    ],
)
def test_out_of_range_spec_options_are_refused_at_build_time(spec, match):
    from posenc.examples import build_example

    with pytest.raises(ValueError, match=match):
        build_example(spec, num_heads=H, head_dim=8)


def test_a_layer_size_out_of_range_is_refused_naming_it():
    with pytest.raises(ValueError, match=r"alibi: option 'num_heads' must be >= 1, got num_heads=0"):
        posenc.build("alibi:num_heads=0")


# ---------------------------------------------------------------------------- experiment folders

TINY_RUN = dict(d_model=16, num_layers=1, num_heads=2, d_ff=16, batch_size=4, warmup=1, eval_examples=3)


def _lm_config(corpus, **kw):
    from posenc.experiments import ExperimentConfig

    options = dict(task="lm", encodings=["nope"], train_len=4, eval_len=5, steps=1, corpus=str(corpus))
    return ExperimentConfig(**{**options, **TINY_RUN, **kw})


def test_an_edited_corpus_is_refused_on_rerun(tmp_path):
    import hashlib
    import json

    from posenc.experiments import run_experiment

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog. " * 20)
    out = tmp_path / "out"
    run_experiment(_lm_config(corpus), out, workers=1)
    saved = json.loads((out / "config.json").read_text())["data"]
    assert saved == {"corpus": str(corpus), "sha256": hashlib.sha256(corpus.read_bytes()).hexdigest()}
    run_experiment(_lm_config(corpus), out, workers=1)  # unchanged: resumes (all done)
    corpus.write_text("another text entirely, of another length. " * 20)
    with pytest.raises(
        ValueError, match=r"corpus .*corpus\.txt changed since .*config\.json.*restore the file"
    ):
        run_experiment(_lm_config(corpus), out, workers=1)


@pytest.mark.parametrize("problem", ["missing", "folder", "empty"])
def test_a_bad_corpus_fails_before_anything_is_written(problem, tmp_path):
    from posenc.experiments import run_experiment

    corpus = tmp_path / "corpus.txt"
    if problem == "folder":
        corpus.mkdir()
    elif problem == "empty":
        corpus.write_bytes(b"")
    match = {"missing": "does not exist", "folder": "is not a file", "empty": "is empty"}[problem]
    out = tmp_path / "out"
    with pytest.raises(ValueError, match=rf"--corpus .*corpus\.txt {match}"):
        run_experiment(_lm_config(corpus), out, workers=1)
    assert not out.exists()


def test_threads_and_an_unwritable_out_fail_before_anything_is_written(tmp_path):
    from posenc.experiments import ExperimentConfig, run_experiment

    config = ExperimentConfig(task="copy", encodings=["nope"], train_len=2, eval_len=3, steps=1, **TINY_RUN)
    out = tmp_path / "out"
    for threads in (0, -1):
        with pytest.raises(ValueError, match=rf"threads must be an int >= 1 \(--threads\), got {threads}"):
            run_experiment(config, out, workers=1, threads=threads)
    assert not out.exists()
    a_file = tmp_path / "file.txt"
    a_file.write_text("x")
    with pytest.raises(ValueError, match=r"--out .*file\.txt is not a folder"):
        run_experiment(config, a_file, workers=1)
    with pytest.raises(
        ValueError, match=r"--out .*file\.txt/sub is inside .*file\.txt, which is not a folder"
    ):
        run_experiment(config, a_file / "sub", workers=1)
    assert a_file.read_text() == "x"


def test_results_and_checkpoints_are_written_whole_with_mode_0644(tmp_path, monkeypatch):
    import os
    import stat

    from posenc.experiments import ExperimentConfig, results, run_experiment

    config = ExperimentConfig(
        task="copy", encodings=["nope"], train_len=2, eval_len=3, steps=2, checkpoint_every=1, **TINY_RUN
    )
    synced: list[int] = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd))[1])
    run_experiment(config, tmp_path, workers=1)
    written = ["results.jsonl", "results.csv", "config.json", "checkpoints/nope__copy__seed0.pt"]
    for name in written:
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == 0o644, name
    assert len(synced) >= len(written)
    assert not [p for p in tmp_path.rglob("*.tmp")]  # no temporary file left behind
    # A write that fails half way leaves the old file untouched.
    before = (tmp_path / "results.jsonl").read_bytes()

    def torn(handle):
        handle.write(b'{"run": "half')
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        results.atomic_write(tmp_path / "results.jsonl", torn)
    assert (tmp_path / "results.jsonl").read_bytes() == before
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_a_torn_results_line_names_the_file_line_and_fix(tmp_path):
    from posenc.experiments import ExperimentConfig, run_experiment

    config = ExperimentConfig(task="copy", encodings=["nope"], train_len=2, eval_len=3, steps=1, **TINY_RUN)
    first = run_experiment(config, tmp_path, workers=1)
    path = tmp_path / "results.jsonl"
    lines = path.read_text().splitlines()
    path.write_text("\n".join([*lines[:-1], lines[-1][:17]]) + "\n")  # the last line cut off
    with pytest.raises(
        ValueError,
        match=rf"results\.jsonl, line {len(lines)}: not a JSON record .*delete that line .*run the same command again",
    ):
        run_experiment(config, tmp_path, workers=1)
    path.write_text("\n".join(lines[:-1]) + "\n")  # the fix the message names
    again = run_experiment(config, tmp_path, workers=1)
    assert sorted(json_key(r) for r in again) == sorted(json_key(r) for r in first)


def json_key(record):
    return (record["length"], record["metric"], record["seed"])


# ---------------------------------------------------------------------------- killed processes


def _alive_children(pid: int) -> list[int]:
    """Live (not zombie) processes whose parent is ``pid`` (from /proc)."""
    from pathlib import Path

    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            found.append(int(stat.parent.name))
    return found


def _alive(pid: int) -> bool:
    from pathlib import Path

    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def _extrapolate_command(out) -> list[str]:
    import sys

    tiny = "--d-model 16 --num-layers 1 --num-heads 2 --d-ff 16 --batch-size 2 --eval-examples 2"
    return [
        sys.executable,
        "-m",
        "posenc",
        "extrapolate",
        *f"--task copy --encodings alibi --seeds 0,1 --train-len 2 --eval-len 3 {tiny}".split(),
        *["--steps", "150", "--checkpoint-every", "5", "--workers", "2", "--threads", "1", "--no-progress"],
        "--out",
        str(out),
    ]


def _start_and_wait_for_training(out):
    """Start the command with two workers; return (process, worker pids) once both train."""
    import subprocess
    import time

    process = subprocess.Popen(
        _extrapolate_command(out), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        workers = _worker_pids(process.pid)
        checkpoints = list((out / "checkpoints").glob("*.pt")) if (out / "checkpoints").exists() else []
        if len(checkpoints) >= 2 and len(workers) >= 2:
            return process, workers
        assert process.poll() is None, process.communicate()[0]
        time.sleep(0.05)
    process.kill()
    raise AssertionError("the workers never started training")


def _cmdline(pid: int) -> str:
    from pathlib import Path

    try:
        return Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")
    except OSError:
        return ""


def _worker_pids(parent: int) -> list[int]:
    """The pool's workers (spawned with multiprocessing's spawn_main), not its resource tracker."""
    return sorted(p for p in _alive_children(parent) if "spawn_main" in _cmdline(p))  # start order


def _wait_gone(pids, seconds=10.0) -> list[int]:
    import time

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.05)
    return [p for p in pids if _alive(p)]


def _check_rerun_completes_without_loss_or_duplicates(out):
    import json
    import subprocess

    done = subprocess.run(_extrapolate_command(out), capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = [line for line in (out / "results.jsonl").read_text().splitlines() if line.strip()]
    keys = [(r["run"], r["length"], r["metric"]) for r in map(json.loads, lines)]
    assert len(keys) == len(set(keys)), "duplicated records"
    runs = {key[0] for key in keys}
    metrics = {key[2] for key in keys}
    assert len(runs) == 2
    assert set(keys) == {(run, n, m) for run in runs for n in (1, 2, 3) for m in metrics}, "lost records"


@pytest.mark.slow
@pytest.mark.skipif(not __import__("os").path.isdir("/proc"), reason="reads /proc")
def test_sigkill_of_the_main_process_or_a_worker_loses_nothing_and_leaves_no_orphan(tmp_path):
    import os
    import signal

    # The main process killed: both workers notice their parent is gone and exit.
    out = tmp_path / "main"
    process, workers = _start_and_wait_for_training(out)
    assert len(workers) == 2
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    assert _wait_gone(workers) == [], "orphaned workers survive their killed parent"
    _check_rerun_completes_without_loss_or_duplicates(out)

    # A worker killed: one line naming it and the fix, no traceback; the other worker ends too.
    out = tmp_path / "worker"
    process, workers = _start_and_wait_for_training(out)
    os.kill(workers[1], signal.SIGKILL)
    output = process.communicate(timeout=60)[0]
    assert process.returncode == 1, output
    line = next(line for line in output.splitlines() if "died" in line)  # one line, the cause and the fix
    assert f"worker 2 (pid {workers[1]}) died (signal 9)" in line, output
    assert line.endswith("run the same command again to resume"), output
    assert "Traceback" not in output and "BrokenProcessPool" not in output, output
    assert _wait_gone(workers) == []
    _check_rerun_completes_without_loss_or_duplicates(out)


# ---------------------------------------------------------------------------- torch.compile


@pytest.mark.parametrize("encoding", ["sinusoidal", "rope", "alibi", "shaw"])  # one per kind
def test_the_layer_compiles_in_one_graph_for_every_kind(encoding):
    """Value checks (negative positions, nan) stay out of the traced path, so fullgraph=True holds;
    aot_eager traces forward and backward like inductor without needing a C++ compiler."""
    torch._dynamo.reset()
    layer = _layer(encoding, causal=True)
    x = torch.randn(2, 7, E)
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(x), layer(x))


@pytest.mark.slow
@pytest.mark.parametrize("encoding", ["sinusoidal", "rope", "alibi", "shaw"])
def test_the_compiled_layer_follows_positions_padding_and_float_masks(encoding):
    torch._dynamo.reset()
    layer = _layer(encoding, causal=True)
    x = torch.randn(2, 7, E)
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    positions = torch.arange(3, 10)
    torch.testing.assert_close(compiled(x, positions=positions), layer(x, positions=positions))
    padding = torch.zeros(2, 7, dtype=torch.bool)
    padding[1, :2] = True  # left padding: two rows of the second sequence see no key
    torch.testing.assert_close(compiled(x, key_padding_mask=padding), layer(x, key_padding_mask=padding))
    float_mask = torch.zeros(7, 7).masked_fill(torch.eye(7, dtype=torch.bool).roll(1, 1), float("-inf"))
    torch.testing.assert_close(compiled(x, attn_mask=float_mask), layer(x, attn_mask=float_mask))


def test_the_model_compiles_in_one_graph():
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = posenc.TransformerLM(32, E, 2, H, encoding="rope").eval()
    tokens = torch.randint(0, 32, (2, 9))
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(tokens), model(tokens))


def test_a_compiled_layer_refuses_a_backend_it_cannot_trace():
    torch._dynamo.reset()
    layer = _layer("alibi", causal=True, backend="blocked")
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    with pytest.raises(Exception, match=r"backend 'blocked' cannot be traced by torch\.compile"):
        compiled(torch.randn(1, 4, E))


# ---------------------------------------------------------------------------- huge sizes, up front


@pytest.mark.parametrize(
    "spec,figure", [("alibi", "bias"), ("rope", "attention"), ("sinusoidal", "similarity")]
)
def test_posenc_plot_with_a_huge_length_names_n_and_the_memory(spec, figure, tmp_path):
    from typer.testing import CliRunner

    from posenc.cli import _load_command_modules, app

    _load_command_modules()

    args = ["plot", spec, "-n", "100000", "--out", str(tmp_path / "f.png")]
    result = CliRunner().invoke(app, args + (["--figure", figure] if figure else []))
    assert result.exit_code == 2, result.output
    text = " ".join(result.output.split())
    assert "-n/--length 100000 asks for a 100000 x 100000 map: 37.3 GiB per head" in text
    assert "use -n 8192 or less" in text
    assert not (tmp_path / "f.png").exists()


def test_a_long_but_linear_figure_is_still_drawn(tmp_path):
    """-n is the original context of RoPE's decay figure: no L x L map, no refusal."""
    from posenc.examples import build_example
    from posenc.viz.registry import PlotOptions, make_figure

    make_figure(build_example("rope"), "decay", PlotOptions(length=100_000))


# ---------------------------------------------------------------------------- devices


@pytest.mark.parametrize(
    "argument",
    ["positions", "key_padding_mask", "attn_mask", "document_ids", "prefix_len", "context"],
)
def test_an_argument_on_another_device_than_x_is_named(argument):
    layer = _layer("nope" if argument == "context" else "rope", causal=argument != "context")
    x = torch.randn(1, 4, E)
    meta = {
        "positions": torch.arange(4, device="meta"),
        "key_padding_mask": torch.zeros(1, 4, dtype=torch.bool, device="meta"),
        "attn_mask": torch.ones(4, 4, dtype=torch.bool, device="meta"),
        "document_ids": torch.zeros(1, 4, dtype=torch.long, device="meta"),
        "prefix_len": torch.tensor([2], device="meta"),
        "context": torch.randn(1, 3, E, device="meta"),
    }[argument]
    with pytest.raises(
        ValueError, match=rf"{argument} is on device meta but x is on cpu; move {argument} to cpu"
    ):
        layer(x, **{argument: meta})


def test_x_the_layer_the_cache_and_the_model_on_other_devices_are_named():
    layer = _layer(causal=True)
    with pytest.raises(ValueError, match=r"x is on device meta but the layer's parameters are on cpu"):
        layer(torch.randn(1, 4, E, device="meta"))
    cache = posenc.KVCache()
    layer(torch.randn(1, 4, E), cache=cache)
    with torch.device("meta"):
        on_meta = _layer(causal=True)
    with pytest.raises(ValueError, match=r"entry of layer_idx=0 is on device cpu but the layer is on meta"):
        on_meta(torch.randn(1, 1, E, device="meta"), cache=cache)
    model = posenc.TransformerLM(10, E, 1, H)
    with pytest.raises(ValueError, match=r"tokens are on device meta but the model is on cpu"):
        model(torch.zeros(1, 3, dtype=torch.long, device="meta"))


@pytest.mark.parametrize("how", ["need_weights", "forced_eager", "use_backend"])
def test_dense_weights_at_length_50000_fail_up_front_naming_the_memory(how):
    """[1, 2, 50000, 50000] float32 weights are 18.6 GiB: refused before anything is allocated."""
    layer = _layer("alibi", causal=True, backend="eager" if how == "forced_eager" else "auto")
    x = torch.randn(1, 50_000, E)
    match = (
        r"need_weights=True returns \[B, H, Tq, Tk\] = \[1, 2, 50000, 50000\] attention weights: 18\.6 GiB "
        r"\(limit 4 GiB\); drop need_weights"
        if how == "need_weights"
        else r"backend='eager' builds .* 18\.6 GiB \(limit 4 GiB\); use backend='auto'"
    )
    with pytest.raises(ValueError, match=match):
        if how == "use_backend":
            with posenc.use_backend("eager"):
                layer(x)
        else:
            layer(x, need_weights=how == "need_weights")


# ---------------------------------------------------------------------------- smaller cases


def test_mrope_refuses_negative_3_axis_ids_as_plain_positions_are_refused():
    layer = _layer("mrope", causal=True)
    x = torch.randn(1, 3, E)
    with pytest.raises(ValueError, match="positions must be non-negative, got minimum -1"):
        layer(x, positions=torch.tensor([-1, 0, 1]))
    ids = torch.tensor([[0, 1, 2], [0, -3, 1], [0, 1, 1]])
    with (
        pytest.raises(ValueError, match=r"mrope: position ids must be non-negative, got minimum -3"),
        layer.encoding.position_ids(ids),
    ):
        layer(x)
    with layer.encoding.position_ids(ids.abs()):  # the same ids, non-negative: served
        assert torch.isfinite(layer(x)).all()


def test_posenc_show_honours_the_spec_head_dim_or_refuses_it():
    from typer.testing import CliRunner

    from posenc.cli import app

    result = CliRunner().invoke(app, ["show", "rope:head_dim=15"])
    assert result.exit_code == 2
    assert "head_dim must be even" in result.output and "head_dim=15" in result.output
    result = CliRunner().invoke(app, ["show", "rope:head_dim=32"])
    assert result.exit_code == 0, result.output
    assert "rope:head_dim=32," in result.output and "rotary_dim=32/32" in result.output


def test_a_backend_that_cannot_train_an_encoding_fails_before_anything_is_written(tmp_path):
    from posenc.experiments import ExperimentConfig, run_experiment

    config = ExperimentConfig(
        task="copy", encodings=["rope"], train_len=2, eval_len=3, steps=1, backend="flex", **TINY_RUN
    )
    with pytest.raises(ValueError, match=r"--backend 'flex' cannot train --encodings 'rope': .*serves BIAS"):
        run_experiment(config, tmp_path / "out", workers=1)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "values, finite",
    [
        ([1.0, -2.0, 3.0], True),
        ([1.0, float("nan"), 3.0], False),
        ([1.0, float("inf"), 3.0], False),
        ([float("-inf"), 2.0, 3.0], False),
        ([float("inf"), float("-inf"), 3.0], False),  # their sum is nan, not a cancellation
        ([1e308, 1e308, -1.0], True),  # float64: a sum that overflows, every element finite
    ],
)
def test_the_nonfinite_check_sees_every_nan_and_inf_and_no_overflow(values, finite, dtype):
    """has_nonfinite decides whether fused kernels (which would turn nan rows finite) may serve a
    request; it reduces with one float64 sum and tests element by element only when that sum is not
    finite."""
    from posenc.backends import AttentionRequest

    x = torch.zeros(1, 1, 5, 2, dtype=torch.float64)
    x.view(-1)[: len(values)] = torch.tensor(values, dtype=torch.float64)
    x = x.to(dtype)  # 1e308 becomes inf in float32 and bfloat16
    finite = finite and bool(torch.isfinite(x).all())
    pos = torch.arange(5)[None]
    for name in ("q", "k", "v"):
        q, k, v = (x if name == which else torch.ones_like(x) for which in ("q", "k", "v"))
        req = AttentionRequest(
            q=q, k=k, v=v, encoding=posenc.build("nope"), q_pos=pos, k_pos=pos, scale=1.0, causal=True
        )
        assert req.has_nonfinite is (not finite), (name, values)
