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

    python -m posenc.benchmarks.bench_hf [--sizes 2048,4096] [--window 512] [--documents 8] [--repeats 3]
        [--tables mistral,bloom,t5] [--threads N]
"""

from __future__ import annotations

import argparse

import torch

from posenc.benchmarks._harness import interleaved, machine, markdown_table

HIDDEN, HEADS = 512, 8
IMPLEMENTATIONS = ("eager", "sdpa", "posenc")
TABLES = ("mistral", "bloom", "t5")


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
    parser.add_argument("--tables", default=",".join(TABLES), help=f"which of {', '.join(TABLES)} to run")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = parser.parse_args()
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


if __name__ == "__main__":
    main()
