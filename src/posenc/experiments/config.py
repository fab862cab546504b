"""What one experiment is: :class:`ExperimentConfig` (the task, the lengths, the model, the training and
the encodings) and :class:`RunSpec` (one encoding and seed of it), with the id that names a run's files
(:func:`run_id_for`). :mod:`posenc.experiments.train` runs them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..encodings.spec import LAYER_SEPARATOR, split_layers, split_specs
from ..layers.patterns import available_layer_presets
from .tasks.catalog import Task, make_task

__all__ = ["ExperimentConfig", "RunSpec", "layer_specs", "run_id_for"]


def _choice(text: str, choices: dict[str, Any]) -> Any:
    """The value of ``text`` among ``choices`` (``ValueError`` naming the choices)."""
    if text not in choices:
        raise ValueError(f"must be {' or '.join(choices)}, got {text!r}")
    return choices[text]


@dataclass
class ExperimentConfig:
    """Everything that defines an ``extrapolate`` experiment (written to ``config.json``).

    ``posenc extrapolate`` has one option per field, generated from the field's metadata: ``help``
    (its help text), ``option`` (False: not an option; a name: the option's name), ``type`` and
    ``default`` (of the option, when they differ from the field's), ``parse`` (text to value, for
    lists and renamed options) and ``min``.

    Lengths are task sizes (:mod:`posenc.experiments.tasks.catalog`): training draws sizes uniformly from
    ``[min_train_len, train_len]``; evaluation scores every size ``1..eval_len`` (for ``lm``: every
    position of ``eval_len``-byte windows).
    """

    task: str = field(default="copy", metadata={"help": "task (a name in TASKS)"})
    encodings: list[str] = field(
        default_factory=lambda: ["nope", "learned", "sinusoidal", "rope", "alibi", "t5", "shaw"],
        metadata={
            "help": "comma-separated encoding specs, options included: nope,alibi or rope:base=500000,pairing=half; "
            "a hybrid gives one spec per layer joined by '/': t5/sinusoidal; a layer preset with its "
            "options: gemma3:window=8, llama4:chunk=8, gpt-oss:window=8 (presets: "
            + ", ".join(available_layer_presets())
            + ")",
            "parse": split_specs,
        },
    )
    train_len: int = field(
        default=16, metadata={"help": "largest training length L (task size; lm: context length)"}
    )
    eval_len: int = field(default=48, metadata={"help": "evaluate every length 1..eval_len"})
    min_train_len: int = field(default=1, metadata={"help": "smallest training length"})
    steps: int = field(default=2000, metadata={"help": "training steps per run"})
    seeds: list[int] = field(default_factory=lambda: [0], metadata={"help": "comma-separated seeds"})
    batch_size: int = 32
    lr: float = field(
        default=3e-3, metadata={"help": "peak AdamW learning rate (warm-up, then cosine to 10%)"}
    )
    warmup: int = field(
        default=100, metadata={"help": "linear learning-rate warm-up steps before the cosine decay (0: none)"}
    )
    weight_decay: float = field(default=0.0, metadata={"option": False})
    grad_clip: float = field(default=1.0, metadata={"option": False})
    d_model: int = 64
    num_layers: int = 2
    num_heads: int = 4
    d_ff: int = 256
    dropout: float = 0.0
    num_symbols: int = field(default=64, metadata={"help": "alphabet size of the synthetic tasks"})
    distinct: bool = field(default=True, metadata={"help": "copy/reverse/sort: draw distinct symbols"})
    corpus: str | None = field(
        default=None,
        metadata={"help": "lm: a text file (default: the stdlib argparse source)", "type": Path},
    )
    eval_examples: int = field(default=100, metadata={"help": "examples per evaluated length (lm: windows)"})
    #: The command line sets it to ``min(eval_examples, 100)``.
    eval_batch: int = field(default=100, metadata={"option": False})
    checkpoint_every: int = field(default=250, metadata={"help": "checkpoint every N steps"})
    backend: str = field(default="auto", metadata={"help": "attention backend (auto picks per call)"})
    #: Pack several training examples into each row (document_ids keep them apart; positions
    #: restart at each example), instead of one right-padded example per row.
    pack: bool = field(
        default=False,
        metadata={
            "help": "pack several training examples per row (packed documents: positions restart per example)"
        },
    )
    #: Randomized positional encodings (Ruoss et al. 2023): train each sequence at n sorted distinct
    #: positions drawn uniformly from [0, N) instead of 0..n-1. None: off.
    randomize_positions: int | None = field(
        default=None,
        metadata={
            "help": "randomized positions (Ruoss et al. 2023): train each sequence at sorted distinct positions "
            "drawn from [0, N)"
        },
    )
    #: With ``randomize_positions``: evaluate at positions drawn the same way (the paper's reference
    #: code samples at test time too; the CLI's default, ``--eval-positions random``), or at 0..n-1
    #: when False (this default, what folders written before the option hold).
    randomize_eval_positions: bool = field(
        default=False,
        metadata={
            "option": "eval_positions",
            "type": str,
            "default": "random",
            "parse": lambda text: _choice(text, {"random": True, "contiguous": False}),
            "help": "with --randomize-positions: evaluate at positions drawn the same way (random, the paper's "
            "protocol) or at 0..n-1 (contiguous)",
        },
    )
    #: A run *fits* when its in-distribution score (exact match over lengths <= train_len) reaches
    #: this; the summary ranks only encodings whose every seed fits. Display only (not compared),
    #: unless ``until_fit`` stops training on it.
    fit_threshold: float = field(
        default=0.95,
        metadata={
            "help": "a run fits when its exact match over the training lengths reaches this; encodings whose "
            "seeds do not all fit are not ranked"
        },
    )
    #: Train each run until it fits (its in-distribution exact match, checked every
    #: ``fit_check_every`` steps on held-out examples, reaches ``fit_threshold``) or ``steps`` run
    #: out; the steps it took are recorded in its ``iid`` record.
    until_fit: bool = field(
        default=False,
        metadata={
            "help": "train each run until it fits (checked every --fit-check-every steps on held-out examples) "
            "or --steps run out; the steps it took go into its iid record"
        },
    )
    #: With ``until_fit``: train until the held-out score reaches ``fit_threshold + fit_margin``
    #: (refused above 1), so that the evaluation, which scores other examples, also clears the threshold.
    fit_margin: float = field(
        default=0.0,
        metadata={
            "help": "with --until-fit: train until the held-out score reaches --fit-threshold plus this (the "
            "evaluation scores other examples; a margin keeps a run that just fit from falling under the threshold there)"
        },
    )
    #: With ``until_fit``: steps between two fit checks.
    fit_check_every: int = field(
        default=250, metadata={"help": "with --until-fit: steps between two fit checks", "min": 1}
    )
    #: Inference-time variants (:mod:`posenc.experiments.variants`) each trained checkpoint is
    #: evaluated under again, without retraining: ``["yarn", "temperature:0.2"]``.
    eval_variants: list[str] = field(
        default_factory=list,
        metadata={
            "help": "evaluate each trained model (or --hf-model) again under these settings, no retraining: "
            "RoPE scalings linear,ntk,dynamic,yarn,longrope (NAME:FACTOR; the factor defaults to the longest evaluated "
            "sequence over the longest trained one, in tokens; with --hf-model, --eval-len over its context), "
            "prope:P, drop_rotation, temperature:BETA (any encoding); one row each"
        },
    )

    #: Fields that may differ between the first command and a resumed one (they do not change results).
    RUNTIME_FIELDS = ("encodings", "seeds", "fit_threshold", "eval_variants")

    def validate(self) -> None:
        checks = [
            ("train_len", self.train_len >= 1, "at least 1"),
            ("eval_len", self.eval_len >= self.train_len, "at least train_len"),
            ("min_train_len", 1 <= self.min_train_len <= self.train_len, "between 1 and train_len"),
            ("steps", self.steps >= 1, "at least 1"),
            ("batch_size", self.batch_size >= 1, "at least 1"),
            # Written `0 < x < inf`, not `x > 0`: nan fails every comparison, but inf passes `> 0`
            # and trains nan weights that still write records.
            ("lr", 0 < self.lr < math.inf, "positive and finite"),
            ("weight_decay", 0 <= self.weight_decay < math.inf, "0 or more and finite"),
            ("grad_clip", 0 <= self.grad_clip < math.inf, "0 (no clipping) or a positive finite norm"),
            ("dropout", 0 <= self.dropout < 1, "in [0, 1)"),
            ("warmup", self.warmup >= 0, "0 or more steps"),
            ("eval_examples", self.eval_examples >= 1, "at least 1"),
            ("checkpoint_every", self.checkpoint_every >= 1, "at least 1"),
            (
                "encodings",
                len(self.encodings) > 0 and len(set(self.encodings)) == len(self.encodings),
                "one or more, no duplicates",
            ),
            (
                "seeds",
                len(self.seeds) > 0 and len(set(self.seeds)) == len(self.seeds),
                "one or more, no duplicates",
            ),
            (
                "randomize_positions",
                self.randomize_positions is None or self.randomize_positions >= 1,
                "at least 1 (or unset)",
            ),
            ("fit_threshold", 0 < self.fit_threshold <= 1, "in (0, 1]"),
            ("fit_check_every", self.fit_check_every >= 1, "at least 1"),
            ("fit_margin", 0 <= self.fit_margin < 1, "in [0, 1)"),
        ]
        for name, ok, need in checks:
            if not ok:
                raise ValueError(f"invalid {name}={getattr(self, name)!r}: must be {need}")
        self._check_fit_target()

    def _check_fit_target(self) -> None:
        """With ``until_fit``, the held-out score to reach, ``fit_threshold + fit_margin``, must be
        at most 1: above it no run fits and each trains to ``steps`` without a word."""
        target = self.fit_threshold + self.fit_margin
        if self.until_fit and target > 1 + 1e-9:  # 1e-9: 0.95 + 0.05 may round above 1
            raise ValueError(
                f"invalid fit_margin={self.fit_margin!r}: with until_fit, fit_threshold + fit_margin = "
                f"{self.fit_threshold!r} + {self.fit_margin!r} = {target:.4g} asks for an exact match above "
                f"100%, which no run reaches; lower --fit-margin to at most {1 - self.fit_threshold:.4g} "
                "(or --fit-threshold)"
            )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_settings(cls, settings: dict[str, Any]) -> ExperimentConfig:
        """The config of a folder's saved ``settings``; fields this version does not know are left out
        (they only matter to the version that wrote them)."""
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in settings.items() if k in known})

    def identity(self) -> dict[str, Any]:
        """The settings that must match for a resumed run to reuse this folder's results."""
        settings = {k: v for k, v in self.to_dict().items() if k not in self.RUNTIME_FIELDS}
        if self.randomize_positions is None:  # how to evaluate randomized positions does not apply
            settings.pop("randomize_eval_positions")
        if self.until_fit:  # training stops when the run fits: the threshold changes the results
            settings["fit_threshold"] = self.fit_threshold
        else:
            settings.pop("fit_check_every")
            settings.pop("fit_margin")
        return settings

    def make_task(self) -> Task:
        return make_task(self.task, num_symbols=self.num_symbols, distinct=self.distinct, corpus=self.corpus)


@dataclass(frozen=True)
class RunSpec:
    """One (encoding, seed) run of an experiment."""

    encoding: str
    seed: int

    @property
    def label(self) -> str:
        return f"{self.encoding} seed {self.seed}"


def run_id_for(config: ExperimentConfig, run: RunSpec) -> str:
    """A file-name-safe id, e.g. ``rope__copy__seed0`` (options and hybrids hashed into it)."""
    layers = run.encoding.split(LAYER_SEPARATOR)
    name = "+".join(layer.split(":")[0] for layer in layers)
    if ":" in run.encoding or len(layers) > 1:
        name += "-" + hashlib.sha1(run.encoding.encode()).hexdigest()[:8]
    return f"{name}__{config.task}__seed{run.seed}"


def layer_specs(encoding: str) -> str | list[str]:
    """``"t5/sinusoidal"`` -> ``["t5", "sinusoidal"]`` (one spec per layer); a single spec as is."""
    layers = split_layers(encoding)
    return layers if len(layers) > 1 else encoding
