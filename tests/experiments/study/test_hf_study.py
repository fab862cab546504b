"""The context-extension study (posenc.experiments.study.hf_study, ``posenc extrapolate --hf-model M --task
text``) on a tiny random Llama with a small trained BPE tokenizer, saved to a tmp folder: records, resume,
shards, errors, submitting, the report and the study table of a shard."""

from __future__ import annotations

import io
import json
import math
import re
import shutil

import pytest
import torch
from rich.console import Console
from typer.testing import CliRunner

pytestmark = pytest.mark.hf

transformers = pytest.importorskip("transformers")

tokenizers = pytest.importorskip("tokenizers")


from _tiny_hf import TEXT, save_tiny_llama  # noqa: E402
from posenc.cli import experiments as experiments_cli  # noqa: E402
from posenc.cli import output as output_cli  # noqa: E402
from posenc.cli.app import app, load_command_modules  # noqa: E402
from posenc.experiments.cluster.shards import Shard, merge_folders  # noqa: E402
from posenc.experiments.results.records import (  # noqa: E402
    as_records,
    read_records,
)
from posenc.experiments.study import hf_study  # noqa: E402
from posenc.experiments.study.hf_study import (  # noqa: E402
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


def test_each_prompts_outcome_is_kept_and_the_variants_are_paired_on_the_same_prompts(
    model_dir, tmp_path, monkeypatch
):
    """Issue 58, item 2: the first variant reads every key, the second none; every cell keeps each
    prompt's outcome and key, the keys are the same for both variants, and comparisons.jsonl holds
    McNemar's exact test on them (scipy's binomial test: 0 of 8 discordant prompts go the other way)."""
    scipy_stats = pytest.importorskip("scipy.stats")
    from posenc.experiments.study.paired import study_comparisons

    _, tokenizer = _load(model_dir)
    calls = []

    def answer(model, ids, steps, stop=None):  # right for the first variant's 8 prompts only
        calls.append(1)
        key = int(re.search(r"pass key is (\d+)", tokenizer.decode(ids[0].tolist())).group(1))
        return tokenizer(f" {key if len(calls) <= 8 else key + 1}.", add_special_tokens=False)["input_ids"]

    monkeypatch.setattr(hf_study, "greedy_answer", answer)
    out = tmp_path / "out"
    records, settings = run_study(
        model_dir, out, task="text-passkey", lengths=[100], depths="0,1", eval_examples=4,
        variants=["none", "yarn:2"],
    )  # fmt: skip
    first, second = records
    assert first["hits"] == 8 and second["hits"] == 0
    for a, b in zip(first["by_depth"], second["by_depth"]):
        assert a["outcomes"] == [1, 1, 1, 1] and b["outcomes"] == [0, 0, 0, 0]
        assert a["keys"] == b["keys"] and len(set(a["keys"])) == 4
    written = [json.loads(line) for line in (out / "comparisons.jsonl").read_text().splitlines()]
    assert written == json.loads(json.dumps(study_comparisons(settings, records)))
    every = next(c for c in written if c["depth"] == "all")
    assert every["test"] == "mcnemar_exact" and every["n"] == 8 and every["mean_diff"] == 1.0
    assert every["p"] == pytest.approx(scipy_stats.binomtest(8, 8, 0.5).pvalue) and every["separated"]
    per_depth = [c for c in written if c["depth"] != "all"]
    assert [c["p"] for c in per_depth] == pytest.approx([scipy_stats.binomtest(4, 4, 0.5).pvalue] * 2)
    assert not any(c["separated"] for c in per_depth)  # 4 prompts cannot separate at 5%: p = 0.125


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


def test_variants_added_to_a_study_run_only_their_units_and_pair_with_the_rest(
    model_dir, corpus, tmp_path, monkeypatch
):
    options = dict(task="text-lm", eval_examples=2, corpus=corpus)
    whole, _ = run_study(model_dir, tmp_path / "whole", variants=["none", "yarn", "ntk"], **options)
    calls = _counting(monkeypatch, model_dir)  # one model object from here: each run restores its RoPE
    run_study(model_dir, tmp_path / "out", variants=["none", "yarn"], **options)
    calls.clear()
    grown, settings = run_study(model_dir, tmp_path / "out", variants=["none", "yarn", "ntk"], **options)
    assert len(calls) == 2  # the added variant's two windows, nothing else
    assert sorted(map(json.dumps, grown)) == sorted(map(json.dumps, whole))
    assert settings["encodings"][-1] == "tiny-llama + ntk"
    pairs = {(r["a"], r["b"]) for r in _lines(tmp_path / "out" / "comparisons.jsonl")}
    assert ("tiny-llama + yarn", "tiny-llama + ntk") in pairs or (
        "tiny-llama + ntk",
        "tiny-llama + yarn",
    ) in pairs


@pytest.mark.parametrize(
    "change",
    [
        dict(variants=["none", "ntk"]),  # yarn dropped
        dict(variants=["ntk", "none", "yarn"]),  # added before the saved ones
        dict(variants=["none", "yarn:3"]),  # a saved variant's parameters changed
        dict(variants=["none", "yarn", "ntk"], eval_examples=3),  # another setting with it
    ],
)
def test_a_study_folder_refuses_anything_but_added_variants(model_dir, corpus, tmp_path, change):
    options = dict(task="text-lm", eval_examples=2, corpus=corpus, variants=["none", "yarn"])
    run_study(model_dir, tmp_path / "out", **options)
    with pytest.raises(ValueError, match=r"holds another experiment.*variants added after its own"):
        run_study(model_dir, tmp_path / "out", **{**options, **change})


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
    from posenc.cli.app import app

    path = unloadable_gguf(tmp_path)
    load_command_modules()
    result = CliRunner().invoke(
        app, ["extrapolate", "--hf-model", str(path), "--task", "text", "--out", str(tmp_path / "o")]
    )
    assert result.exit_code == 2 and "architecture 'rwkv6'" in " ".join(result.output.split())


def test_the_table_has_the_columns_asked_for(model_dir, corpus, tmp_path, monkeypatch):
    from posenc.cli.app import app

    load_command_modules()
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
    from posenc.cli.app import app

    load_command_modules()
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
    assert (
        lm.exit_code == 2
        and "--task text, text-lm, text-passkey, text-multikey, text-vt, text-jsonkv, text-retrieval, not 'lm'"
        in " ".join(lm.output.split())
    )
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
    from posenc.cli.app import app

    load_command_modules()
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

    from posenc.cli.app import app

    load_command_modules()
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
    assert words[:2] == ["posenc", "study"] and words[words.index("--out") + 1] == str(out)
    words[words.index("--out") + 1] = str(tmp_path / "again")
    again = CliRunner().invoke(app, [*words[1:], "--no-progress"])
    assert again.exit_code == 0, again.output
    first = json.loads((out / "config.json").read_text())["experiment"]
    assert json.loads((tmp_path / "again" / "config.json").read_text())["experiment"] == first


# ----------------------------------------------------------------------------
# A complete ``--task text`` study folder merges, reports and prints as a complete study (issue 49, items 8
# and 13): on a tiny random Llama with a small trained BPE tokenizer saved to a tmp folder.


@pytest.fixture(scope="module")
def study(model_dir, tmp_path_factory):
    """A complete, unsharded ``--task text`` study folder (two variants, two lengths) by the CLI."""
    root = tmp_path_factory.mktemp("study")
    corpus = root / "corpus.txt"
    corpus.write_text(TEXT * 40)
    out = root / "text"
    args = ["extrapolate", "--hf-model", str(model_dir), "--task", "text", "--corpus", str(corpus)]
    args += ["--lengths", "100", "--depths", "0.5", "--eval-examples", "1", "--eval-variants", "none,yarn"]
    result = CliRunner().invoke(app, [*args, "--no-progress", "--out", str(out)])
    assert result.exit_code == 0, result.output
    return out


@pytest.fixture(scope="module")
def one_length(model_dir, tmp_path_factory):
    """A ``--task text-passkey`` study folder at the one prompt length 100."""
    out = tmp_path_factory.mktemp("passkey") / "pk"
    args = ["extrapolate", "--hf-model", str(model_dir), "--task", "text-passkey", "--lengths", "100"]
    args += ["--eval-len", "100", "--depths", "0.5", "--eval-examples", "1", "--no-progress"]
    result = CliRunner().invoke(app, [*args, "--out", str(out)])
    assert result.exit_code == 0, result.output
    return out


def _lines(path):
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _write_lines(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


# ---------------------------------------------------------------------------- item 13: terminal


def _printed(renderable, width):
    buffer = io.StringIO()
    console = Console(file=buffer, force_terminal=True, width=width, color_system=None)
    console.print(renderable)
    return buffer.getvalue(), console


def _cells(table):
    return [cell for row in table.rows for cell in row[1:]]


# ---------------------------------------------------------------------------- item 8: merge


def test_merge_takes_two_folders_whose_shared_units_differ_only_in_timings(study, tmp_path):
    """merge refused them: "with different results (5 vs 5)": it compared the units' seconds."""
    again = tmp_path / "again"
    shutil.copytree(study, again)
    runs = _lines(again / "runs.jsonl")
    for run in runs:
        run["seconds"] = run["seconds"] + 7.5  # the same unit, measured slower elsewhere
    _write_lines(again / "runs.jsonl", runs)
    summary = merge_folders(tmp_path / "merged", [study, again])
    assert summary.missing == [] and summary.runs == len(runs)
    # The paired tests over the merged units, as the one folder's own.
    assert _lines(tmp_path / "merged" / "comparisons.jsonl") == _lines(study / "comparisons.jsonl")
    assert summary.duplicates == len(_lines(study / "results.jsonl"))
    assert _lines(tmp_path / "merged" / "runs.jsonl") == _lines(study / "runs.jsonl")  # the first's kept


def test_merge_still_refuses_a_unit_with_other_results_naming_the_field(study, tmp_path):
    other = tmp_path / "other"
    shutil.copytree(study, other)
    runs = _lines(other / "runs.jsonl")
    runs[0]["value"] += 1  # another number of forwards: not the same measurement
    runs[0]["seconds"] += 1.0
    _write_lines(other / "runs.jsonl", runs)
    with pytest.raises(ValueError, match=r"with different results \(value \d+ vs \d+\)"):
        merge_folders(tmp_path / "merged", [study, other])
    assert not (tmp_path / "merged").exists()


def test_one_file_holding_a_unit_twice_timed_differently_reads_once(study, tmp_path):
    """The rule merge applies between folders holds inside one file too (read_records)."""
    runs = _lines(study / "runs.jsonl")
    _write_lines(tmp_path / "runs.jsonl", [*runs, {**runs[0], "seconds": runs[0]["seconds"] + 3}])
    with pytest.warns(UserWarning, match="dropped 1 exact duplicate"):
        assert read_records(tmp_path / "runs.jsonl") == runs
    _write_lines(tmp_path / "runs.jsonl", [*runs, {**runs[0], "value": runs[0]["value"] + 1}])
    with pytest.raises(ValueError, match=r"two different results of one measurement .*: value \d+ vs \d+\)"):
        read_records(tmp_path / "runs.jsonl")


# ---------------------------------------------------------------------------- item 13: report


def test_the_report_of_a_complete_study_has_its_table_and_no_missing_shard(study):
    """It said "incomplete: 2 of 2 runs have no results here ... combine the shards' folders" (the
    records' tasks text-lm and text-passkey are not the folder's text) and drew no table."""
    from posenc.viz.report import render_report

    page = render_report(study)
    assert "incomplete" not in page and 'id="missing"' not in page
    table = re.search(r'<table id="summary">(.*?)</table>', page, re.S)
    assert table, "no verdict table"
    from posenc.experiments.study.precision import cpu_description

    assert f"in float32 on {cpu_description()['cpu']}" in page  # the machine beside the numbers
    paired = re.search(r'<table id="paired">(.*?)</table>', page, re.S)
    assert paired and paired.start() < table.start(), "the paired verdict comes first"
    assert "<code>passkey 100</code>" in paired.group(1) and "cannot test" in paired.group(1)
    for label in ("tiny-llama", "tiny-llama + yarn"):
        assert f"<code>{label}</code>" in table.group(1)
    assert "passkey 100" in table.group(1) and "ppl 2x" in table.group(1)
    assert len(re.findall(r'<td class="num">\d+\.\d\d</td>', table.group(1))) >= 2 * 10


def test_the_report_of_a_study_shard_names_its_missing_units(study, tmp_path):
    part = tmp_path / "part"
    shutil.copytree(study, part)
    runs = _lines(part / "runs.jsonl")
    kept = [r for r in runs if not (r["variant"] == "yarn" and r["length"] == 128)]
    _write_lines(part / "runs.jsonl", kept)
    from posenc.viz.report import render_report

    page = render_report(part)
    assert "incomplete: 1 of 4 units have no results here (tiny-llama + yarn @ 128)" in page


def test_a_one_length_curve_has_the_length_as_its_tick_on_a_readable_axis(one_length):
    """One dot at x in 99.6..100.4 and y in -0.04..0.04: the axis matplotlib makes for one point."""
    from posenc.viz.curves import curve_figure

    records = as_records(read_records(one_length / "results.jsonl"))
    assert sorted({r.length for r in records}) == [100]
    fig = curve_figure(records, "text-passkey", "exact_match", ["tiny-llama"])
    ax = fig.axes[0]
    fig.canvas.draw()
    assert list(ax.get_xticks()) == [100]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["100"]
    assert ax.xaxis.get_offset_text().get_text() == ""
    low, high = ax.get_xlim()
    assert low <= CONTEXT and high - low >= 100  # L=64 and the length both on the axis
    bottom, top = ax.get_ylim()
    assert bottom <= 0 and top >= 1  # an exact match spans [0, 1], not the one value +- 0.05


@pytest.mark.parametrize("width", [80, 60])
def test_the_study_table_on_a_narrow_terminal_shows_every_number_whole(study, width):
    """Fourteen columns in 80 were cut to "40…"; now the columns go into several tables that fit."""
    settings = json.loads((study / "config.json").read_text())["experiment"]
    table = study_summary(settings, read_records(study / "results.jsonl"))
    assert len(table.columns) == 14
    text, _ = _printed(table, width)
    assert "…" not in text
    assert max(len(line) for line in text.splitlines()) <= width
    cells = [re.findall(r"│ *([^│]*?) *(?=│)", line) for line in text.splitlines() if line.startswith("│")]
    printed = [cell for row in cells for cell in row[1:]]
    assert sorted(printed) == sorted(_cells(table))  # each number once, whole, in its own cell
    assert " ".join(table.notes) in " ".join(text.split())


def test_the_study_table_on_a_wide_terminal_is_one_table(study):
    settings = json.loads((study / "config.json").read_text())["experiment"]
    table = study_summary(settings, read_records(study / "results.jsonl"))
    text, console = _printed(table, 250)
    assert text.count("┏") == 1 and console.measure(table).maximum < 250


def test_posenc_extrapolate_prints_the_study_table_whole_at_80_columns(model_dir, study, monkeypatch):
    terminal = Console(file=io.StringIO(), force_terminal=True, width=80, color_system=None)
    monkeypatch.setattr(experiments_cli, "console", terminal)
    monkeypatch.setattr(output_cli, "console", terminal)  # where the tables are printed
    settings = json.loads((study / "config.json").read_text())["experiment"]
    args = ["extrapolate", "--hf-model", str(model_dir), "--task", "text", "--corpus", settings["corpus"]]
    args += ["--lengths", "100", "--depths", "0.5", "--eval-examples", "1", "--eval-variants", "none,yarn"]
    result = CliRunner().invoke(app, [*args, "--no-progress", "--out", str(study)])  # resumes: all done
    assert result.exit_code == 0, result.output
    text = terminal.file.getvalue()
    table = study_summary(settings, read_records(study / "results.jsonl"))
    assert "…" not in text and all(cell in text for cell in _cells(table))


def test_the_study_says_when_its_precision_is_emulated_on_this_cpu(model_dir, corpus, tmp_path, monkeypatch):
    from posenc.experiments.study import precision

    monkeypatch.setattr(precision, "cpu_description", lambda: {"cpu": "Some CPU", "isa": ["avx2"]})
    lines: list[str] = []
    run_study(
        model_dir,
        tmp_path / "out",
        task="text-lm",
        eval_examples=2,
        corpus=corpus,
        dtype="bfloat16",
        log=lines.append,
    )
    assert any(
        line.startswith("--dtype bfloat16: this CPU (Some CPU; avx2) has no avx512_bf16 or amx_bf16")
        for line in lines
    )
