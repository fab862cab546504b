"""One run: train a :class:`~posenc.TransformerLM` with one encoding on one task and seed, then
evaluate it at every length up to ``eval_len``.

Determinism and resume: the training batch and the dropout noise of step ``s`` are drawn from
generators seeded with ``(seed, rank, s)``, so restoring the model, optimizer, scheduler and step
from a checkpoint continues the run exactly as if it had never stopped (the checkpoint also keeps
the global RNG state for anything else that draws from it). Evaluation data depend only on
``(seed, length)``, so every encoding is scored on the same examples.
"""

from __future__ import annotations

import dataclasses
import math
import os
import signal
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..layers.model import TransformerLM
from ..layers.patterns import is_layer_preset
from .config import ExperimentConfig, RunSpec, layer_specs, run_id_for  # re-exported: the run's config
from .results.records import atomic_write, iid_record
from .tasks.catalog import IGNORE, Task, mix_seed

__all__ = [
    "INTERRUPT_ENV",
    "ExperimentConfig",
    "Interrupted",
    "PositionSampler",
    "RunSpec",
    "continue_training",
    "run_id_for",
    "train_and_evaluate",
]

#: Test hook: stop (as if interrupted with Ctrl-C) after this many training steps in this process.
INTERRUPT_ENV = "POSENC_INTERRUPT_AFTER_STEPS"

Reporter = Callable[[str, str, int, int, str], None]

#: ``(rows, width, generator) -> [rows, width]`` training position ids (PoSE, CREAM): drawn after the
#: step's batch from the step's data generator, so a resumed run draws the same ones.
PositionSampler = Callable[[int, int, torch.Generator], torch.Tensor]

#: Training steps taken by this process (all runs), for the :data:`INTERRUPT_ENV` test hook.
_steps_this_process = 0


class Interrupted(Exception):
    """Training stopped on request (Ctrl-C, SIGTERM or the test hook) after saving a checkpoint."""


class _StopFlag:
    """Turns SIGINT/SIGTERM into a flag that the training loop checks between steps."""

    def __init__(self) -> None:
        self.raised = False
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> _StopFlag:
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread: leave signals alone
                pass
        return self

    def _handle(self, signum, frame) -> None:
        self.raised = True

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def build_model(
    config: ExperimentConfig, task: Task, encoding: str, pattern: list[Any] | None = None
) -> nn.Module:
    """The experiment's model. ``max_len`` covers the longest evaluated sequence, so a learned
    absolute table has rows for every evaluated position; rows past the training positions are
    never updated and stay at their random initialisation (the honest reason learned PE fails).
    ``encoding`` may name one spec per layer separated by ``/`` (a hybrid, see :mod:`posenc.layers.model`),
    or a layer preset (``"gemma3:window=8"``, see :mod:`posenc.layers.patterns`); ``pattern``, one
    :class:`~posenc.layers.patterns.LayerSpec` per layer, replaces the preset's own (an extension
    recipe that changes some of its layers)."""
    if pattern is not None:
        layers: dict[str, Any] = {"pattern": pattern}
    elif is_layer_preset(encoding):
        layers = {"pattern": encoding}
    else:
        layers = {"encoding": layer_specs(encoding)}
    return TransformerLM(
        task.vocab_size,
        config.d_model,
        config.num_layers,
        config.num_heads,
        **layers,
        d_ff=config.d_ff,
        dropout=config.dropout,
        max_len=max(task.sequence_length(config.eval_len), config.randomize_positions or 0),
        backend=config.backend,
    )


