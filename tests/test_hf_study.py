"""The context-extension study (``posenc extrapolate --hf-model M --task text``) on a tiny random
Llama with a small trained BPE tokenizer, saved to a tmp folder: per-position NLL against HF's
logits, position buckets, the passkey prompt and its scoring, resume, shards, errors, ntk."""

from __future__ import annotations

import json
import math

import pytest
import torch
from typer.testing import CliRunner

pytestmark = pytest.mark.hf

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from _tiny_hf import TEXT, save_tiny_llama  # noqa: E402
from posenc.experiments.cluster.shards import Shard, merge_folders  # noqa: E402
from posenc.experiments.results.records import read_records  # noqa: E402
from posenc.experiments.study import hf_study  # noqa: E402
from posenc.experiments.study.hf_study import (  # noqa: E402
    NEEDLE,
    passkey_prompt,
    position_buckets,
    position_nll,
    run_study,
    study_summary,
)
from posenc.viz.folder import write_figures  # noqa: E402

CONTEXT = 64


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_llama(tmp_path_factory.mktemp("hf") / "tiny-llama", CONTEXT)


@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text(TEXT * 40)
    return str(path)


def _load(model_dir):
    from posenc.pretrained.loading import load

    return load(model_dir)


def test_position_nll_equals_log_softmax_of_hf_logits(model_dir):
    model, _ = _load(model_dir)
    ids = torch.randint(0, 420, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(input_ids=ids).logits.float()
    direct = -torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
    for chunk in (7, 1024):  # the chunked vocabulary projection changes nothing
        torch.testing.assert_close(position_nll(model, ids, chunk=chunk), direct, rtol=1e-5, atol=1e-5)


def test_buckets_partition_the_positions():
    buckets = position_buckets(64, 128)
    assert buckets[:8] == [(8 * k, 8 * (k + 1)) for k in range(8)]
    assert buckets[8:] == [(64, 96), (96, 128)]  # 1.5x and 2x
    for context, eval_len in ((8192, 16384), (100, 250), (64, 64), (7, 20), (8192, 600)):
        buckets = position_buckets(context, eval_len)
        covered = [p for lo, hi in buckets for p in range(lo + 1, hi + 1)]
        assert covered == list(range(1, eval_len + 1)), (context, eval_len)
        assert min(context, eval_len) in {hi for _, hi in buckets}


def test_perplexity_records_are_the_bucket_means_of_the_direct_nll(model_dir, corpus, tmp_path):
    records, _ = run_study(model_dir, tmp_path / "out", task="text-lm", eval_examples=2, corpus=corpus)
    model, tokenizer = _load(model_dir)
    ids = torch.tensor(tokenizer(TEXT * 40, add_special_tokens=False)["input_ids"])
    starts = hf_study.window_starts(len(ids), 2 * CONTEXT, 2)
    assert starts[0] == 0 and starts[1] == len(ids) - 2 * CONTEXT
    windows = torch.stack([ids[s : s + 2 * CONTEXT] for s in starts])
    with torch.no_grad():
        logits = model(input_ids=windows).logits.float()
    nll = -torch.log_softmax(logits[:, :-1], -1).gather(-1, windows[:, 1:, None])[..., 0]
    by_hi = {r["length"]: r for r in records}
    # 1.5x: positions (64, 96]; entry i of nll is position i + 2.
    assert by_hi[96]["bucket"] == [64, 96]
    assert by_hi[96]["value"] == pytest.approx(math.exp(float(nll[:, 63:95].mean())), rel=1e-5)
    assert by_hi[8]["value"] == pytest.approx(math.exp(float(nll[:, 0:7].mean())), rel=1e-5)
    assert by_hi[128]["value"] == pytest.approx(math.exp(float(nll[:, 95:127].mean())), rel=1e-5)


@pytest.mark.parametrize("depth", [0.0, 0.3, 0.5, 1.0])
def test_the_passkey_prompt_has_the_needle_at_the_depth(model_dir, depth):
    _, tokenizer = _load(model_dir)
    ids, at = passkey_prompt(tokenizer, 120, depth, 54321)
    assert len(ids) == 120
    needle = tokenizer(" " + NEEDLE.format(key=54321), add_special_tokens=False)["input_ids"]
    question = tokenizer(" " + hf_study.QUESTION, add_special_tokens=False)["input_ids"]
    assert ids[at : at + len(needle)] == needle and ids[-len(question) :] == question
    filler = 120 - len(needle) - len(question)
    sentence = max(len(tokenizer(" " + s, add_special_tokens=False)["input_ids"]) for s in hf_study.FILLER)
    assert abs(at - depth * filler) <= sentence / 2 + 1
    assert "The pass key is 54321" in tokenizer.decode(ids)


@pytest.mark.parametrize("right", [True, False])
def test_passkey_accuracy_is_greedy_exact_match(model_dir, tmp_path, monkeypatch, right):
    import re

    _, tokenizer = _load(model_dir)

    def answer(
        model, ids, steps, stop=None
    ):  # a model that reads the key from the prompt (and may say it wrong)
        key = int(re.search(r"pass key is (\d+)", tokenizer.decode(ids[0].tolist())).group(1))
        text = f" {key if right else key + 1}."
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    monkeypatch.setattr(hf_study, "greedy_answer", answer)
    records, _ = run_study(
        model_dir,
        tmp_path / "out",
        task="text-passkey",
        lengths=[100, 128],
        depths="0,0.5,1",
        eval_examples=2,
    )
    assert [r["length"] for r in records] == [100, 128]
    for record in records:
        assert record["value"] == (1.0 if right else 0.0) and record["examples"] == 6
        assert [c["depth"] for c in record["by_depth"]] == [[0.0, 0.0], [0.5, 0.5], [1.0, 1.0]]


def test_greedy_answer_is_the_argmax_continuation(model_dir):
    model, _ = _load(model_dir)
    ids = torch.randint(0, 420, (1, 30), generator=torch.Generator().manual_seed(2))
    got = hf_study.greedy_answer(model, ids, 4)
    sequence = ids
    for _ in range(4):
        with torch.no_grad():
            nxt = model(input_ids=sequence).logits[:, -1].argmax(-1)
        sequence = torch.cat([sequence, nxt[:, None]], 1)
    assert got == sequence[0, 30:].tolist()
    assert hf_study.greedy_answer(model, ids, 4, stop=lambda tokens: len(tokens) == 2) == got[:2]
    assert hf_study.answer_is_right(" 12345.", 12345) and not hf_study.answer_is_right(" 1234", 12345)


def _counting(monkeypatch, model_dir):
    """Patch the study's loader so every full model forward is counted."""
    model, tokenizer = _load(model_dir)
    calls = []
    # Full-length forwards only (a decode step feeds one token).
    model.model.register_forward_pre_hook(
        lambda module, args, kwargs: calls.append(1) if kwargs["input_ids"].shape[1] > 1 else None,
        with_kwargs=True,
    )
    monkeypatch.setattr(hf_study, "load_model", lambda ref: (model, tokenizer, "tiny-llama"))
    return calls


def test_a_rerun_skips_finished_units(model_dir, corpus, tmp_path, monkeypatch):
    calls = _counting(monkeypatch, model_dir)
    options = dict(task="text", lengths=[100, 128], depths="0,1", eval_examples=1, corpus=corpus)
    options["variants"] = ["none", "yarn"]
    first, _ = run_study(model_dir, tmp_path / "out", **options)
    full = len(calls)
    runs = read_records(tmp_path / "out" / "runs.jsonl")
    assert len(runs) == 4 and sum(r["value"] for r in runs) == 2 * (2 + 2 + 1)  # passkey x2 each, ppl at 128
    calls.clear()
    again, _ = run_study(model_dir, tmp_path / "out", **options)
    assert calls == [] and sorted(map(json.dumps, again)) == sorted(map(json.dumps, first))
    # Drop one unit's marker: the rerun does that unit only (2 passkey prompts + 1 window at 128).
    kept = [r for r in runs if not (r["variant"] == "yarn" and r["length"] == 128)]
    (tmp_path / "out" / "runs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in kept))
    third, _ = run_study(model_dir, tmp_path / "out", **options)
    assert full == 10 and len(calls) == 3
    assert sorted(map(json.dumps, third)) == sorted(map(json.dumps, first))


def test_shards_merged_equal_one_run(model_dir, corpus, tmp_path):
    options = dict(task="text", lengths=[100, 128], depths="0.5", eval_examples=1, corpus=corpus)
    options["variants"] = ["none", "ntk", "linear:1.5/3"]
    whole, settings = run_study(model_dir, tmp_path / "whole", **options)
    assert settings["encodings"][2:] == ["tiny-llama + linear:1.5", "tiny-llama + linear:3"]
    for index in range(3):
        run_study(model_dir, tmp_path / f"s{index}", shard=Shard(index, 3), **options)
    summary = merge_folders(
        tmp_path / "merged", [tmp_path / f"s{i}" for i in range(3)], figures=write_figures
    )
    assert summary.missing == []
    merged = read_records(tmp_path / "merged" / "results.jsonl")
    assert sorted(map(json.dumps, merged)) == sorted(map(json.dumps, whole))
    one = merge_folders(tmp_path / "part", [tmp_path / "s0"])
    assert len(one.missing) == 8 - 3 and all(" @ " in unit.label for unit in one.missing)
    assert (tmp_path / "merged" / "depth.png").is_file() and (
        tmp_path / "merged" / "extrapolation.png"
    ).is_file()


def test_bad_input_is_refused_with_the_numbers(model_dir, corpus, tmp_path):
    short = tmp_path / "short.txt"
    short.write_text("The grass is green.")
    cases = [
        (
            dict(corpus=str(short)),
            r"--corpus .*short\.txt has \d+ tokens, fewer than the requested --eval-len 128",
        ),
        (dict(variants=["yarn:0.5"]), r"--eval-variants 'yarn:0\.5': the factor must be >= 1"),
        (dict(variants=["ntk:2/0.9"]), r"--eval-variants 'ntk:0\.9': the factor must be >= 1"),
        (dict(depths="0,1.5"), r"--depths 1\.5: a needle depth must lie in \[0, 1\]"),
        (dict(depths="-0.1"), r"--depths -0\.1"),
        (dict(seeds=[0, 1]), r"--seeds"),
        (dict(lengths=[200]), r"--lengths \[200\]"),
    ]
    for options, message in cases:
        with pytest.raises(ValueError, match=message):
            run_study(model_dir, tmp_path / "out", **{"corpus": corpus, **options})
        assert not (tmp_path / "out").exists()


@pytest.mark.real  # needs gguf (the real extra): runs in CI's real-model stage, not the default suite
def test_a_gguf_hf_cannot_load_is_refused_by_the_command(tmp_path):
    from _gguf_fixtures import unloadable_gguf
    from posenc.cli.app import _load_command_modules, app

    path = unloadable_gguf(tmp_path)
    _load_command_modules()
    result = CliRunner().invoke(
        app, ["extrapolate", "--hf-model", str(path), "--task", "text", "--out", str(tmp_path / "o")]
    )
    assert result.exit_code == 2 and "architecture 'rwkv6'" in " ".join(result.output.split())


def test_ntk_inverse_frequencies_equal_the_formula(model_dir):
    from posenc.experiments.study.hf_scaling import apply_scaling as _apply_scaling
    from posenc.experiments.study.hf_scaling import rope_parameters_for

    model, _ = _load(model_dir)
    original = dict(model.config.rope_parameters)
    base, d, factor = float(original["rope_theta"]), 16, 3.0  # head_dim 32 / 2 heads
    _apply_scaling(model, rope_parameters_for("ntk:3", CONTEXT, 2 * CONTEXT), original)
    expected = 1.0 / (base * factor ** (d / (d - 2))) ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    torch.testing.assert_close(model.model.rotary_emb.inv_freq.double(), expected, rtol=1e-6, atol=0)
    assert not torch.allclose(
        model.model.rotary_emb.inv_freq.double(),
        1.0 / base ** (torch.arange(0, d, 2, dtype=torch.float64) / d),
    )
    # posenc's own ntk scaling gives the same frequencies.
    from posenc.encodings.rope_scaling import ntk_inv_freq

    ours, _ = ntk_inv_freq({"rope_theta": base, "factor": factor, "head_dim": d})
    torch.testing.assert_close(ours.double(), expected, rtol=1e-6, atol=0)
    _apply_scaling(model, None, original)
    torch.testing.assert_close(
        model.model.rotary_emb.inv_freq.double(),
        1.0 / base ** (torch.arange(0, d, 2, dtype=torch.float64) / d),
    )


def test_the_table_has_the_columns_asked_for(model_dir, corpus, tmp_path, monkeypatch):
    from posenc.cli.app import _load_command_modules, app

    _load_command_modules()
    out = tmp_path / "study"
    args = [
        "extrapolate",
        "--hf-model",
        str(model_dir),
        "--task",
        "text",
        "--corpus",
        corpus,
        "--out",
        str(out),
    ]
    args += ["--eval-variants", "none,linear,ntk,dynamic,yarn", "--lengths", "100,128", "--depths", "0,1"]
    result = CliRunner().invoke(app, [*args, "--no-progress"])
    assert result.exit_code == 0, result.output
    settings = json.loads((out / "config.json").read_text())["experiment"]
    table = study_summary(settings, read_records(out / "results.jsonl"))
    inside = [f"ppl <={8 * k}" for k in range(1, 9)]
    assert table.columns == [
        "variant",
        *inside,
        "ppl 1.5x",
        "ppl 2x",
        "passkey 100",
        "passkey 128",
        "passkey all",
    ]
    assert [row[0] for row in table.rows] == ["tiny-llama"] + [
        f"tiny-llama + {v}" for v in ("linear", "ntk", "dynamic", "yarn")
    ]
    assert all(cell != "-" for row in table.rows for cell in row)
    assert "1.5x" in result.output and "tiny-llama + ntk" in result.output
    assert (out / "extrapolation.png").is_file() and (out / "depth.png").is_file()
    # The variants' perplexities differ beyond the context; linear at factor 2 changes it inside too.
    ppl = {row[0]: row for row in table.rows}
    assert ppl["tiny-llama"][10] != ppl["tiny-llama + yarn"][10]
    bad = CliRunner().invoke(
        app, [*args[:-4], "--depths", "2", "--no-progress", "--out", str(tmp_path / "x")]
    )
    assert bad.exit_code == 2 and "--depths 2" in bad.output


# ---------------------------------------------------------------------------- posenc submit --hf-model


class _FakeSlurm:
    """``sbatch`` and ``squeue`` answered in process: job ids from 100, an empty queue."""

    def __init__(self) -> None:
        self.calls: list[list[str]] = []

    def __call__(self, argv: list[str]) -> str:
        self.calls.append(argv)
        if argv[0] == "sbatch":
            return f"{99 + sum(call[0] == 'sbatch' for call in self.calls)}\n"
        return ""


STUDY = dict(task="text", lengths=[100, 128], depths="0.5", eval_examples=1, variants=["none", "ntk", "yarn"])


def test_the_plan_from_the_config_alone_is_the_plan_the_run_records(model_dir, corpus, tmp_path):
    """``posenc submit`` plans on a login node from the config (no weights); the array tasks must
    find that same plan, or a rerun would count the wrong units as missing."""
    from posenc.experiments.study.plan import study_grid

    grid = study_grid(model_dir, corpus=corpus, **STUDY)
    _, settings = run_study(model_dir, tmp_path / "run", shard=Shard(0, 6), corpus=corpus, **STUDY)
    assert grid.settings() == settings
    assert grid.size() == 3 * 2  # variants x lengths
    # variant-major, shard 1 of 4 takes positions 1 and 5
    assert [u.label for u in grid.units(1, 4)] == ["tiny-llama @ 128", "tiny-llama + yarn @ 128"]


def test_submit_splits_a_study_into_array_tasks_that_run_and_merge(model_dir, corpus, tmp_path):
    """The scripts ``posenc submit`` writes, run as Slurm would run them (task i, then the merge),
    give the folder one run gives; a rerun submits only the shards still missing, then nothing."""
    import os
    import subprocess
    import sys

    from posenc.experiments.cluster.slurm import SlurmOptions, submit
    from posenc.experiments.study.plan import study_grid

    out = tmp_path / "study"
    args = ["--hf-model", str(model_dir), "--task", "text", "--lengths", "100,128", "--depths", "0.5"]
    args += ["--eval-variants", "none,ntk,yarn", "--corpus", corpus]
    grid = study_grid(model_dir, corpus=corpus, **STUDY)
    slurm = _FakeSlurm()
    first = submit(grid, out, args, array_size=2, options=SlurmOptions(cpus=1), run=slurm)
    assert first.shards == [0, 1] and len(first.missing) == 6 and first.array_job == "100"
    script = (out / "slurm" / "array.sh").read_text()
    assert "--hf-model" in script and '--shard "$i"/2' in script and "--threads 1" in script
    assert "--workers" not in script  # a study's array task is one process
    env = {**os.environ, "SLURM_ARRAY_TASK_ID": "0", "PYTHONPATH": os.pathsep.join(sys.path)}

    def run(script_name: str) -> None:
        done = subprocess.run(
            ["bash", str(out / "slurm" / script_name)], env=env, capture_output=True, text=True
        )
        assert done.returncode == 0, done.stderr[-3000:]

    run("array.sh")  # task 0 alone: shard 1 is still missing
    again = submit(grid, out, args, array_size=2, options=SlurmOptions(cpus=1), run=slurm)
    assert again.shards == [1] and [u.label for u in again.missing] == [
        "tiny-llama @ 128",
        "tiny-llama + ntk @ 128",
        "tiny-llama + yarn @ 128",
    ]
    env["SLURM_ARRAY_TASK_ID"] = "1"
    run("array.sh")
    run("merge.sh")
    whole, _ = run_study(model_dir, tmp_path / "whole", corpus=corpus, **STUDY)
    merged = read_records(out / "results.jsonl")
    assert sorted(map(json.dumps, merged)) == sorted(map(json.dumps, whole))
    assert submit(grid, out, args, array_size=2, run=slurm).complete


def test_submit_refuses_what_a_study_cannot_take(model_dir, corpus, tmp_path):
    from posenc.cli.app import _load_command_modules, app

    _load_command_modules()
    base = [
        "submit",
        "--hf-model",
        str(model_dir),
        "--corpus",
        corpus,
        "--out",
        str(tmp_path / "o"),
        "--dry-run",
    ]
    lm = CliRunner().invoke(app, [*base, "--task", "lm"])
    assert lm.exit_code == 2 and "--task text, text-lm, text-passkey, not 'lm'" in " ".join(lm.output.split())
    workers = CliRunner().invoke(app, [*base, "--task", "text", "--workers", "2"])
    assert workers.exit_code == 2 and "each array task of a study runs one process" in " ".join(
        workers.output.split()
    )
    base += ["--eval-variants", "none,yarn"]
    size = CliRunner().invoke(app, [*base, "--task", "text-lm", "--array-size", "3"])
    assert size.exit_code == 2 and "between 1 and the grid's 2 units" in " ".join(size.output.split())
    dry = CliRunner().invoke(app, [*base, "--task", "text-lm"])
    assert dry.exit_code == 0, dry.output
    assert "--array=0-1" in dry.output  # text-lm: one unit per variant, at --eval-len


def test_threads_set_the_study_process_threads(model_dir, corpus, tmp_path, monkeypatch):
    """--threads was read only by trained runs: an --hf-model study ran on torch's default instead."""
    from posenc.cli.app import _load_command_modules, app

    _load_command_modules()
    calls: list[int] = []
    monkeypatch.setattr(torch, "set_num_threads", calls.append)
    args = ["extrapolate", "--hf-model", str(model_dir), "--task", "text-passkey", "--lengths", "100"]
    args += ["--depths", "0.5", "--eval-len", "128", "--no-progress", "--threads", "3"]
    result = CliRunner().invoke(app, [*args, "--out", str(tmp_path / "o")])
    assert result.exit_code == 0, result.output
    assert calls == [3]


def test_the_report_of_a_study_folder_reproduces_it(model_dir, corpus, tmp_path):
    """``posenc report`` on a study folder: a pretrained model's context (not "trained on"), no
    checkpoint diagnostics, and a command that plans the same study again."""
    import html
    import re
    import shlex

    from posenc.cli.app import _load_command_modules, app

    _load_command_modules()
    out = tmp_path / "study"
    args = ["extrapolate", "--hf-model", str(model_dir), "--task", "text", "--corpus", corpus]
    args += ["--lengths", "100,128", "--depths", "0,1", "--eval-variants", "none,yarn:2/3", "--no-progress"]
    assert CliRunner().invoke(app, [*args, "--out", str(out)]).exit_code == 0
    result = CliRunner().invoke(app, ["report", str(out)])
    assert result.exit_code == 0, result.output
    page = (out / "report.html").read_text()
    assert f"pretrained {html.escape(str(model_dir))}, context <b>L = {CONTEXT}</b>" in page
    assert "trained on sizes" not in page and 'id="diagnostics"' not in page
    command = html.unescape(re.search(r'<pre id="command"><code>(.*?)</code>', page, re.S).group(1))
    words = shlex.split(command)
    assert words[:2] == ["posenc", "extrapolate"] and words[words.index("--out") + 1] == str(out)
    words[words.index("--out") + 1] = str(tmp_path / "again")
    again = CliRunner().invoke(app, [*words[1:], "--no-progress"])
    assert again.exit_code == 0, again.output
    first = json.loads((out / "config.json").read_text())["experiment"]
    assert json.loads((tmp_path / "again" / "config.json").read_text())["experiment"] == first


def test_the_depth_heat_map_of_a_study_is_in_tokens_and_names_each_depth(model_dir, tmp_path):
    """The heat map said "length (filler symbols)" (the synthetic task's unit) and "25%-25%"."""
    from posenc.viz.hf_study import study_figures

    _, settings = run_study(
        model_dir, tmp_path / "o", task="text-passkey", lengths=[100], depths="0,0.25", eval_len=128
    )
    records = read_records(tmp_path / "o" / "results.jsonl")
    figures = {}
    study_figures(tmp_path, settings, records, lambda fig, path: figures.setdefault(path.name, fig))
    ax = figures["depth.png"].axes[0]
    assert ax.get_xlabel() == "prompt length (tokens)"
    assert [t.get_text() for t in ax.get_yticklabels()] == ["0%", "25%"]
