"""The study tests' shared pieces (fit flags, intervals, comparisons, variants; tests/experiments/,
tests/viz/): the tiny model they train, the command line, and records and folders written by hand."""

from __future__ import annotations

import json

from posenc.experiments import ExperimentConfig

STUDY_TINY = dict(
    d_model=16,
    num_layers=1,
    num_heads=2,
    d_ff=16,
    batch_size=4,
    steps=3,
    warmup=1,
    eval_examples=3,
    checkpoint_every=1,
)


def _app():
    from posenc.cli.app import app, load_command_modules

    load_command_modules()
    return app


def _record(encoding, seed, length, value, examples=20, metric="exact_match", task="copy", train_len=2):
    return {"run": f"{encoding}-{seed}", "encoding": encoding, "task": task, "seed": seed, "length": length,
            "metric": metric, "value": value, "train_len": train_len, "steps": 1, "examples": examples}  # fmt: skip


def _write_folder(directory, records, task="copy", train_len=2, encodings=None, eval_variants=()):
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    encodings = encodings or list(dict.fromkeys(r["encoding"] for r in records))
    config = ExperimentConfig(
        task=task, encodings=encodings, train_len=train_len, eval_len=4, eval_variants=list(eval_variants)
    )
    (directory / "config.json").write_text(json.dumps({"experiment": config.to_dict(), "runtime": {}}))


def _curve(encoding, seed, beyond, inside=1.0, **kw):
    """In-distribution ``inside`` at lengths 1, 2; ``beyond`` at 3 and 4 (their mean is ``mean(beyond)``)."""
    return [_record(encoding, seed, n, v, **kw) for n, v in zip((1, 2, 3, 4), (inside, inside, *beyond))]
