"""An experiment folder written by hand for the report's tests (tests/viz/): the default config with seeds 0,
1, 2, accuracies that fall off past the training length at a known reach per encoding, and untrained
checkpoints."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from posenc.experiments.results.folders import write_config
from posenc.experiments.tasks.catalog import mix_seed
from posenc.experiments.train import ExperimentConfig, RunSpec, build_model, run_id_for

#: The default main job (``posenc extrapolate``), three seeds.
CONFIG = ExperimentConfig(seeds=[0, 1, 2])


ENCODINGS = CONFIG.encodings


TRAIN_LEN, EVAL_LEN = CONFIG.train_len, CONFIG.eval_len


LENGTHS = list(range(1, EVAL_LEN + 1))


SEEDS = CONFIG.seeds


#: Per seed, how far past L each encoding's exact match lasts (0: it fails at L+1); nope does not fit.
REACH = {
    "nope": (0, 0, 0),
    "learned": (0, 0, 0),
    "sinusoidal": (2, 3, 2),
    "rope": (8, 9, 10),
    "alibi": (10, 11, 12),
    "t5": (12, 9, 10),
    "shaw": (30, 31, 32),
}


def accuracy(encoding: str, length: int, seed: int) -> float:
    """Exact match of ``encoding`` at ``length``: 1 inside L (nope: falling, so it does not fit),
    then a linear fall over ``REACH`` lengths; seeds differ by a little."""
    if encoding == "nope":
        return max(0.0, 1.0 - length / TRAIN_LEN) if length > 2 else 1.0
    inside = 1.0 - 0.002 * seed
    if length <= TRAIN_LEN:
        return inside
    reach = REACH[encoding][seed]
    return max(0.0, inside * (1 - (length - TRAIN_LEN) / (reach + 1)))


def write_experiment(directory: Path, checkpoints: bool = True) -> None:
    """Records, config and (optionally) the runs' checkpoints (initialised models) in the runner's format."""
    records = [
        {
            "run": run_id_for(CONFIG, RunSpec(enc, seed)),
            "encoding": enc,
            "task": "copy",
            "seed": seed,
            "length": length,
            "metric": metric,
            "value": value,
            "train_len": TRAIN_LEN,
            "steps": CONFIG.steps,
            "examples": 100,
        }
        for enc in ENCODINGS
        for seed in SEEDS
        for length in LENGTHS
        for metric, value in (
            ("exact_match", round(accuracy(enc, length, seed), 2)),
            ("token_accuracy", round(min(1.0, 0.3 + accuracy(enc, length, seed)), 3)),
        )
    ]
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    write_config(directory, CONFIG, {"workers": 2, "threads": 1, "world_size": 1, "device": "cpu"}, None)
    if checkpoints:
        save_checkpoints(directory, CONFIG, ENCODINGS)


def save_checkpoints(directory: Path, config: ExperimentConfig, encodings: list[str]) -> None:
    """``checkpoints/<run id>.pt`` of seed 0 as the runner saves them (the models as initialised)."""
    task = config.make_task()
    for enc in encodings:
        torch.manual_seed(mix_seed(0, "init"))
        model = build_model(config, task, enc)
        path = directory / "checkpoints" / f"{run_id_for(config, RunSpec(enc, 0))}.pt"
        path.parent.mkdir(parents=True, exist_ok=True)
        state = {"model": model.state_dict(), "step": 0, "run": {"encoding": enc, "seed": 0}}
        torch.save({**state, "config": config.to_dict()}, path)
