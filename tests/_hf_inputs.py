"""Shared pieces of the ``--hf-model`` input checks (tests/experiments/study/test_hf_scaling.py and
the probe of round 5 at tests/test_probe_round5b.py): the corpus text, its 290-token tokenizer, and
the command line run with its output on one line."""

from __future__ import annotations

from typer.testing import CliRunner

from _tiny_hf import byte_level_tokenizer
from posenc.cli.app import app, load_command_modules

TEXT = (
    "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
    "The pass key is 12345. Remember it. 67890 is the pass key. What is the pass key? "
)


def _tokenizer():
    return byte_level_tokenizer(290, TEXT)


def _run(*args: str):
    load_command_modules()
    result = CliRunner().invoke(app, [*args, "--no-progress"] if args[0] == "extrapolate" else list(args))
    return result, " ".join(result.output.replace("│", " ").split())
