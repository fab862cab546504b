"""The tasks a run trains and evaluates on: the registered synthetic tasks and the byte LM
(:mod:`.catalog`), the text corpora (:mod:`.text`) and the retrieval tasks (:mod:`.retrieval`).
"""

from .catalog import (
    BOS,
    EOS,
    EXACT_MATCH,
    IGNORE,
    PAD,
    PERPLEXITY,
    SEP,
    TASKS,
    Batch,
    ByteLM,
    Metric,
    Score,
    SequenceTask,
    Task,
    default_corpus,
    make_task,
    mix_seed,
    register_task,
)

__all__ = [
    "BOS",
    "EOS",
    "EXACT_MATCH",
    "IGNORE",
    "PAD",
    "PERPLEXITY",
    "SEP",
    "TASKS",
    "Batch",
    "ByteLM",
    "Metric",
    "Score",
    "SequenceTask",
    "Task",
    "default_corpus",
    "make_task",
    "mix_seed",
    "register_task",
]
