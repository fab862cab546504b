"""HF transformers' own attention (eager, sdpa) against ``attn_implementation="posenc"`` on the same masks.

One tiny random Mistral layer (hidden 512, 8 heads of 64, float32, batch 1) built by HF, run three
ways side by side in one process, interleaved: HF ``eager``, HF ``sdpa`` and posenc (its dispatcher
picks the backend). The masks are HF's own: full causal, a sliding window (Mistral's
``sliding_window``) and packed documents (``position_ids`` restarting at each document, which HF
turns into a block-diagonal causal mask). The ratio columns are HF's time over posenc's: above 1,
posenc is faster. A second table times one BLOOM layer (ALiBi, no AttentionInterface hook) as HF
runs it and through :func:`posenc.hf.use_posenc_attention`. A third times one T5 layer (relative
bias; d_model 512, 8 heads of 64, d_ff 2048: T5-small's sizes): the encoder stack (bidirectional
self-attention) and a decoder stack alone (causal self-attention, no cross-attention), unpadded,
run by HF eager, HF sdpa (both add HF's dense ``[1, H, L, L]`` bias) and through
:func:`posenc.hf.use_posenc_attention` (the bias from the shared table, never dense).

``--tables gemma3`` (not run by default: minutes per row) times the prefill of the trained
Gemma-3-270M (18 layers: 15 local with a 512-token window, 3 global; float32, B=1) at
``--gemma-sizes`` tokens, HF ``sdpa`` against ``attn_implementation="posenc"``: one forward under
``no_grad`` with ``logits_to_keep=1``, each run in a fresh subprocess (the two alternate, each
after a 64-token warm-up), which reports its time, its peak resident memory over what the loaded
model holds (``VmHWM`` after the call minus ``VmRSS`` before it) and the backend each layer ran on;
the last token's logits of the two must agree (max abs difference reported). The model is the
converted folder of ``gemma3-270m`` (``posenc models fetch gemma3-270m``, then one
``posenc.pretrained.loading.load``) or ``--gemma-model DIR``; absent, the table says so and is skipped.

``--tables smollm2`` (not run by default) times greedy ``generate`` of the trained SmolLM2-135M, HF
sdpa against posenc, same tokens checked (:mod:`posenc.benchmarks.decoding._hf_generate`; ``--prompt`` and
``--new`` tokens, ``--repeats`` interleaved).

    python -m posenc.benchmarks.decoding.bench_hf [--sizes 2048,4096] [--window 512] [--documents 8] [--repeats 3]
        [--tables mistral,bloom,t5,gemma3,smollm2] [--threads N] [--gemma-sizes 4096,16384] [--gemma-repeats 1]
        [--prompt 64] [--new 32]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import torch

from posenc.benchmarks._harness import (
    _reset_peak_rss,
    _status_kib,
    interleaved,
    machine,
    markdown_table,
    memory_cell,
)
from posenc.benchmarks.decoding._hf_generate import smollm2_table

HIDDEN, HEADS = 512, 8
IMPLEMENTATIONS = ("eager", "sdpa", "posenc")
TABLES = ("mistral", "bloom", "t5", "gemma3", "smollm2")
DEFAULT_TABLES = ("mistral", "bloom", "t5")
GEMMA = "gemma3-270m"


def _model(window: int | None):
    import transformers

    import posenc.hf

    posenc.hf.register()
    torch.manual_seed(0)
    config = transformers.MistralConfig(
        vocab_size=128, hidden_size=HIDDEN, intermediate_size=HIDDEN, num_hidden_layers=1,
        num_attention_heads=HEADS, num_key_value_heads=HEADS, max_position_embeddings=1 << 16,
        sliding_window=window,
    )  # fmt: skip
    return transformers.MistralModel(config).eval()


def _call(model, implementation: str, length: int, train: bool, documents: int | None):
    ids = torch.randint(0, 128, (1, length))
    kwargs = {}
    if documents:
        per = length // documents
        kwargs["position_ids"] = (torch.arange(length) % per)[None]

    def run():
        model.set_attn_implementation(implementation)
        if train:
            model(ids, **kwargs).last_hidden_state.sum().backward()
        else:
            with torch.no_grad():
                model(ids, **kwargs)

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="2048,4096")
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--documents", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--tables", default=",".join(DEFAULT_TABLES), help=f"which of {', '.join(TABLES)} to run"
    )
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--gemma-sizes", default="4096,16384,32768")
    parser.add_argument("--gemma-repeats", type=int, default=1)
    parser.add_argument("--gemma-model", default=None, help=f"an HF folder (default: the converted {GEMMA})")
    parser.add_argument("--gemma-timeout", type=int, default=3600, help="seconds per subprocess")
    parser.add_argument("--gemma-case", default=None, help=argparse.SUPPRESS)  # the subprocess's side
    parser.add_argument("--prompt", type=int, default=64, help="smollm2: prompt tokens (real English)")
    parser.add_argument("--new", type=int, default=32, help="smollm2: greedy tokens generated")
    args = parser.parse_args()
    if args.gemma_case:
        print("GEMMA_CASE " + json.dumps(gemma3_case(**json.loads(args.gemma_case))))
        return
    tables = args.tables.split(",")
    unknown = sorted(set(tables) - set(TABLES))
    if unknown:
        parser.error(f"--tables: unknown {unknown}; choose from {', '.join(TABLES)}")
    if args.threads:
        torch.set_num_threads(args.threads)
    if "mistral" in tables:
        _print_mistral(args)
    if "bloom" in tables:
        print(
            f"\nBLOOM (ALiBi, one layer, B=1, H={HEADS}, d=64): HF's own attention vs use_posenc_attention\n"
        )
        print(markdown_table(["L", "pass", "HF BLOOM", "posenc", "HF / posenc"], _bloom_rows(args)))
    if "t5" in tables:
        print(
            f"\nT5 (relative bias, one layer, d_model {HIDDEN}, d_ff {4 * HIDDEN}, B=1, H={HEADS}, d=64): "
            f"HF eager and sdpa vs use_posenc_attention; {machine()}\n"
        )
        header = ["stack", "L", "pass", "HF eager", "HF sdpa", "posenc", "eager / posenc", "sdpa / posenc"]
        print(markdown_table(header, _t5_rows(args)))
    if "gemma3" in tables:
        _print_gemma3(args)
    if "smollm2" in tables:
        print("\n" + smollm2_table(args))


def _print_mistral(args) -> None:
    patterns = {
        "full causal": (None, None),
        f"window {args.window}": (args.window, None),
        f"{args.documents} documents": (None, args.documents),
    }
    rows = []
    for length in (int(s) for s in args.sizes.split(",")):
        for train in (False, True):
            for pattern, (window, documents) in patterns.items():
                model = _model(window)
                cases = {impl: _call(model, impl, length, train, documents) for impl in IMPLEMENTATIONS}
                timings = interleaved(cases, args.repeats)
                posenc_time = timings["posenc"].median
                rows.append(
                    [str(length), "fwd+bwd" if train else "fwd", pattern]
                    + [timings[impl].cell() for impl in IMPLEMENTATIONS]
                    + [f"{timings[impl].median / posenc_time:.2f}×" for impl in ("eager", "sdpa")]
                )
    print(
        f"HF attention vs attn_implementation='posenc' (one Mistral layer, B=1, H={HEADS}, d=64); {machine()}\n"
    )
    header = ["L", "pass", "mask", "HF eager", "HF sdpa", "posenc", "eager / posenc", "sdpa / posenc"]
    print(markdown_table(header, rows))


def _bloom(patched: bool):
    import transformers

    import posenc.hf

    torch.manual_seed(0)
    config = transformers.BloomConfig(vocab_size=128, hidden_size=HIDDEN, n_layer=1, n_head=HEADS)
    model = transformers.BloomModel(config).eval()
    return posenc.hf.use_posenc_attention(model) if patched else model


def _timed_call(model, ids: torch.Tensor, train: bool):
    def run():
        if train:
            model(ids).last_hidden_state.sum().backward()
        else:
            with torch.no_grad():
                model(ids)

    return run


def _bloom_rows(args) -> list[list[str]]:
    models = {"hf": _bloom(False), "posenc": _bloom(True)}
    rows = []
    for length in (int(s) for s in args.sizes.split(",")):
        ids = torch.randint(0, 128, (1, length))
        for train in (False, True):
            cases = {name: _timed_call(model, ids, train) for name, model in models.items()}
            timings = interleaved(cases, args.repeats)
            ratio = timings["hf"].median / timings["posenc"].median
            cells = [timings["hf"].cell(), timings["posenc"].cell(), f"{ratio:.2f}×"]
            rows.append([str(length), "fwd+bwd" if train else "fwd", *cells])
    return rows


def _t5_stacks() -> dict[str, dict[str, torch.nn.Module]]:
    """{stack: {"hf": HF's model, "posenc": a copy served by use_posenc_attention}}, equal weights."""
    import copy

    import transformers
    from transformers.models.t5.modeling_t5 import T5Stack

    import posenc.hf

    config = dict(
        vocab_size=128, d_model=HIDDEN, d_kv=HIDDEN // HEADS, d_ff=4 * HIDDEN, num_layers=1, num_heads=HEADS,
        dropout_rate=0.0, use_cache=False,
    )  # fmt: skip
    torch.manual_seed(0)
    hf = {
        "encoder": transformers.T5EncoderModel(transformers.T5Config(**config)).eval(),
        "decoder (causal)": T5Stack(
            transformers.T5Config(**config, is_decoder=True, is_encoder_decoder=False)
        ).eval(),
    }
    return {
        name: {"hf": model, "posenc": posenc.hf.use_posenc_attention(copy.deepcopy(model))}
        for name, model in hf.items()
    }


def _t5_call(model, implementation: str | None, ids: torch.Tensor, train: bool):
    def run():
        if implementation is not None:
            model.set_attn_implementation(implementation)
        if train:
            model(input_ids=ids).last_hidden_state.sum().backward()
        else:
            with torch.no_grad():
                model(input_ids=ids)

    return run


def _t5_rows(args) -> list[list[str]]:
    rows = []
    for stack, models in _t5_stacks().items():
        for length in (int(s) for s in args.sizes.split(",")):
            ids = torch.randint(0, 128, (1, length))
            for train in (False, True):
                cases = {
                    "eager": _t5_call(models["hf"], "eager", ids, train),
                    "sdpa": _t5_call(models["hf"], "sdpa", ids, train),
                    "posenc": _t5_call(models["posenc"], None, ids, train),
                }
                timings = interleaved(cases, args.repeats)
                posenc_time = timings["posenc"].median
                rows.append(
                    [stack, str(length), "fwd+bwd" if train else "fwd"]
                    + [timings[impl].cell() for impl in IMPLEMENTATIONS]
                    + [f"{timings[impl].median / posenc_time:.2f}×" for impl in ("eager", "sdpa")]
                )
    return rows


# ---------------------------------------------------------------------------- Gemma-3-270M prefill


def _gemma3_dir(args) -> Path | str:
    """The HF folder to load, or the reason there is none (naming the fetch command)."""
    if args.gemma_model:
        return Path(args.gemma_model)
    from posenc.pretrained.loading import convert, converted_dir, fetch_command, model_path

    folder = converted_dir(GEMMA)
    if (folder / "config.json").is_file():
        return folder
    try:
        model_path(GEMMA)
    except FileNotFoundError:
        return f"no {GEMMA} at {folder}: fetch it with `{fetch_command([GEMMA])}`"
    return convert(GEMMA, log=print)


def gemma3_case(model: str, impl: str, length: int, threads: int, logits: str) -> dict:
    """One timed prefill of ``length`` tokens by the model in folder ``model`` under HF's ``impl``:
    ``{"seconds", "peak_mb", "backends"}``, the last token's logits saved to the file ``logits``."""
    import transformers

    import posenc.hf

    torch.set_num_threads(threads)
    posenc.hf.register()
    lm = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    lm.set_attn_implementation(impl)
    backends: list[str] = []
    for layer in lm.model.layers:  # after each layer's attention: the posenc backend that served it
        layer.self_attn.register_forward_hook(lambda *_: backends.append(str(posenc.hf.last_backend())))
    ids = torch.randint(4, lm.config.vocab_size, (1, length), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        lm(ids[:, :64], logits_to_keep=1)  # warm-up: both paths' one-time set-up
        backends.clear()
        before = _reset_peak_rss()
        start = time.perf_counter()
        out = lm(ids, logits_to_keep=1).logits[0, -1]
        seconds = time.perf_counter() - start
    peak = None if before is None else (_status_kib("VmHWM") - before) / 1024
    torch.save(out.clone(), logits)
    used = Counter(backends) if impl == posenc.hf.ATTN_IMPLEMENTATION else {}
    return {"seconds": seconds, "peak_mb": peak, "backends": ", ".join(f"{n} ×{c}" for n, c in used.items())}


def _gemma3_subprocess(**params) -> dict | str:
    """:func:`gemma3_case` in a fresh process (its peak memory its own); a failure's reason as a str."""
    timeout = params.pop("timeout", None)
    command = [sys.executable, "-m", f"{__package__}.bench_hf", "--gemma-case", json.dumps(params)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as err:
        return f"over {err.timeout:.0f} s"
    for line in done.stdout.splitlines():
        if line.startswith("GEMMA_CASE "):
            return json.loads(line.split(" ", 1)[1])
    return f"exit {done.returncode}" + (" (killed: out of memory?)" if done.returncode == -9 else "")


def gemma3_rows(model: str, sizes: list[int], repeats: int, threads: int, run: Callable = _gemma3_subprocess):
    """One row per size: HF sdpa and posenc, alternating (``repeats`` each), and their logits' difference."""
    rows = []
    with tempfile.TemporaryDirectory(prefix="posenc-gemma3-") as scratch:
        for length in sizes:
            results: dict[str, list] = {"sdpa": [], "posenc": []}
            for r in range(repeats):
                order = ("posenc", "sdpa") if r % 2 == 0 else ("sdpa", "posenc")
                for impl in order:
                    logits = str(Path(scratch) / f"{impl}-{length}-{r}.pt")
                    done = run(model=str(model), impl=impl, length=length, threads=threads, logits=logits)
                    results[impl].append((done, logits))
            rows.append(_gemma3_row(length, results))
    return rows


def _gemma3_row(length: int, results: dict[str, list]) -> list[str]:
    ok = {impl: [(d, f) for d, f in runs if isinstance(d, dict)] for impl, runs in results.items()}
    cells = []
    for impl in ("posenc", "sdpa"):
        seconds = sorted(d["seconds"] for d, _ in ok[impl])
        cells.append(f"{seconds[len(seconds) // 2]:.1f} s" if seconds else f"— ({results[impl][0][0]})")
    if not (ok["posenc"] and ok["sdpa"]):
        return [str(length), *cells, "—", "—", "—", "—", "—"]
    posenc_s = sorted(d["seconds"] for d, _ in ok["posenc"])[len(ok["posenc"]) // 2]
    sdpa_s = sorted(d["seconds"] for d, _ in ok["sdpa"])[len(ok["sdpa"]) // 2]
    diff = (torch.load(ok["posenc"][0][1]) - torch.load(ok["sdpa"][0][1])).abs().max().item()
    peaks = [memory_cell(max(d["peak_mb"] or 0 for d, _ in ok[impl])) for impl in ("posenc", "sdpa")]
    return [
        str(length),
        *cells,
        f"{sdpa_s / posenc_s:.2f}×",
        f"{diff:.1e}",
        *peaks,
        ok["posenc"][0][0]["backends"],
    ]


def _print_gemma3(args) -> None:
    folder = _gemma3_dir(args)
    if isinstance(folder, str):
        print(f"\nGemma-3-270M prefill: skipped, {folder}")
        return
    sizes = [int(s) for s in args.gemma_sizes.split(",")]
    threads = args.threads or torch.get_num_threads()
    print(
        f"\nGemma-3-270M prefill ({folder.name}; float32, B=1, logits_to_keep=1), HF sdpa vs "
        f"attn_implementation='posenc', one fresh process per run; {machine()}\n"
    )
    header = ["L", "posenc", "HF sdpa", "sdpa / posenc", "max abs Δ logit", "peak posenc", "peak sdpa",
              "posenc backends (per layer)"]  # fmt: skip
    run = lambda **p: _gemma3_subprocess(**p, timeout=args.gemma_timeout)  # noqa: E731
    print(markdown_table(header, gemma3_rows(folder, sizes, args.gemma_repeats, threads, run)))


if __name__ == "__main__":
    main()
