"""Published setups at CPU scale: ``posenc extrapolate --preset NAME``.

A preset fixes what defines a published experiment (tasks, encodings, training and evaluation
lengths, seeds) and leaves the scale (model size, steps, examples) to the command line. It runs
one experiment folder per task, ``OUT/<task>``, records its name in each folder's
``config.json``, and compares the result with the paper's numbers, which live with their
citations in one data file, ``posenc/data/published.json`` (:func:`published`).

=============  ==========================================  =========================================
preset         published experiment                        compared
=============  ==========================================  =========================================
nope-paper     Kazemnejad et al. 2023 (NeurIPS): copy,     mean reciprocal rank of the five
               count_copy, reverse; train <= 20, test      encodings (nope, rope, alibi, t5,
               21..40; three seeds                         sinusoidal) over the lengths past L
alibi-paper    Press et al. 2022 (ICLR): LM perplexity     perplexity at 2x, 4x, 8x L over
               at 2x, 4x, 8x the training length           perplexity at L (ours: byte-level LM on
                                                           the embedded corpus, L = 64)
=============  ==========================================  =========================================

An option given on the command line that contradicts the preset (``--preset nope-paper --task
lm``, ``--train-len 16``) is an error before anything is written.

One file per published setup (``nope_paper.py``, ``alibi_paper.py``: its comparison and its
:class:`Preset`), beside ``base.py`` (the :class:`Preset` record, the published numbers, applying a
preset to a config, reading a preset's folders). Add a setup as a file of its own and list it in
:data:`PAPER_PRESETS`.
"""

from __future__ import annotations

from .alibi_paper import (
    ALIBI_PAPER,
    alibi_agreement,
    perplexity_fits,
    perplexity_ratios,
    window_perplexity,
)
from .base import (
    PAPER_PRESETS,
    Agreement,
    Preset,
    apply_preset,
    citation_line,
    compare_folders,
    comparison_for_folder,
    preset_folders,
    published,
)
from .nope_paper import (
    NOPE_PAPER,
    adjacent_pairs_note,
    mean_reciprocal_rank,
    nope_agreement,
    reciprocal_ranks,
    steps_to_fit_note,
)

__all__ = [
    "ALIBI_PAPER",
    "NOPE_PAPER",
    "PAPER_PRESETS",
    "Agreement",
    "Preset",
    "adjacent_pairs_note",
    "alibi_agreement",
    "apply_preset",
    "citation_line",
    "compare_folders",
    "comparison_for_folder",
    "mean_reciprocal_rank",
    "nope_agreement",
    "perplexity_fits",
    "perplexity_ratios",
    "preset_folders",
    "published",
    "reciprocal_ranks",
    "steps_to_fit_note",
    "window_perplexity",
]

PAPER_PRESETS.update({preset.name: preset for preset in (NOPE_PAPER, ALIBI_PAPER)})
