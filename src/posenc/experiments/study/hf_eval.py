"""``posenc extrapolate --hf-model DIR``: evaluate a local HF causal LM beyond its training context.

``DIR`` may also be a fetched model's name (``smollm2-135m``) or a ``.gguf`` file, loaded by
:func:`posenc.pretrained.loading.load`. The tasks ``text``, ``text-lm`` and ``text-passkey`` are the
context-extension study of a pretrained model (:mod:`posenc.experiments.study.hf_study`); this module
runs ``lm`` and ``passkey``.

No training: the model in ``DIR`` is loaded with ``AutoModelForCausalLM.from_pretrained(DIR)`` and
scored by the harness's own metrics, so the results folder (``config.json``, ``results.jsonl``,
``results.csv``, ``extrapolation.png``, ``depth.png``), the summary table and ``posenc report`` are
those of a trained experiment. The training length ``L`` of the records is the model's
``config.max_position_embeddings``; ``eval_len`` is usually a multiple of it.

Tasks:

* ``lm``: perplexity at every position of windows from the held-out tenth of the corpus (default:
  the standard library's ``argparse`` source, as for the byte LM). When ``DIR`` holds a tokenizer,
  the corpus is tokenized with it and lengths count its tokens; otherwise the bytes themselves are
  the token ids (the model's vocabulary must cover 256) and lengths count bytes.
* ``passkey``: :class:`~posenc.experiments.tasks.retrieval.Passkey`; its symbol ids (``0..vocab_size-1``
  of the task, 4 special ids then the symbols) are used as token ids directly, so they must lie in
  the model's vocabulary. The scores say whether the model retrieves at long range as it is; a
  pretrained model sees these ids as arbitrary tokens, not as the text of the usual passkey prompt.

``variants`` evaluates the same weights again under other RoPE scalings set with
:func:`posenc.hf.set_rope_scaling` (``linear``, ``dynamic``, ``yarn``, ``ntk`` with the factor
``eval_len / L`` unless given as ``yarn:4``); each variant's records are labelled
``"<model> + <variant>"`` and get their own row, curve and panel.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from ...pretrained.loading import MODELS, causal_lm_class_name, load, load_config
from ..results.folders import FigureWriter, folder_lock, write_outputs
from ..results.records import RUNS_FILE, atomic_write_text, iid_record
from ..results.summary import summary_table
from ..runtime.distributed import Distributed, resolve_device
from ..tasks.catalog import PERPLEXITY, ByteLM, Task
from ..tasks.retrieval import Passkey
from ..train import ExperimentConfig
from .hf_methods import apply_variant, parse_variants, variant_parameters
from .hf_scaling import HF_TASKS, model_label, rope_parameters_for
from .hf_scaling import check_hf_folder as _check_folder
from .plan import variant_word

__all__ = [
    "HFCausalLM",
    "TokenizedLM",
    "evaluate_hf_model",
    "hf_task",
    "parse_variants",
    "rope_parameters_for",
    "summary",
]

#: The fit threshold of the per-run ``iid`` records (the harness's default; only exact-match metrics fit).
_FIT_THRESHOLD = 0.95


class HFCausalLM(nn.Module):
    """An HF causal LM as the harness's model: ``forward(inputs [B, T]) -> logits [B, T, V]`` (float32)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, inputs: Tensor, positions: Tensor | None = None) -> Tensor:
        extra = {} if positions is None else {"position_ids": positions}
        return self.model(input_ids=inputs, **extra).logits.float()


class TokenizedLM(ByteLM):
    """The byte LM's corpus and split, tokenized by an HF tokenizer (lengths count its tokens)."""

    def __init__(self, tokenizer: Any, corpus: str | Path | None = None, eval_fraction: float = 0.1) -> None:
        super().__init__(corpus, eval_fraction)
        text = bytes(torch.cat([self.train_data, self.eval_data]).tolist()).decode("utf-8", errors="replace")
        ids = torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long)
        split = int(len(ids) * (1 - eval_fraction))
        self.train_data, self.eval_data = ids[:split], ids[split:]
        self.vocab_size = len(tokenizer)
        self.corpus += " (tokenized)"


def _read_config(model_dir: Path) -> Any:
    """The model's HF config, read without its weights (:func:`posenc.pretrained.loading.load_config`): a
    folder that is no causal decoder or has no weights is refused here, before anything loads."""
    try:
        import transformers  # noqa: F401
    except ImportError as err:
        raise ValueError("--hf-model needs transformers: pip install 'posenc[hf]'") from err
    return load_config(model_dir)


