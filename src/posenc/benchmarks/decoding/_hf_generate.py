"""``posenc bench hf --tables smollm2``: greedy ``generate`` of a trained model, HF sdpa against posenc.

SmolLM2-135M (30 layers, fetched by ``posenc models fetch smollm2-135m``), float32, batch 1: a prompt
of ``--prompt`` tokens of real English (the Python language reference that ships with CPython),
then ``--new`` greedy tokens, with ``attn_implementation="sdpa"`` and ``"posenc"`` in turn, interleaved,
one ``generate`` per repeat each. The table gives milliseconds per new token and posenc's tokens/s
over sdpa's; the two must produce the same tokens (checked: a difference is an error, not a row).

A second table decodes step by step (:func:`time_steps`): two copies of the model, one per
implementation, each with its own ``DynamicCache``, take their greedy steps in turn (the order
alternates), each step timed alone. A shared machine's load comes in bursts longer than a step but
shorter than a ``generate``; interleaved steps see the same bursts, interleaved ``generate`` calls do
not (on a 2-core VM their paired ratios spread over 0.8-1.3 for the same code). It times the
model's forward per token, without ``generate``'s own per-token work (the same for both), so its
ratio is the stricter one.
"""

from __future__ import annotations

import copy
import statistics
import time
import warnings

import torch

from posenc.benchmarks._harness import machine, markdown_table

MODEL = "smollm2-135m"
IMPLEMENTATIONS = ("sdpa", "posenc")


class ModelMissing(RuntimeError):
    """The model is not fetched: the message names the command that fetches it."""


def load_model():
    """SmolLM2-135M and its tokenizer, float32 and eval; :class:`ModelMissing` if not fetched."""
    from posenc.pretrained.loading import load, model_path

    try:
        model_path(MODEL)
    except FileNotFoundError as error:  # its message names the fetch command
        raise ModelMissing(str(error)) from None
    return load(MODEL)


def prompt_ids(tokenizer, length: int) -> torch.Tensor:
    """The first ``length`` tokens of the reference text, ``[1, length]``."""
    from posenc.pretrained.loading import reference_text

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


def time_steps(model, ids: torch.Tensor, new: int, rounds: int) -> dict[str, list[float]]:
    """Seconds per new token for each implementation, one entry per round: greedy steps of two
    copies of ``model`` (sdpa and posenc), interleaved step by step (one warm-up round). The prompt is
    prefilled untimed; the two must choose the same tokens (an ``AssertionError`` otherwise)."""
    import transformers

    import posenc.hf

    posenc.hf.register()
    models = {}
    for name in IMPLEMENTATIONS:
        models[name] = copy.deepcopy(model)
        models[name].set_attn_implementation(name)
    seconds: dict[str, list[float]] = {name: [] for name in IMPLEMENTATIONS}
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # past_key_values, renamed in 5.24, is in the range
        for round_ in range(rounds + 1):
            spent = _one_round(models, ids, new, transformers.DynamicCache)
            if round_:  # the first round warms up
                for name in IMPLEMENTATIONS:
                    seconds[name].append(spent[name] / new)
    return seconds


def _one_round(models: dict, ids: torch.Tensor, new: int, cache_class) -> dict[str, float]:
    caches = {name: cache_class(config=m.config) for name, m in models.items()}
    tokens = {name: [] for name in models}
    spent = dict.fromkeys(models, 0.0)
    nexts = {}
    for name, m in models.items():  # the prompt, untimed
        logits = m(ids, past_key_values=caches[name], use_cache=True).logits
        nexts[name] = logits[:, -1:].argmax(-1)
    order = list(models)
    for step in range(new):
        for name in order if step % 2 == 0 else reversed(order):
            start = time.perf_counter()
            logits = models[name](nexts[name], past_key_values=caches[name], use_cache=True).logits
            spent[name] += time.perf_counter() - start
            nexts[name] = logits[:, -1:].argmax(-1)
            tokens[name].append(int(nexts[name]))
    if tokens["posenc"] != tokens["sdpa"]:
        raise AssertionError("posenc's greedy tokens differ from HF sdpa's in the step-interleaved decode")
    return spent


def step_rows(seconds: dict[str, list[float]]) -> list[list[str]]:
    """Rows of the step-interleaved table: ms per token (median, min-max over rounds), posenc's
    tokens/s over sdpa's (ratio of medians) and the median of the rounds' paired ratios."""
    sdpa = statistics.median(seconds["sdpa"])
    paired = statistics.median(s / p for s, p in zip(seconds["sdpa"], seconds["posenc"], strict=True))
    rows = []
    for name in IMPLEMENTATIONS:
        median = statistics.median(seconds[name])
        spread = f"{min(seconds[name]) * 1e3:.2f}–{max(seconds[name]) * 1e3:.2f}"
        ratio = "1.000×" if name == "sdpa" else f"{sdpa / median:.3f}× (paired {paired:.3f}×)"
        rows.append([name, f"{median * 1e3:.2f} ms ({spread})", ratio])
    return rows


STEP_HEADER = ["attention", "forward per new token: median (min–max)", "tokens/s vs HF sdpa"]


def smollm2_table(args) -> str:
    """The table, or one line saying why it could not run (the model is not fetched)."""
    try:
        model, tokenizer = load_model()
    except ModelMissing as error:
        return f"**{MODEL} generate**: skipped: {error}"
    ids = prompt_ids(tokenizer, args.prompt)
    seconds = time_generate(model, ids, args.new, args.repeats)
    steps = time_steps(model, ids, args.new, args.repeats)
    header = ["attention", "per new token: median (min–max)", "tokens/s", "tokens/s vs HF sdpa"]
    return (
        f"**{MODEL} `generate`** (30 layers, float32): greedy, {args.new} tokens after a {args.prompt}-token "
        f"prompt of real English, batch 1, {args.repeats} repeats interleaved (same tokens; checked); "
        f"{machine()}\n\n"
        + markdown_table(header, generate_rows(seconds, args.new))
        + f"\n\n**{MODEL}, the same greedy decode step by step**, sdpa and posenc steps interleaved, "
        f"{args.repeats} rounds (same tokens; checked)\n\n" + markdown_table(STEP_HEADER, step_rows(steps))
    )
