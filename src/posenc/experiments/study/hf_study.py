"""The context-extension study of a pretrained model: ``posenc extrapolate --hf-model M --task text``.

``M`` is a fetched model's name (``smollm2-135m``), a ``.gguf`` file or an HF folder with a
tokenizer, loaded by :func:`posenc.pretrained.loading.load` (a GGUF of an architecture HF cannot load is
refused by name). Nothing is trained; the model is scored on real text in its own tokens, under
each RoPE variant of ``--eval-variants`` (``none``, ``linear``, ``ntk``, ``dynamic``, ``yarn``;
``NAME:FACTOR`` sets the factor, default ``eval_len / context``; ``NAME:F1/F2/F3`` is a factor sweep,
one row per factor). Let ``c`` be the model's training context (``max_position_embeddings``). A
factor must be finite and ``>= 1``, and a variant without one needs ``eval_len > c`` (its default
would stretch nothing): both are checked when the command starts. A model whose learned position
table ends before ``eval_len`` (GPT-2's ``n_positions``) is refused once loaded, before any unit runs.

Tasks:

* ``text-lm``: perplexity by position. The evaluation text is ``--corpus``: a file, or the built-in
  ``python-reference`` (:func:`posenc.pretrained.loading.reference_text`, the default); all of it is
  evaluation text (a pretrained model has no training split here). Each of ``--eval-examples``
  windows of ``eval_len`` tokens starts at a fixed offset (evenly spaced over the text) and is run
  through the model once; the token at 1-based position ``p`` of a window (``p >= 2``) has the NLL
  ``-log softmax(logits[p - 1])[token_p]``. The NLLs are pooled into buckets of positions
  ``(lo, hi]``: eight of width ``c/8`` inside the context, then steps of ``c/2``: **perplexity at
  1.5x** is ``exp`` of the mean NLL of the positions in ``(c, 1.5c]``, **at 2x** of those in
  ``(1.5c, 2c]``. Each bucket is one record (``metric: perplexity``, ``length = hi``) with each
  window's mean NLL there (``window_nll``) and, from two windows on, the 95% interval of the
  perplexity across windows (``interval``: ``exp`` of the t interval of the mean NLL,
  :mod:`.reading`); the table's verdict says how far each variant reads and which cannot be ranked.
* ``text-passkey``: the standard passkey prompt in the model's tokens: filler sentences ("The grass
  is green. The sky is blue. ..."), the needle "The pass key is N. Remember it. N is the pass key."
  at a depth of ``--depths`` (the fraction of the filler before it, snapped to the nearest sentence
  boundary), then "What is the pass key? The pass key is"; the whole prompt is ``length`` tokens. The
  model decodes greedily a few tokens; a trial is right when the first run of digits of its answer
  equals ``N`` (exact match). ``--eval-examples`` trials per (length, depth) cell. One
  ``exact_match`` record per length carries ``by_depth`` (the heat map, ``depth.png``); every cell
  and length record its ``hits`` and the 95% Wilson ``interval``.
* ``text-multikey``: the passkey and, beside it on the same lengths and depths, RULER's multi-key
  needle (:func:`~posenc.experiments.tasks.text.multikey_prompt`; records of task ``text-multikey``).
* ``text``: perplexity and the passkey.

``longppl=True`` (``--longppl``) adds LongPPL to the perplexity records (``key_tokens``,
``longppl``; :mod:`posenc.experiments.tasks.longppl`, the model its own evaluator).

The unit of work is one (variant, length): ``--lengths`` (default ``c/2, c, 1.5c, 2c`` up to
``eval_len``, and ``eval_len``) for the passkey, and ``eval_len`` for perplexity (one forward at the
longest length gives every bucket). A unit's records are written to the folder as soon as it is
done and listed in ``runs.jsonl`` (``metric: unit``); a rerun of the same command skips finished
units, and the same command with variants added after the others (``--variants none,yarn`` then
``--variants none,yarn,dpe``) runs only the added ones' units, which pair with the finished rows (same
windows, prompts and seed). ``--shard i/n`` keeps the units at positions ``i, i + n, ...`` of the list (variant-major);
``posenc merge`` joins the shards' folders. Forwards per unit: ``len(depths) * eval_examples``
passkey prompts (plus a few one-token decode steps each), and ``eval_examples`` perplexity windows
for the units at ``eval_len``.

The ``dynamic`` variant scales by the length of each call, so its perplexity inside the context,
read from an ``eval_len`` forward, is that of the scaled model, not of the model as trained.

The tasks' pieces (windows, per-position NLL, buckets; the passkey prompt, greedy decoding, exact
match) live in :mod:`posenc.experiments.tasks.text`; this module runs them unit by unit.
"""

from __future__ import annotations