def _lr_factor(config: ExperimentConfig) -> Callable[[int], float]:
    """Linear warm-up, then cosine decay to 10% of the peak."""

    def factor(step: int) -> float:
        if step < config.warmup:
            return (step + 1) / config.warmup
        progress = (step - config.warmup) / max(1, config.steps - config.warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return factor


def _save_checkpoint(path: Path, state: dict[str, Any]) -> None:
    """Atomically (temporary file, fsync, rename; mode 0644): a kill never leaves half a checkpoint."""
    atomic_write(path, lambda handle: torch.save(state, handle))


def random_positions(batch: int, length: int, max_position: int, generator: torch.Generator) -> torch.Tensor:
    """``[batch, length]`` positions: per row, ``length`` distinct values drawn uniformly from
    ``[0, max_position)`` without replacement and sorted (Ruoss et al. 2023, randomized positional
    encodings)."""
    if not 1 <= length <= max_position:
        raise ValueError(
            f"--randomize-positions {max_position} must be at least the training sequence length {length}"
        )
    order = torch.rand(batch, max_position, generator=generator).argsort(dim=1)
    return order[:, :length].sort(dim=1).values


def _eval_position_sampler(
    config: ExperimentConfig, run: RunSpec
) -> Callable[[int, int], torch.Tensor] | None:
    """Randomized positions at evaluation (their own seeded stream, so the data stay those of 0..n-1)."""
    if config.randomize_positions is None or not config.randomize_eval_positions:
        return None
    generator = torch.Generator().manual_seed(mix_seed(run.seed, "eval-positions"))
    return lambda rows, width: random_positions(rows, width, config.randomize_positions, generator)


_CHECKPOINT_KEYS = ("model", "optimizer", "scheduler", "torch_rng", "step", "run")


def load_checkpoint(path: Path, run: RunSpec, device: torch.device | str = "cpu") -> dict[str, Any]:
    """The state saved in ``path`` for ``run``; ``ValueError`` naming the file when it is damaged,
    foreign, or written by another run (deleting it restarts that run from step 0)."""
    fix = f"delete it to restart {run.label} from step 0"
    try:
        state = torch.load(path, map_location=device, weights_only=False)
    except Exception as err:  # truncated, zero bytes, random bytes: torch raises many types
        raise ValueError(f"checkpoint {path} cannot be read ({type(err).__name__}: {err}); {fix}") from err
    missing = [key for key in _CHECKPOINT_KEYS if not isinstance(state, dict) or key not in state]
    if missing:
        raise ValueError(f"checkpoint {path} is not a posenc run checkpoint (no {', '.join(missing)}); {fix}")
    if state["run"] != dataclasses.asdict(run):
        raise ValueError(f"checkpoint {path} belongs to run {state['run']}, not {run.label}; {fix}")
    return state


def _loss(
    model: nn.Module,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    document_ids: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
) -> torch.Tensor:
    extra = {k: v for k, v in (("document_ids", document_ids), ("positions", positions)) if v is not None}
    logits = model(inputs, **extra)
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE)


def train_and_evaluate(
    config: ExperimentConfig,
    run: RunSpec,
    checkpoint_path: Path,
    report: Reporter,
    *,
    rank: int = 0,
    world_size: int = 1,
    device: torch.device | None = None,
    log: Callable[[str], None] = lambda message: None,
    should_stop: Callable[[], bool] = lambda: False,
) -> list[dict[str, Any]]:
    """Train (resuming from ``checkpoint_path`` when it exists), then evaluate; return the records.

    Under DDP every rank calls this; rank 0 writes checkpoints and evaluates (the other ranks
    return an empty list). ``report(run_label, phase, done, total, note)`` receives progress.
    Raises :class:`Interrupted` after saving a checkpoint when asked to stop. ``log`` receives
    one-line notes (resuming from a checkpoint); ``should_stop()`` is polled between steps.
    """
    if should_stop():
        raise Interrupted(f"{run.label}: not started (stop requested)")
    task = config.make_task()
    torch.manual_seed(mix_seed(run.seed, "init"))
    device = device or torch.device("cpu")
    training = _Training.start(config, task, run, device)
    if checkpoint_path.exists():
        training.resume(load_checkpoint(checkpoint_path, run, device))
        log(f"{run.label}: resumed from its checkpoint at step {training.step}/{config.steps}")
    saver = _Saver(checkpoint_path, rank, world_size, run, config)
    _train(training, config, task, run, saver, report, device, should_stop)
    if rank != 0:
        return []
    records = evaluate(training.model, config, task, run, report)
    fit_steps = {"steps_trained": training.step}
    if config.until_fit:
        fit_steps["steps_to_fit"] = training.fitted_at  # None: it did not fit within --steps
    return [*records, iid_record(records, task.metric, config.train_len, config.fit_threshold, **fit_steps)]


def continue_training(
    model: nn.Module,
    config: ExperimentConfig,
    task: Task,
    run: RunSpec,
    checkpoint_path: Path,
    report: Reporter,
    *,
    sample_positions: PositionSampler | None = None,
    device: torch.device | None = None,
    log: Callable[[str], None] = lambda message: None,
) -> tuple[int, int]:
    """Train ``model`` (its weights as given: trained, changed or fresh) for ``config.steps`` steps of
    ``config``'s task and schedule with a new AdamW, resuming from ``checkpoint_path`` when it exists
    and saving it as :func:`train_and_evaluate` does; returns ``(steps trained, positions seen)``
    (rows x padded width summed over the batches, the resumed part included). The batches and
    dropout of step ``s`` come from ``(run.seed, s)``; ``sample_positions`` gives the training
    position ids (PoSE, CREAM). Raises :class:`Interrupted` after saving when asked to stop."""
    device = device or torch.device("cpu")
    training = _Training.around(config, model.to(device), sample_positions)
    if checkpoint_path.exists():
        training.resume(load_checkpoint(checkpoint_path, run, device))
        log(f"{run.label}: resumed from its checkpoint at step {training.step}/{config.steps}")
    saver = _Saver(checkpoint_path, 0, 1, run, config)
    _train(training, config, task, run, saver, report, device, lambda: False)
    return training.step, training.positions_seen