def _load(model_dir: Path) -> tuple[nn.Module, Any]:
    """``(model in eval mode, tokenizer or None)`` from ``model_dir`` (its config checked already)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if str(model_dir) in MODELS or model_dir.suffix == ".gguf":  # a fetched model's name, a GGUF file
        return load(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    model.eval()
    tokenizer = None
    if any(
        (model_dir / name).is_file()
        for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
    ):
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return model, tokenizer


def hf_task(name: str, model: nn.Module, tokenizer: Any, *, num_symbols: int, corpus: str | None) -> Task:
    """The task ``name`` in the model's token ids; ``ValueError`` when the ids would not fit its vocabulary."""
    if name not in HF_TASKS:
        raise ValueError(f"--hf-model evaluates the tasks {', '.join(HF_TASKS)}, not {name!r}")
    vocab = int(model.config.vocab_size)
    if name == "lm":
        task: Task = ByteLM(corpus) if tokenizer is None else TokenizedLM(tokenizer, corpus)
    else:
        task = Passkey(num_symbols=num_symbols)
    if task.vocab_size > vocab:
        what = "bytes as token ids" if name == "lm" else f"passkey symbols (--num-symbols {num_symbols})"
        raise ValueError(
            f"--hf-model: {what} need {task.vocab_size} token ids but the model's vocabulary has {vocab}"
            + ("; lower --num-symbols" if name == "passkey" else "; save a tokenizer in the model folder")
        )
    return task