import json
import math
import random
import re
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from ...pretrained.loading import load
from ..results.folders import FigureWriter, folder_lock, write_outputs
from ..results.records import RUNS_FILE, atomic_write_text, read_records, wilson_interval
from ..runtime.distributed import Distributed, resolve_device

# Imported by name, so _run_unit looks them up here (a test replaces hf_study.greedy_answer).
from ..tasks.longppl import key_tokens, long_ppl, short_context_nll
from ..tasks.text import (
    FILLER,
    NEEDLE,
    QUESTION,
    answer_is_right,
    greedy_answer,
    passkey_prompt,
    position_buckets,
    position_nll,
    window_starts,
)
from .hf_methods import apply_variant
from .hf_scaling import check_hf_folder, check_positions, model_label
from .needles import NEEDLES, Needle  # re-exported: the needle tasks
from .paired import write_comparisons
from .plan import (
    CORPORA,
    STUDY_TASKS,
    TASK_PARTS,
    expand_variants,
    runs_lm,
    shard_units,
    study_grid,
    study_text,
    study_units,
    unit_id,
)
from .precision import cast_weights, check_dtype_runs, cpu_description, emulated_note, study_dtype
from .reading import bucket_interval
from .summary import study_summary  # re-exported: the study's table

__all__ = [
    "CORPORA",
    "FILLER",
    "NEEDLE",
    "QUESTION",
    "STUDY_TASKS",
    "answer_is_right",
    "expand_variants",
    "greedy_answer",
    "load_model",
    "passkey_prompt",
    "position_buckets",
    "position_nll",
    "run_study",
    "study_summary",
    "study_units",
    "window_starts",
]


def load_model(model: str | Path) -> tuple[nn.Module, Any, str]:
    """``(model, tokenizer, name)`` of a fetched model's name, a ``.gguf`` file or an HF folder."""
    loaded, tokenizer = load(model)
    return loaded, tokenizer, model_label(model)


# ---------------------------------------------------------------------------- the study