@dataclass
class _Training:
    """A run's training as it goes: what a checkpoint saves, and the step it has reached."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    step: int = 0
    fitted_at: int | None = None  # the step at which an ``until_fit`` run fitted
    sample_positions: PositionSampler | None = None  # training position ids other than 0..n-1
    positions_seen: int = 0  # rows x padded width of every batch trained on (the compute spent)

    @classmethod
    def start(cls, config: ExperimentConfig, task: Task, run: RunSpec, device: torch.device) -> _Training:
        """A fresh model (from the global RNG, seeded by the caller), its AdamW and its schedule."""
        return cls.around(config, build_model(config, task, run.encoding).to(device))

    @classmethod
    def around(
        cls, config: ExperimentConfig, model: nn.Module, sample_positions: PositionSampler | None = None
    ) -> _Training:
        """``model`` (fresh or trained) with a new AdamW and schedule from ``config``."""
        optimizer = torch.optim.AdamW(
            model.parameters(), lr=config.lr, betas=(0.9, 0.98), weight_decay=config.weight_decay
        )
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _lr_factor(config))
        return cls(model, optimizer, scheduler, sample_positions=sample_positions)

    def resume(self, state: dict[str, Any]) -> None:
        """Continue from a checkpoint's ``state`` (:func:`load_checkpoint`), the global RNG included."""
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        torch.set_rng_state(state["torch_rng"].cpu())
        self.step = int(state["step"])
        self.fitted_at = state.get("fitted_at")
        self.positions_seen = int(state.get("positions_seen", 0))


@dataclass(frozen=True)
class _Saver:
    """Saves a run's checkpoint (rank 0 writes it; every rank waits for it)."""

    path: Path
    rank: int
    world_size: int
    run: RunSpec
    config: ExperimentConfig

    def __call__(self, training: _Training) -> None:
        if self.rank == 0:
            _save_checkpoint(
                self.path,
                {
                    "model": training.model.state_dict(),
                    "optimizer": training.optimizer.state_dict(),
                    "scheduler": training.scheduler.state_dict(),
                    "torch_rng": torch.get_rng_state(),
                    "step": training.step,
                    "fitted_at": training.fitted_at,
                    "positions_seen": training.positions_seen,
                    "run": dataclasses.asdict(self.run),
                    "config": self.config.to_dict(),
                },
            )
        _barrier(self.world_size)


def _train(
    training: _Training,
    config: ExperimentConfig,
    task: Task,
    run: RunSpec,
    saver: _Saver,
    report: Reporter,
    device: torch.device,
    should_stop: Callable[[], bool],
) -> None:
    """Step until ``config.steps`` (or, ``until_fit``, until the run fits), checking for a fit and
    saving checkpoints on schedule; a stop request saves one and raises :class:`Interrupted`."""
    global _steps_this_process
    rank, world_size = saver.rank, saver.world_size
    trained = _wrap_ddp(training.model, world_size)
    interrupt_after = int(os.environ.get(INTERRUPT_ENV, "0") or 0)
    data_generator = torch.Generator()
    report(run.label, "train", training.step, config.steps, "resumed" if training.step else "")
    training.model.train()
    with _StopFlag() as stop:
        while training.step < config.steps and training.fitted_at is None:
            loss = _train_step(training, trained, config, task, run, rank, data_generator, device)
            step = training.step
            _steps_this_process += 1
            report(run.label, "train", step, config.steps, f"loss {loss.item():.3f}")
            if config.until_fit and (step % config.fit_check_every == 0 or step == config.steps):
                _check_fit(training, config, task, run, rank, world_size, report)
            stop_now = _any_rank(
                stop.raised or should_stop() or (interrupt_after and _steps_this_process >= interrupt_after),
                world_size,
            )
            if step % config.checkpoint_every == 0 or step == config.steps or stop_now or training.fitted_at:
                saver(training)
            if stop_now:
                raise Interrupted(f"{run.label}: stopped at step {step}/{config.steps}; checkpoint saved")


