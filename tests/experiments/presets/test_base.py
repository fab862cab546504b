"""Paper presets (posenc.experiments.presets.base): every preset has published numbers with a full citation;
applying one sets the published setup and refuses contradictions, before anything is written; the
published table says when ours rests on a shard."""

from __future__ import annotations

import pytest

from _presets import SCALE, _cli
from posenc.experiments import ExperimentConfig
from posenc.experiments.presets import (
    PAPER_PRESETS,
    apply_preset,
    published,
)


def test_every_preset_has_published_numbers_with_a_full_citation():
    for name, preset in PAPER_PRESETS.items():
        entry = published(name)  # read through importlib.resources: the file ships as package data
        cite = entry["citation"]
        assert cite["authors"] and all(
            isinstance(author, str) and " " in author for author in cite["authors"]
        )
        assert cite["title"] and cite["venue"] and isinstance(cite["year"], int) and cite["arxiv"]
        assert ("Table" in entry["source"] or "Figure" in entry["source"]) and isinstance(
            entry["approximate"], bool
        )
        assert set(entry["paper_names"]) == set(preset.settings["encodings"])
    nope = published("nope-paper")
    assert {"what", "why"} <= set(nope["ours_changes"])  # what posenc changed from the paper's setup
    assert set(nope["values"]) == set(PAPER_PRESETS["nope-paper"].settings["encodings"])
    # Reciprocal ranks of five methods sum to 1/1 + ... + 1/5 = 2.283 (two-decimal values: within 0.02).
    assert abs(sum(nope["values"].values()) - sum(1 / k for k in range(1, 6))) < 0.02
    alibi = published("alibi-paper")
    for curve in alibi["perplexity"].values():
        assert set(curve) == {str(alibi["train_length"]), *map(str, alibi["eval_lengths"].values())}


def test_apply_preset_sets_the_published_setup_and_refuses_contradictions():
    base = ExperimentConfig(steps=7, d_model=32)
    configs = apply_preset("nope-paper", base, explicit={"steps": 7, "d_model": 32})
    assert [c.task for c in configs] == ["copy", "count_copy", "reverse"]
    for config in configs:
        assert (config.train_len, config.eval_len, config.seeds) == (20, 40, [0, 1, 2])
        assert config.encodings == ["nope", "rope", "alibi", "t5", "sinusoidal"]
        assert (config.steps, config.d_model) == (7, 32)  # the scale stays the command line's
    assert [c.task for c in apply_preset("nope-paper", base, {"train_len": 20}, task="reverse")] == [
        "reverse"
    ]
    with pytest.raises(
        ValueError, match=r"--preset nope-paper runs --task copy, count_copy, reverse; --task lm"
    ):
        apply_preset("nope-paper", base, {}, task="lm")
    with pytest.raises(ValueError, match=r"sets --train-len 20 .*drop --train-len 16"):
        apply_preset("nope-paper", base, {"train_len": 16})
    with pytest.raises(ValueError, match=r"sets --encodings sinusoidal,rope,t5,alibi"):
        apply_preset("alibi-paper", base, {"encodings": ["rope"]})
    with pytest.raises(ValueError, match=r"unknown --preset 'gpt'; available: nope-paper, alibi-paper"):
        apply_preset("gpt", base, {})
    alibi = apply_preset("alibi-paper", base, {"seeds": [3]})
    assert [(c.task, c.train_len, c.eval_len) for c in alibi] == [("lm", 64, 512)]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--task", "lm"], "--task lm is not one of them"),
        (["--train-len", "16"], "sets --train-len 20"),
        (["--seeds", "0,5"], "sets --seeds 0,1,2 (the published setup); drop --seeds 0,5"),
        (["--corpus", "README.md"], "corpus is only used by the lm task"),
        (["--shard", "3/3"], "--shard 3/3"),
    ],
)
def test_cli_preset_with_conflicting_options_is_an_error_before_anything_is_written(tmp_path, args, message):
    result = _cli(["extrapolate", "--preset", "nope-paper", *args, "--out", str(tmp_path / "out")])
    assert result.exit_code == 2 and message in " ".join(result.output.split()), result.output
    assert not (tmp_path / "out").exists()


def test_the_published_table_says_when_ours_rests_on_a_shard(tmp_path):
    from posenc.experiments.presets import comparison_for_folder

    args = ["extrapolate", "--preset", "alibi-paper", *SCALE, "--shard", "0/2", "--out", str(tmp_path)]
    result = _cli(args)
    assert result.exit_code == 0, result.output
    notes = " ".join(comparison_for_folder(tmp_path / "lm").notes)
    # Grid order sinusoidal, rope, t5, alibi: shard 0/2 holds sinusoidal and t5.
    assert (
        "incomplete, ours rests on part of the grid: lm lacks 2 run(s) (rope seed 0, alibi seed 0)" in notes
    )
