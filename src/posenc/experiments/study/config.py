"""What a context-extension study is asked to do, in its own words: :class:`StudyConfig`, the options
of ``posenc study MODEL`` (and of :func:`posenc.experiments.study.hf_study.run_study`, which it maps
onto). The folder's ``config.json`` keeps the plan's settings (:mod:`.plan`), as before.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["StudyConfig"]


@dataclass(frozen=True)
class StudyConfig:
    """A study of one trained model past its context.

    Attributes:
        model: a fetched model's name (``smollm2-135m``), a ``.gguf`` file, an HF folder or a hub id.
        tasks: ``text`` (perplexity and the passkey), ``text-lm``, ``text-passkey`` or ``text-multikey``.
        variants: the ways of reading past the context (``none``, the RoPE scalings, the piecewise
            methods with options, grids ``OPTION=A|B``), in the table's order.
        eval_len: the perplexity windows' length in tokens (default: twice the model's context).
        lengths: the needle prompts' lengths (default: c/2, c, 1.5c, 2c up to ``eval_len``).
        depths: the needle depths in [0, 1] (default 0, 0.25, 0.5, 0.75, 1).
        windows: perplexity windows of ``eval_len`` tokens, evenly spaced over the corpus.
        trials: needle prompts per (length, depth) cell (default: ``windows``).
        tuning_windows: windows that choose each grid's setting; the rest are held out.
        dtype: ``float32`` (exact), ``bfloat16`` or ``float16``.
        seed: draws the needles' keys and the tuning windows.
        corpus: the evaluation text: a file, or the built-in ``python-reference``.
        longppl: LongPPL beside perplexity.
    """

    model: str
    tasks: str = "text"
    variants: tuple[str, ...] = ("none",)
    eval_len: int | None = None
    lengths: tuple[int, ...] | None = None
    depths: tuple[float, ...] | None = None
    windows: int = 1
    trials: int | None = None
    tuning_windows: int = 0
    dtype: str = "float32"
    seed: int = 0
    corpus: str | None = None
    longppl: bool = False

    def run_options(self) -> dict[str, Any]:
        """The keyword arguments of :func:`~posenc.experiments.study.hf_study.run_study` (after the
        model and the folder)."""
        return {
            "task": self.tasks,
            "eval_len": self.eval_len,
            "lengths": None if self.lengths is None else list(self.lengths),
            "depths": None if self.depths is None else list(self.depths),
            "eval_examples": self.windows,
            "trials": self.trials,
            "seeds": [self.seed],
            "corpus": self.corpus,
            "variants": list(self.variants),
            "longppl": self.longppl,
            "tuning_windows": self.tuning_windows,
            "dtype": self.dtype,
        }

    def default_out(self) -> Path:
        """``runs/study/<model's name>``: where ``posenc study`` writes without ``--out``."""
        return Path("runs") / "study" / Path(str(self.model)).name.removesuffix(".gguf")


def split_items(text: str | None, cast: type, option: str) -> tuple[Any, ...] | None:
    """``"1,2"`` -> ``(1, 2)`` as ``cast``; None for None; ``ValueError`` naming ``option``."""
    if text is None:
        return None
    try:
        return tuple(cast(item.strip()) for item in text.split(",") if item.strip())
    except ValueError as err:
        raise ValueError(f"{option} {text!r}: give comma-separated {cast.__name__} values") from err


def variant_items(text: Sequence[str] | str | None) -> tuple[str, ...]:
    """``--variants``' items (a method's ``OPTION=VALUE`` after a comma continues it): checked by name."""
    from .hf_methods import parse_variants

    joined = text if text is None or isinstance(text, str) else ",".join(text)
    return tuple(parse_variants(joined))