def _train_step(
    training: _Training,
    trained: nn.Module,
    config: ExperimentConfig,
    task: Task,
    run: RunSpec,
    rank: int,
    data_generator: torch.Generator,
    device: torch.device,
) -> torch.Tensor:
    """One optimizer step of ``trained`` (the model, or its DDP wrapper) on the batch and dropout
    noise of ``(seed, rank, step)``; advances ``training.step`` and returns the step's loss."""
    step = training.step
    data_generator.manual_seed(mix_seed(run.seed, rank, step, "data"))
    torch.manual_seed(mix_seed(run.seed, rank, step, "dropout"))
    make_batch = task.packed_train_batch if config.pack else task.train_batch
    batch = make_batch(config.min_train_len, config.train_len, config.batch_size, data_generator)
    documents = None if batch.document_ids is None else batch.document_ids.to(device)
    positions = None
    rows, width = batch.inputs.shape
    training.positions_seen += rows * width
    if training.sample_positions is not None:
        positions = training.sample_positions(rows, width, data_generator).to(device)
    elif config.randomize_positions is not None:
        positions = random_positions(rows, width, config.randomize_positions, data_generator).to(device)
    loss = _loss(trained, batch.inputs.to(device), batch.targets.to(device), documents, positions)
    training.optimizer.zero_grad(set_to_none=True)
    loss.backward()
    if config.grad_clip > 0:
        nn.utils.clip_grad_norm_(training.model.parameters(), config.grad_clip)
    training.optimizer.step()
    training.scheduler.step()
    training.step += 1
    return loss


def _check_fit(
    training: _Training,
    config: ExperimentConfig,
    task: Task,
    run: RunSpec,
    rank: int,
    world_size: int,
    report: Reporter,
) -> None:
    """``until_fit``: score the in-distribution check (rank 0), and mark the run fitted at this step
    when any rank's score clears the threshold plus its margin."""
    score = fit_check_score(training.model, config, task, run) if rank == 0 else 0.0
    if _any_rank(score >= min(1.0, config.fit_threshold + config.fit_margin), world_size):
        training.fitted_at = training.step
    report(run.label, "train", training.step, config.steps, f"in-distribution {task.metric.format(score)}")
    training.model.train()


#: The seed label of the examples an ``until_fit`` run is checked on: drawn apart from the
#: evaluation's, so stopping on them does not select the examples the run is scored on.
FIT_CHECK_STREAM = "fit-check"


def fit_check_score(model: nn.Module, config: ExperimentConfig, task: Task, run: RunSpec) -> float:
    """The in-distribution score (mean exact match over lengths ``1..train_len``) of ``model`` on
    ``eval_examples`` held-out examples per length of their own seeded stream; leaves it in eval mode."""
    model.eval()
    scores = task.metric.evaluate(
        model,
        task,
        eval_len=config.train_len,
        examples=config.eval_examples,
        batch_size=config.eval_batch,
        seed=mix_seed(run.seed, FIT_CHECK_STREAM),
        progress=lambda done, total: None,
        positions=_eval_position_sampler(config, run),
    )
    return statistics.mean(score.value for score in scores if score.metric == task.metric.name)


def _wrap_ddp(model: nn.Module, world_size: int) -> nn.Module:
    if world_size <= 1:
        return model
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(model)


def _barrier(world_size: int) -> None:
    if world_size > 1:
        torch.distributed.barrier()


def _any_rank(flag: bool, world_size: int) -> bool:
    """True on every rank when ``flag`` is True on any rank (so all ranks stop at the same step)."""
    if world_size <= 1:
        return bool(flag)
    tensor = torch.tensor([1.0 if flag else 0.0])
    torch.distributed.all_reduce(tensor)
    return bool(tensor.item() > 0)


@torch.no_grad()
def evaluate(
    model: nn.Module, config: ExperimentConfig, task: Task, run: RunSpec, report: Reporter
) -> list[dict[str, Any]]:
    """Records of the task's metric (:attr:`Task.metric`) for every length up to ``eval_len``."""
    model.eval()
    base = {
        "run": run_id_for(config, run),
        "encoding": run.encoding,
        "task": config.task,
        "seed": run.seed,
        "train_len": config.train_len,
        "steps": config.steps,
    }
    scores = task.metric.evaluate(
        model,
        task,
        eval_len=config.eval_len,
        examples=config.eval_examples,
        batch_size=config.eval_batch,
        seed=run.seed,
        progress=lambda done, total: report(run.label, "eval", done, total, ""),
        positions=_eval_position_sampler(config, run),
    )
    return [
        {
            **base,
            "length": score.length,
            "metric": score.metric,
            "value": score.value,
            "examples": config.eval_examples,
            **(score.details or {}),
        }
        for score in scores
    ]
