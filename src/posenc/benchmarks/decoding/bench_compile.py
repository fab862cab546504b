"""HF generation at its fastest: a static cache and ``torch.compile``, sdpa against ``attn_implementation="posenc"``.

For each model, two copies with the same weights, one per implementation, each with its forward
compiled (``torch.compile(model.forward)``, as HF's docs advise), greedy ``generate`` with
``cache_implementation="static"``: one warm-up call each (its time is the compile), then interleaved
repeats. Prefill is timed as a one-token ``generate``; the per-token time is the rest of a full
``generate`` over its other tokens. Both must produce the same tokens (a difference is an error).
The eager rows (no compile, HF's dynamic cache) are the same models as they run today.

Models: ``llama4`` (a random 4-layer Llama: hidden 256, 8 heads, 4 KV heads; nothing to fetch),
``smollm2`` (SmolLM2-135M) and ``gemma3`` (Gemma-3-270M: sliding and global layers, HF's static
hybrid cache), the last two when fetched (``posenc models fetch``).

``lm`` is posenc's own model at gpt-fast's rule: a :class:`~posenc.TransformerLM` of the ``llama4``
sizes (4 layers, width 256, 8 heads, 4 KV heads, RoPE, vocabulary 1000; its GELU MLP of width 768
has the FLOPs of Llama's SwiGLU of width 512) generating with ``generate(compiled=True)`` (the
prompt eagerly, then the model's own forward compiled on fixed-shape steps), against
the ``llama4`` HF model with sdpa, a static cache and ``torch.compile``; both checked to give their
own eager path's tokens (different weights: not each other's).

    python -m posenc.benchmarks.decoding.bench_compile [--models llama4,smollm2,gemma3,lm] [--prompt 64] [--new 48]
        [--repeats 3] [--threads 1]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

from posenc.benchmarks._harness import machine, markdown_table

IMPLEMENTATIONS = ("sdpa", "posenc")
MODELS = ("llama4", "smollm2", "gemma3", "lm")


def _llama4():
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=4, max_position_embeddings=1024,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def _fetched(name: str):
    from posenc.pretrained.loading import load, model_path

    try:
        model_path(name)
    except FileNotFoundError as error:
        return str(error)
    return load(name)[0].float().eval()


LOADERS = {
    "llama4": _llama4,
    "smollm2": lambda: _fetched("smollm2-135m"),
    "gemma3": lambda: _fetched("gemma3-270m"),
}


def _generate(model, ids: torch.Tensor, new: int, cache: str | None) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(
            ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, cache_implementation=cache,
            pad_token_id=0,
        )  # fmt: skip


def _timed(fn) -> tuple[float, object]:
    start = time.perf_counter()
    result = fn()
    if isinstance(result, torch.Tensor) and result.is_cuda:
        torch.cuda.synchronize(result.device)  # the clock stops when the device has finished
    return time.perf_counter() - start, result


def _copies(model) -> dict[str, object]:
    import posenc.hf

    posenc.hf.register()
    copies = {}
    for impl in IMPLEMENTATIONS:
        twin = copy.deepcopy(model)
        twin.config._attn_implementation = impl
        copies[impl] = twin
    return copies


def measure(model, ids: torch.Tensor, new: int, repeats: int, compiled: bool) -> dict[str, dict[str, float]]:
    """Per implementation: ``warmup`` (s), ``prefill`` and ``token`` (median ms); same tokens checked."""
    copies = _copies(model)
    cache = "static" if compiled else None
    results: dict[str, dict[str, float]] = {}
    tokens = {}
    for impl, twin in copies.items():
        if compiled:
            twin.forward = torch.compile(twin.forward)
        warm, tokens[impl] = _timed(lambda twin=twin: _generate(twin, ids, new, cache))
        _generate(twin, ids, 1, cache)  # the one-token call's shapes warmed too
        results[impl] = {"warmup": warm, "prefill": [], "full": []}
    if not torch.equal(tokens["sdpa"], tokens["posenc"]):
        raise AssertionError("sdpa and posenc generated different tokens")
    for _ in range(repeats):
        for impl, twin in copies.items():
            results[impl]["prefill"].append(_timed(lambda twin=twin: _generate(twin, ids, 1, cache))[0])
            results[impl]["full"].append(_timed(lambda twin=twin: _generate(twin, ids, new, cache))[0])
    for found in results.values():
        prefill, full = statistics.median(found["prefill"]), statistics.median(found["full"])
        found.update(prefill=prefill * 1e3, token=(full - prefill) / (new - 1) * 1e3, full=full * 1e3)
    return results


def _posenc_lm():
    import posenc

    torch.manual_seed(0)
    return posenc.TransformerLM(1000, 256, 4, 8, "rope", num_kv_heads=4, d_ff=768).eval()


def measure_lm(ids: torch.Tensor, new: int, repeats: int) -> dict[str, dict[str, float]]:
    """HF Llama (sdpa, static cache, compiled forward) against posenc's ``TransformerLM.generate(
    compiled=True)``, interleaved: ``warmup`` (s), ``prefill``, ``token``, ``full`` (median ms)."""
    hf, lm = _llama4(), _posenc_lm()
    hf.config._attn_implementation = "sdpa"
    hf_eager = _generate(hf, ids, new, None)
    hf.forward = torch.compile(hf.forward)
    runs = {
        "sdpa": lambda n: _generate(hf, ids, n, "static"),
        "posenc TransformerLM": lambda n: lm.generate(ids, n, compiled=True),
    }
    eager = {"sdpa": hf_eager, "posenc TransformerLM": lm.generate(ids, new)}
    results: dict[str, dict[str, float]] = {}
    for impl, run in runs.items():
        warm, tokens = _timed(lambda run=run: run(new))
        if not torch.equal(tokens, eager[impl]):
            raise AssertionError(f"{impl}: the compiled generate's tokens differ from its eager path's")
        run(1)
        results[impl] = {"warmup": warm, "prefill": [], "full": []}
    for _ in range(repeats):
        for impl, run in runs.items():
            results[impl]["prefill"].append(_timed(lambda run=run: run(1))[0])
            results[impl]["full"].append(_timed(lambda run=run: run(new))[0])
    for found in results.values():
        prefill, full = statistics.median(found["prefill"]), statistics.median(found["full"])
        found.update(prefill=prefill * 1e3, token=(full - prefill) / (new - 1) * 1e3, full=full * 1e3)
    return results


def _rows(name: str, mode: str, results: dict[str, dict[str, float]]) -> list[list[str]]:
    base = results["sdpa"]
    rows = []
    for impl, found in results.items():
        rows.append(
            [
                name,
                mode,
                impl,
                f"{found['warmup']:.1f} s",
                f"{found['prefill']:.1f} ms",
                f"{found['token']:.2f} ms",
                f"{base['token'] / found['token']:.2f}×",
                f"{base['full'] / found['full']:.2f}×",
            ]
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="llama4")
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--new", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    unknown = [m for m in args.models.split(",") if m not in MODELS]
    if unknown:
        parser.error(f"--models: unknown {unknown}; choose from {', '.join(MODELS)}")
    rows = []
    for name in args.models.split(","):
        if name == "lm":
            ids = torch.randint(3, 1000, (1, args.prompt), generator=torch.Generator().manual_seed(0))
            rows += _rows("lm vs HF Llama", "static + compile", measure_lm(ids, args.new, args.repeats))
            continue
        model = LOADERS[name]()
        if isinstance(model, str):
            rows.append([name, "—", "—", f"not fetched: {model}", "—", "—", "—", "—"])
            continue
        ids = torch.randint(
            3,
            min(1000, model.config.vocab_size),
            (1, args.prompt),
            generator=torch.Generator().manual_seed(0),
        )
        for mode, compiled in (("static + compile", True), ("eager, dynamic cache", False)):
            rows += _rows(name, mode, measure(model, ids, args.new, args.repeats, compiled))
    print(f"HF generate: {args.prompt}-token prompt, {args.new} new tokens, batch 1, float32; {machine()}\n")
    header = [
        "model",
        "mode",
        "impl",
        "warm-up",
        "prefill",
        "per token",
        "tokens/s vs sdpa",
        "generate vs sdpa",
    ]
    print(markdown_table(header, rows))


if __name__ == "__main__":
    main()