def run_study(
    model_ref: str | Path,
    out: str | Path,
    *,
    task: str = "text",
    eval_len: int | None = None,
    lengths: Sequence[int] | None = None,
    depths: Sequence[float] | str | None = None,
    eval_examples: int = 1,
    seeds: Sequence[int] | None = None,
    corpus: str | None = None,
    variants: Sequence[str] | None = None,
    longppl: bool = False,
    tuning_windows: int = 0,
    dtype: str = "float32",
    trials: int | None = None,
    shard: Any = None,
    device: str = "cpu",
    report: Callable[[str, str, int, int, str], None] | None = None,
    log: Callable[[str], None] | None = None,
    figures: FigureWriter | None = None,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Run (or resume) the study of ``model_ref`` into the folder ``out``; returns ``(records, settings)``."""
    out = Path(out)
    # Planned from the config before the weights load (seconds to minutes): a bad option fails at
    # once, and the plan is the one posenc submit makes for the same command.
    options = dict(task=task, eval_len=eval_len, lengths=lengths, depths=depths, eval_examples=eval_examples)
    options.update(seeds=seeds, corpus=corpus, variants=variants, longppl=longppl)
    plan = study_grid(model_ref, **options, tuning_windows=tuning_windows, dtype=dtype, trials=trials).plan
    torch_device = resolve_device(device, Distributed())
    check_dtype_runs(dtype, torch_device)  # before the weights load
    slow = emulated_note(dtype, torch_device)
    if slow is not None:
        (log or (lambda line: None))(slow)
    model, tokenizer, _ = load_model(model_ref)
    settings, scalings, labels = plan.settings, plan.scalings, plan.labels
    check_positions(model, settings["eval_len"], model_ref)  # on the CPU it loaded on, before .to(device)
    original = dict(getattr(model.config, "rope_parameters", None) or {})
    text_ids = _study_inputs(tokenizer, settings, corpus)
    units = plan.units
    mine = units if shard is None else shard_units(units, shard.index, shard.count)
    cast_weights(model, torch_device, study_dtype(dtype))  # the rotary tables stay float32
    progress = report or (lambda *args: None)
    say = log or (lambda line: None)
    with folder_lock(out):
        added = check_hf_folder(out, settings)
        if added:
            say(f"adding {len(added)} variant(s) to the study in {out}: {', '.join(added)}")
        out.mkdir(parents=True, exist_ok=True)
        runtime = {"device": str(torch_device), "shard": None if shard is None else str(shard)}
        runtime.update(cpu_description())  # the machine every timing and precision figure ran on
        atomic_write_text(
            out / "config.json", json.dumps({"experiment": settings, "runtime": runtime}, indent=2) + "\n"
        )
        runs = read_records(out / RUNS_FILE) if (out / RUNS_FILE).exists() else []
        done = {r["run"] for r in runs if r.get("metric") == "unit"}
        records = [r for r in _read(out / "results.jsonl") if r.get("run") in done]
        todo = [u for u in mine if unit_id(*u) not in done]
        if len(todo) < len(mine):
            say(f"resuming: {len(mine) - len(todo)} of {len(mine)} unit(s) already done in {out}")
        for number, (variant, length) in enumerate(todo, 1):
            apply_variant(model, scalings[variant], original)
            label = f"{labels[variant]} @ {length}"
            note = f"unit {number}/{len(todo)}"
            start = time.perf_counter()
            scored, forwards = _run_unit(
                model, tokenizer, settings, variant, labels[variant], length, text_ids, torch_device,
                lambda k, n, label=label, note=note: progress(label, "eval", k, n, note),
            )  # fmt: skip
            records += scored
            runs.append(_unit_run(settings, variant, labels[variant], length, forwards, start))
            atomic_write_text(out / "results.jsonl", "".join(json.dumps(r) + "\n" for r in records))
            atomic_write_text(out / RUNS_FILE, "".join(json.dumps(r) + "\n" for r in runs))
        if not (out / "results.jsonl").exists():
            atomic_write_text(out / "results.jsonl", "")
        write_outputs(out, records, figures)
        write_comparisons(out, settings, records)
    return records, settings


def _unit_run(
    settings: dict[str, Any], variant: str, label: str, length: int, forwards: int, start: float
) -> dict[str, Any]:
    """The ``runs.jsonl`` record of a finished unit (``metric: unit``; ``value``: its forwards)."""
    return {
        "run": unit_id(variant, length),
        "encoding": label,
        "task": settings["task"],
        "seed": settings["seeds"][0],
        "metric": "unit",
        "length": length,
        "variant": variant,
        "value": forwards,
        "seconds": round(time.perf_counter() - start, 1),
    }


def _study_inputs(tokenizer: Any, settings: dict[str, Any], corpus: str | None) -> Tensor | None:
    """The evaluation text's token ids ``[N]`` (None for ``text-passkey``), checked to hold an
    ``eval_len`` window; and a check that the shortest passkey prompt fits its length."""
    task, eval_len = settings["task"], settings["eval_len"]
    text_ids: Tensor | None = None
    if runs_lm(task):
        text, corpus_label = study_text(corpus)
        text_ids = torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long)
        if len(text_ids) < eval_len:
            raise ValueError(
                f"--corpus {corpus_label} has {len(text_ids)} tokens, fewer than the requested "
                f"--eval-len {eval_len}"
            )
    for needle in (NEEDLES[part] for part in TASK_PARTS[task] if part in NEEDLES):
        shortest = min(settings["lengths"])
        try:
            needle.prompt(tokenizer, shortest, 0.0, random.Random(0))  # long enough?
        except ValueError as err:  # its message named no option (a default length the user never gave)
            raise ValueError(
                f"--lengths: the shortest {needle.task.removeprefix('text-')} length {shortest} is too short ({err}); give longer "
                f"--lengths (default: c/2, c, 1.5c, 2c of the context c = {settings['train_len']}, up to "
                "--eval-len), or --task text-lm"
            ) from err
    return text_ids


def _read(path: Path) -> list[dict[str, Any]]:
    return read_records(path) if path.exists() and path.stat().st_size else []


def _run_unit(
    model: nn.Module,
    tokenizer: Any,
    settings: dict[str, Any],
    variant: str,
    label: str,
    length: int,
    text_ids: Tensor | None,
    device: torch.device,
    progress: Callable[[int, int], None],
) -> tuple[list[dict[str, Any]], int]:
    """The records of one (variant, length) unit and the number of full-length forwards it ran."""
    task, examples, seed = settings["task"], settings["eval_examples"], settings["seeds"][0]
    do_lm = runs_lm(task) and length == settings["eval_len"]
    needles = [part for part in TASK_PARTS[task] if part in NEEDLES]
    depths = settings["depths"] or []
    total = (examples if do_lm else 0) + _trials(settings) * len(depths) * len(needles)
    base = {
        "run": unit_id(variant, length),
        "encoding": label,
        "seed": seed,
        "variant": variant,
        "train_len": settings["train_len"],
        "steps": 0,
    }
    done = [0]

    def tick() -> None:
        done[0] += 1
        progress(done[0], total)

    progress(0, total)
    records: list[dict[str, Any]] = []
    if do_lm:
        assert text_ids is not None
        records += _lm_records(model, text_ids, settings, length, base, device, tick)
    for needle in needles:
        cells = _needle_cells(NEEDLES[needle], model, tokenizer, settings, length, device, tick)
        hits, count = sum(c["hits"] for c in cells), sum(c["examples"] for c in cells)
        records.append(
            {
                **base,
                "task": NEEDLES[needle].task,
                "metric": "exact_match",
                "length": length,
                "value": hits / count,
                "examples": count,
                "hits": hits,
                "interval": list(wilson_interval(hits, count)),
                "by_depth": cells,
            }
        )
    return records, done[0]


def _lm_records(
    model: nn.Module,
    text_ids: Tensor,
    settings: dict[str, Any],
    length: int,
    base: dict[str, Any],
    device: torch.device,
    tick: Callable[[], None],
) -> list[dict[str, Any]]:
    """One ``perplexity`` record per position bucket, from the mean NLL over the unit's windows of
    ``length`` tokens of ``text_ids [N]``; ``tick()`` after each window."""
    examples, short = settings["eval_examples"], settings.get("longppl")
    rows, keys = [], []
    for start in window_starts(len(text_ids), length, examples):
        window = text_ids[start : start + length][None].to(device)
        rows.append(position_nll(model, window)[0].double().cpu())  # entry i: 1-based position i + 2
        if short:
            keys.append(
                key_tokens(rows[-1], short_context_nll(model, window, short["trunc"], short["stride"])[0])
            )
        tick()
    nll = torch.stack(rows)  # [windows, length - 1]
    return _bucket_records(nll, keys, settings, length, base)


def _bucket_records(
    nll: Tensor, keys: list[Tensor], settings: dict[str, Any], length: int, base: dict[str, Any]
) -> list[dict[str, Any]]:
    """The ``perplexity`` records of the windows' NLL ``[windows, length - 1]`` by position bucket,
    with LongPPL's key tokens there (``keys``: one mask per window, none without ``--longppl``)."""
    examples = nll.shape[0]
    mask = torch.stack(keys) if keys else None
    records = []
    for lo, hi in position_buckets(settings["train_len"], length):
        part = nll[:, max(lo, 1) - 1 : hi - 1]
        per_window = [float(v) for v in part.mean(dim=1)] if part.shape[1] else [float("nan")] * examples
        value = float(part.mean()) if part.shape[1] else float("nan")
        interval = bucket_interval(per_window) if part.shape[1] else None
        records.append(
            {
                **base,
                "task": "text-lm",
                "metric": "perplexity",
                "length": hi,
                "value": math.exp(value),
                "nll": value,
                "bucket": [lo, hi],
                "tokens": part.shape[1] * examples,
                "window": length,
                "examples": examples,
                "window_nll": per_window,
                "interval": None if interval is None else list(interval),
            }
        )
        if mask is not None:
            chosen = mask[:, max(lo, 1) - 1 : hi - 1]
            records[-1].update(key_tokens=int(chosen.sum()), longppl=long_ppl(part, chosen))
    return records


def _trials(settings: dict[str, Any]) -> int:
    """The needle prompts per (length, depth) cell: ``--trials``, else one per ``--windows`` (as
    folders from before ``--trials`` ran them)."""
    return int(settings.get("trials", settings["eval_examples"]))


def _needle_cells(
    needle: Needle,
    model: nn.Module,
    tokenizer: Any,
    settings: dict[str, Any],
    length: int,
    device: torch.device,
    tick: Callable[[], None],
) -> list[dict[str, Any]]:
    """A needle's exact match at ``length`` per depth (the heat map's cells), each with its count of
    hits, its 95% Wilson interval, and each trial's outcome (1 right, 0 wrong) and key, which every
    variant shares (the trial's random stream depends on the seed, length, depth and trial only);
    ``tick()`` after each trial."""
    examples, seed = _trials(settings), settings["seeds"][0]
    cells = []
    for index, depth in enumerate(settings["depths"] or []):
        outcomes, keys = [], []
        for trial in range(examples):
            rng = random.Random(f"{needle.salt}{seed}-{length}-{depth}-{trial}")
            ids, expected = needle.prompt(tokenizer, length, depth, rng)
            answer = greedy_answer(
                model,
                torch.tensor([ids], device=device),
                needle.steps,
                stop=lambda tokens: re.search(needle.stop_at, tokenizer.decode(tokens)) is not None,
            )
            outcomes.append(int(needle.right(tokenizer.decode(answer), expected)))
            keys.append(expected)
            tick()
        hits = sum(outcomes)
        cells.append(
            {
                "bucket": index,
                "depth": [depth, depth],
                "value": hits / examples,
                "examples": examples,
                "hits": hits,
                "interval": list(wilson_interval(hits, examples)),
                # Per prompt, in trial order: what McNemar's test pairs across variants (.paired).
                "outcomes": outcomes,
                "keys": keys,
            }
        )
    return cells
