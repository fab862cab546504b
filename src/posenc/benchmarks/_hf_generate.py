"""``posenc bench hf --tables smollm2``: greedy ``generate`` of a trained model, HF sdpa against posenc.

SmolLM2-135M (30 layers, fetched by ``posenc models fetch smollm2-135m``), float32, batch 1: a prompt
of ``--prompt`` tokens of real English (the Python language reference that ships with CPython),
then ``--new`` greedy tokens, with ``attn_implementation="sdpa"`` and ``"posenc"`` in turn, interleaved,
one ``generate`` per repeat each. The table gives milliseconds per new token and posenc's tokens/s
over sdpa's; the two must produce the same tokens (checked: a difference is an error, not a row).
"""

from __future__ import annotations

import statistics
import time

import torch

from posenc.benchmarks._harness import machine, markdown_table

MODEL = "smollm2-135m"
IMPLEMENTATIONS = ("sdpa", "posenc")


class ModelMissing(RuntimeError):
    """The model is not fetched: the message names the command that fetches it."""


def load_model():
    """SmolLM2-135M and its tokenizer, float32 and eval; :class:`ModelMissing` if not fetched."""
    from posenc.pretrained import load, model_path

    try:
        model_path(MODEL)
    except FileNotFoundError as error:  # its message names the fetch command
        raise ModelMissing(str(error)) from None
    return load(MODEL)


def prompt_ids(tokenizer, length: int) -> torch.Tensor:
    """The first ``length`` tokens of the reference text, ``[1, length]``."""
    from posenc.pretrained import reference_text

    ids = tokenizer(reference_text(), return_tensors="pt").input_ids[:, :length]
    if ids.shape[1] < length:
        raise ValueError(f"--prompt {length}: the reference text has only {ids.shape[1]} tokens")
    return ids


def time_generate(model, ids: torch.Tensor, new: int, repeats: int) -> dict[str, list[float]]:
    """Seconds per ``generate`` call for each implementation, interleaved (one warm-up call each)."""
    import posenc.hf

    posenc.hf.register()
    options = {"max_new_tokens": new, "min_new_tokens": new, "do_sample": False}
    seconds: dict[str, list[float]] = {name: [] for name in IMPLEMENTATIONS}
    tokens: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for repeat in range(repeats + 1):
            for name in IMPLEMENTATIONS:
                model.set_attn_implementation(name)
                start = time.perf_counter()
                tokens[name] = model.generate(ids, **options)
                if repeat:  # the first round warms up
                    seconds[name].append(time.perf_counter() - start)
    if not torch.equal(tokens["posenc"], tokens["sdpa"]):
        raise AssertionError(f"{MODEL}: posenc's greedy tokens differ from HF sdpa's")
    return seconds


def generate_rows(seconds: dict[str, list[float]], new: int) -> list[list[str]]:
    sdpa = statistics.median(seconds["sdpa"])
    rows = []
    for name in IMPLEMENTATIONS:
        median = statistics.median(seconds[name])
        spread = f"{min(seconds[name]) / new * 1e3:.1f}–{max(seconds[name]) / new * 1e3:.1f}"
        rows.append(
            [name, f"{median / new * 1e3:.1f} ms ({spread})", f"{new / median:.1f}", f"{sdpa / median:.3f}×"]
        )
    return rows


def smollm2_table(args) -> str:
    """The table, or one line saying why it could not run (the model is not fetched)."""
    try:
        model, tokenizer = load_model()
    except ModelMissing as error:
        return f"**{MODEL} generate**: skipped: {error}"
    ids = prompt_ids(tokenizer, args.prompt)
    seconds = time_generate(model, ids, args.new, args.repeats)
    header = ["attention", "per new token: median (min–max)", "tokens/s", "tokens/s vs HF sdpa"]
    return (
        f"**{MODEL} `generate`** (30 layers, float32): greedy, {args.new} tokens after a {args.prompt}-token "
        f"prompt of real English, batch 1, {args.repeats} repeats interleaved (same tokens; checked); "
        f"{machine()}\n\n" + markdown_table(header, generate_rows(seconds, args.new))
    )