def evaluate_hf_model(
    model_dir: str | Path,
    out: str | Path,
    *,
    task: str = "lm",
    eval_len: int | None = None,
    eval_examples: int = 20,
    eval_batch: int = 20,
    seeds: list[int] | None = None,
    num_symbols: int = 64,
    corpus: str | None = None,
    variants: list[str] | None = None,
    device: str = "cpu",
    report: Callable[[str, str, int, int, str], None] | None = None,
    figures: FigureWriter | None = None,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Evaluate the HF causal LM in ``model_dir`` on ``task`` at every length ``1..eval_len``
    (default ``4 L``) and write the results folder ``out``; returns ``(records, settings)``.
    ``figures`` draws the folder's figures (:func:`posenc.viz.folder.write_figures`). Every option is
    checked against the model's config before its weights load."""
    model_dir, out = Path(model_dir), Path(out)
    if task not in HF_TASKS:
        raise ValueError(f"--hf-model evaluates the tasks {', '.join(HF_TASKS)}, not {task!r}")
    train_len, eval_len, scalings = _plan(_read_config(model_dir), model_dir, eval_len, variants)
    seeds = [0] if seeds is None else list(seeds)
    if eval_examples < 1 or eval_batch < 1 or not seeds or len(set(seeds)) != len(seeds):
        raise ValueError("--eval-examples and the evaluation batch must be positive, --seeds distinct")
    model, tokenizer = _load(model_dir)
    the_task = hf_task(task, model, tokenizer, num_symbols=num_symbols, corpus=corpus)
    the_task.check_length(eval_len)
    base_name = model_label(model_dir)
    labels = {v: base_name if v == "none" else f"{base_name} + {v}" for v in scalings}
    settings = {
        "task": task,
        "hf_model": str(model_dir),
        "model_class": type(model).__name__,
        "train_len": train_len,
        "eval_len": eval_len,
        "eval_examples": eval_examples,
        "eval_batch": eval_batch,
        "num_symbols": num_symbols if task == "passkey" else None,
        "corpus": corpus,
        "tokenizer": tokenizer is not None,
        "encodings": list(labels.values()),
        "variants": {labels[v]: scalings[v] for v in scalings},
        "seeds": seeds,
        "steps": 0,
    }
    torch_device = resolve_device(device, Distributed())
    model.to(torch_device)
    _probe(model, the_task.sequence_length(eval_len), torch_device)
    progress = report or (lambda *args: None)
    with folder_lock(out):
        _check_folder(out, settings)
        out.mkdir(parents=True, exist_ok=True)
        atomic_write_text(
            out / "config.json",
            json.dumps({"experiment": settings, "runtime": {"device": str(torch_device)}}, indent=2) + "\n",
        )
        records = _evaluate_variants(model, the_task, settings, scalings, labels, out, progress)
        write_outputs(out, records, figures)
    return records, settings


def _plan(
    config: Any, model_dir: Path, eval_len: int | None, variants: list[str] | None
) -> tuple[int, int, dict[str, dict[str, Any] | None]]:
    """``(train_len, eval_len, rope_parameters by variant)`` from the model's config alone;
    ``ValueError`` naming the option at fault."""
    train_len = int(getattr(config, "max_position_embeddings", 0) or 0)
    if train_len < 1:
        raise ValueError(
            f"--hf-model {model_dir}: its config has no max_position_embeddings (training context)"
        )
    eval_len = 4 * train_len if eval_len is None else eval_len
    if eval_len <= train_len:
        raise ValueError(
            f"--eval-len {eval_len} must exceed the model's training context {train_len} "
            f"(config.max_position_embeddings), e.g. --eval-len {4 * train_len}"
        )
    names = parse_variants(",".join(variants) if variants else None)
    scalings = {variant: variant_parameters(variant, config, train_len, eval_len) for variant in names}
    if not getattr(config, "rope_parameters", None) and any(scalings.values()):
        raise ValueError(f"--eval-variants: {causal_lm_class_name(config)} has no rope_parameters to scale")
    return train_len, eval_len, scalings


def _evaluate_variants(
    model: nn.Module,
    task: Task,
    settings: dict[str, Any],
    scalings: dict[str, dict[str, Any] | None],
    labels: dict[str, str],
    out: Path,
    progress: Callable[[str, str, int, int, str], None],
) -> list[dict[str, Any]]:
    """Score every (variant, seed) and write ``results.jsonl`` and ``runs.jsonl``; returns the records."""
    original = dict(getattr(model.config, "rope_parameters", None) or {})
    records: list[dict[str, Any]] = []
    runs: list[dict[str, Any]] = []
    train_len = settings["train_len"]
    for variant, scaling in scalings.items():
        apply_variant(model, scaling, original)
        for seed in settings["seeds"]:
            scored = _evaluate_once(
                HFCausalLM(model), task, settings, labels[variant], variant, seed, progress
            )
            records += scored
            runs.append(iid_record(scored, task.metric, train_len, _FIT_THRESHOLD, steps_trained=0))
    atomic_write_text(out / RUNS_FILE, "".join(json.dumps(r) + "\n" for r in runs))
    atomic_write_text(out / "results.jsonl", "".join(json.dumps(r) + "\n" for r in records))
    return records


def _probe(model: nn.Module, tokens: int, device: torch.device) -> None:
    """Run ``tokens`` tokens once, so a model that cannot reach the longest length fails before anything is written."""
    try:
        with torch.no_grad():
            model(input_ids=torch.zeros(1, tokens, dtype=torch.long, device=device))
    except (IndexError, RuntimeError, ValueError) as err:
        raise ValueError(
            f"--hf-model: {type(model).__name__} cannot run {tokens} tokens ({type(err).__name__}: {err}); "
            "learned absolute positions end at max_position_embeddings: lower --eval-len"
        ) from err


def _evaluate_once(
    model: nn.Module,
    task: Task,
    settings: dict[str, Any],
    label: str,
    variant: str,
    seed: int,
    progress: Callable[[str, str, int, int, str], None],
) -> list[dict[str, Any]]:
    """The records of one (variant, seed): the task's metric at every length, as trained runs record them."""
    scores = task.metric.evaluate(
        model,
        task,
        eval_len=settings["eval_len"],
        examples=settings["eval_examples"],
        batch_size=settings["eval_batch"],
        seed=seed,
        progress=lambda done, total: progress(f"{label} seed {seed}", "eval", done, total, ""),
    )
    base = {
        "run": f"hf__{settings['task']}__{variant_word(variant)}__seed{seed}",
        "encoding": label,
        "task": settings["task"],
        "seed": seed,
    }
    return [
        {
            **base,
            "length": score.length,
            "metric": score.metric,
            "value": score.value,
            "train_len": settings["train_len"],
            "steps": 0,
            "examples": settings["eval_examples"],
            **(score.details or {}),
        }
        for score in scores
    ]


def _summary_config(settings: dict[str, Any]) -> Any:
    """An :class:`ExperimentConfig` carrying what the summary table and figures read."""
    return ExperimentConfig(
        task=settings["task"],
        encodings=list(settings["encodings"]),
        train_len=settings["train_len"],
        eval_len=max(settings["eval_len"], settings["train_len"]),
        seeds=list(settings["seeds"]),
    )


def summary(settings: dict[str, Any], records: list[dict[str, Any]]) -> Any:
    """The summary table of an HF evaluation (the trained experiments' table, L = the trained context)."""
    metric = PERPLEXITY if settings["task"] == "lm" else Passkey.metric
    table = summary_table(_summary_config(settings), records, metric)
    return type(table)(
        table.title.replace("trained on", "trained context"), table.columns, table.rows, table.notes
    )
