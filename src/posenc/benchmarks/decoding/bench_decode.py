"""Decoding speed: one-token steps of a layer, HF Llama ``generate``, ``TransformerLM.generate``.

Three tables, every case side by side with its baseline in this process, repeats interleaved:

1. **One decode step** of ``MultiheadAttention(256, 8, "rope", causal=True)`` after a prompt of
   ``cache`` tokens (float32, batch 1), mean over ``--steps`` steps, against **the plain loop**: the
   same projections, HF-style RoPE (``x * cos + rotate_half(x) * sin``), a ``torch.cat`` cache and
   ``F.scaled_dot_product_attention``. posenc runs with the growing ``KVCache()``, the preallocated
   ``KVCache(max_length=...)`` and the layer itself under ``torch.compile(fullgraph=True)`` inside
   ``KVCache.fixed_shapes()`` (attending over all ``max_length`` slots, as static caches do).
2. **Where an eager step goes**: the decode plan (:mod:`posenc.layers.step`) split into the
   cache's writer check, the projections, the rotation, the nan test, the in-place cache write, the
   kernel (SDPA) and the rest (out projection, positions, signature, glue), timed by wrapping those
   functions during the steps.
3. **Generation**: HF ``LlamaForCausalLM`` (4 layers, hidden 256, 8 heads / 4 kv heads, MLP 1024,
   vocabulary 128), greedy ``generate`` of ``--new`` tokens after a ``--prompt``-token prompt with
   ``attn_implementation`` eager, sdpa and posenc; and ``posenc.TransformerLM`` of the same sizes
   (RoPE, 4 kv heads, d_ff 1024) with its ``generate`` (preallocated cache). Tokens per second.

    python -m posenc.benchmarks.decoding.bench_decode [--caches 256,4096] [--steps 64] [--repeats 5]
        [--prompt 64] [--new 64] [--tables layer,split,generate] [--no-compile] [--threads N]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

import posenc
from posenc.benchmarks._harness import machine, markdown_table
from posenc.benchmarks.decoding._hf_generate import STEP_HEADER, step_rows, time_steps

EMBED, HEADS = 256, 8
HEAD_DIM = EMBED // HEADS
TABLES = ("layer", "split", "generate")


# ---------------------------------------------------------------------------- cases
class Case:
    """A decoding case: ``setup()`` (untimed) returns a state, ``step(state, i)`` is one timed step."""

    def __init__(self, name: str, setup: Callable[[], object], step: Callable[[object, int], object]):
        self.name, self.setup, self.step = name, setup, step
        self.per_step: list[float] = []

    def run(self, steps: int) -> None:
        state = self.setup()
        start = time.perf_counter()
        for i in range(steps):
            self.step(state, i)
        self.per_step.append((time.perf_counter() - start) / steps)

    @property
    def median(self) -> float:
        return statistics.median(self.per_step)

    def cell(self) -> str:
        return f"{self.median * 1e6:.0f} µs ({min(self.per_step) * 1e6:.0f}–{max(self.per_step) * 1e6:.0f})"


def _interleave(cases: list[Case], steps: int, repeats: int) -> None:
    with torch.no_grad():
        for case in cases:  # warm-up (and compilation)
            case.run(steps)
            case.per_step.clear()
        for _ in range(repeats):
            for case in cases:
                case.run(steps)


def _interleave_steps(cases: list[Case], steps: int, repeats: int) -> None:
    """Like :func:`_interleave`, but the cases take their steps in turn (the order alternating), each
    step timed alone: a load burst shorter than a repeat then hits every case alike."""
    _interleave(cases, 1, 0)  # warm-up (and compilation)
    with torch.no_grad():
        for _ in range(repeats):
            states = [case.setup() for case in cases]
            spent = [0.0] * len(cases)
            order = list(range(len(cases)))
            for i in range(steps):
                for c in order if i % 2 == 0 else reversed(order):
                    start = time.perf_counter()
                    cases[c].step(states[c], i)
                    spent[c] += time.perf_counter() - start
            for case, seconds in zip(cases, spent, strict=True):
                case.per_step.append(seconds / steps)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def plain_case(layer: posenc.MultiheadAttention, prompt: torch.Tensor, xs: torch.Tensor) -> Case:
    """The plain loop: the same weights, HF-style RoPE, a concatenated cache, SDPA."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float32) / HEAD_DIM))

    def heads(t: torch.Tensor) -> torch.Tensor:
        return t.view(t.shape[0], t.shape[1], HEADS, HEAD_DIM).transpose(1, 2)

    def rope(t: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        freqs = positions[:, None].float() * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return t * emb.cos() + _rotate_half(t) * emb.sin()

    def setup() -> list:
        positions = torch.arange(prompt.shape[1])
        k = rope(heads(layer.k_proj(prompt)), positions)
        return [k, heads(layer.v_proj(prompt)), prompt.shape[1]]

    def step(state: list, i: int) -> torch.Tensor:
        k_cache, v_cache, position = state
        x = xs[i]
        positions = torch.tensor([position])
        q = rope(heads(layer.q_proj(x)), positions)
        k = rope(heads(layer.k_proj(x)), positions)
        k_cache = torch.cat([k_cache, k], dim=2)
        v_cache = torch.cat([v_cache, heads(layer.v_proj(x))], dim=2)
        out = F.scaled_dot_product_attention(q, k_cache, v_cache)
        state[:] = [k_cache, v_cache, position + 1]
        return layer.out_proj(out.transpose(1, 2).reshape(x.shape[0], 1, EMBED))

    return Case("plain loop", setup, step)


def posenc_case(name: str, layer, prompt: torch.Tensor, xs: torch.Tensor, make_cache) -> Case:
    def setup() -> posenc.KVCache:
        cache = make_cache()
        layer(prompt, cache=cache)
        return cache

    return Case(name, setup, lambda cache, i: layer(xs[i], cache=cache))


def compiled_case(layer, prompt: torch.Tensor, xs: torch.Tensor, max_length: int) -> Case:
    """The layer under torch.compile(fullgraph=True) in fixed shapes: compiled once, rewound per repeat."""
    cache = posenc.KVCache(max_length=max_length)
    with torch.no_grad():
        layer(prompt, cache=cache)
    compiled = torch.compile(layer, fullgraph=True)
    block = cache.fixed_shapes()
    block.__enter__()  # open for the benchmark's life: each repeat rewinds to the prompt

    def setup() -> posenc.KVCache:
        cache.rewind(prompt.shape[1])
        return cache

    case = Case("posenc fixed shapes, compiled", setup, lambda c, i: compiled(xs[i], cache=c))
    case.block = block  # held: a context manager's generator left to the collector would close the block
    return case


# ---------------------------------------------------------------------------- table 1
def _layer() -> posenc.MultiheadAttention:
    torch.manual_seed(0)
    return posenc.MultiheadAttention(EMBED, HEADS, "rope", causal=True).eval()


def layer_table(args) -> str:
    layer = _layer()
    rows = []
    for cache_len in args.caches:
        prompt = torch.randn(1, cache_len, EMBED)
        xs = torch.randn(args.steps, 1, 1, EMBED)
        room = cache_len + args.steps
        cases = [
            plain_case(layer, prompt, xs),
            posenc_case("posenc KVCache()", layer, prompt, xs, posenc.KVCache),
            posenc_case(
                "posenc KVCache(max_length)",
                layer,
                prompt,
                xs,
                lambda room=room: posenc.KVCache(max_length=room),
            ),
        ]
        if args.compile:
            cases.append(compiled_case(layer, prompt, xs, room))
        _interleave_steps(cases, args.steps, args.repeats)
        plain = cases[0]
        for case in cases:
            ratio = "1.00×" if case is plain else f"{case.median / plain.median:.2f}×"
            rows.append([str(cache_len), case.name, case.cell(), ratio])
    header = ["cache", "decode step", "time per step: median (min–max)", "vs plain loop"]
    return (
        f"**One decode step**, MultiheadAttention({EMBED}, {HEADS}, 'rope'), float32, batch 1, "
        f"{args.steps} steps per repeat, {args.repeats} repeats, the cases' steps interleaved; {machine()}\n\n"
        + markdown_table(header, rows)
    )


# ---------------------------------------------------------------------------- table 2
class _Clock:
    """Exclusive time inside wrapped functions (a function's time excludes wrapped callees)."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = {}
        self._stack: list[list] = []

    def wrap(self, label: str, fn: Callable) -> Callable:
        def timed(*args, **kwargs):
            frame = [time.perf_counter(), 0.0]
            self._stack.append(frame)
            try:
                return fn(*args, **kwargs)
            finally:
                self._stack.pop()
                spent = time.perf_counter() - frame[0]
                self.totals[label] = self.totals.get(label, 0.0) + spent - frame[1]
                if self._stack:
                    self._stack[-1][1] += spent

        return timed


def split_table(args) -> str:
    import posenc.layers.step as plain

    layer = _layer()
    cache_len = args.caches[0]
    prompt = torch.randn(1, cache_len, EMBED)
    xs = torch.randn(args.steps, 1, 1, EMBED)
    rope = type(layer.encoding)
    originals = {
        "read": posenc.KVCache.read,
        "append": posenc.KVCache.append,
        "finite": plain.fresh_finite,
        "project": posenc.MultiheadAttention.project,
        "rotate": rope.rotate_fresh,
        "sdpa": plain.F.scaled_dot_product_attention,
    }
    clock = _Clock()
    try:
        posenc.KVCache.read = clock.wrap("cache check (writer, batch, device)", originals["read"])
        posenc.KVCache.append = clock.wrap("cache write (in place)", originals["append"])
        plain.fresh_finite = clock.wrap("nan test (q, new key and value)", originals["finite"])
        posenc.MultiheadAttention.project = clock.wrap("projections q, k, v", originals["project"])
        rope.rotate_fresh = clock.wrap("rotation (RoPE)", originals["rotate"])
        plain.F = _FunctionalWith(kernel=clock.wrap("kernel (sdpa)", originals["sdpa"]))
        total = clock.wrap("total", lambda cache, x: layer(x, cache=cache))
        with torch.no_grad():
            for _ in range(args.repeats):
                cache = posenc.KVCache(max_length=cache_len + args.steps)
                layer(prompt, cache=cache)
                layer(xs[0], cache=cache)  # the full path: remembers the step's signature
                for i in range(1, args.steps):
                    total(cache, xs[i])
    finally:
        posenc.KVCache.read = originals["read"]
        posenc.KVCache.append = originals["append"]
        plain.fresh_finite = originals["finite"]
        posenc.MultiheadAttention.project = originals["project"]
        rope.rotate_fresh = originals["rotate"]
        plain.F = F
    calls = args.repeats * (args.steps - 1)
    per_call = {label: seconds / calls * 1e6 for label, seconds in clock.totals.items()}
    whole = sum(per_call.values())
    rows = [
        [label, f"{spent:.1f} µs", f"{spent / whole:.0%}"]
        for label, spent in per_call.items()
        if label != "total"
    ]
    rows.append(
        [
            "rest (out projection, positions, signature, glue)",
            f"{per_call['total']:.1f} µs",
            f"{per_call['total'] / whole:.0%}",
        ]
    )
    rows.append(["one step, all of it", f"{whole:.1f} µs", "100%"])
    return (
        f"**Where an eager step goes** (the plain decode step, KVCache(max_length), cache {cache_len}; exclusive "
        f"time of the wrapped functions, {calls} steps; the wrappers add about 1 µs each)\n\n"
        + markdown_table(["part", "per step", "share"], rows)
    )


class _FunctionalWith:
    """``torch.nn.functional`` with ``scaled_dot_product_attention`` replaced (for timing)."""

    def __init__(self, kernel: Callable) -> None:
        self.scaled_dot_product_attention = kernel

    def __getattr__(self, name: str):
        return getattr(F, name)


# ---------------------------------------------------------------------------- table 3
def generation_llama():
    """The HF ``LlamaForCausalLM`` both generation tables time (this one and ``posenc bench gpu``):
    4 layers, hidden 256, 8 heads / 4 kv heads, MLP 1024, vocabulary 128, seeded, eval."""
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=EMBED, intermediate_size=1024, num_hidden_layers=4,
        num_attention_heads=HEADS, num_key_value_heads=4, max_position_embeddings=4096,
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config).eval()


def generate_table(args) -> str:
    import posenc.hf

    posenc.hf.register()
    llama = generation_llama()
    torch.manual_seed(1)
    lm = posenc.TransformerLM(128, EMBED, 4, HEADS, "rope", d_ff=1024, num_kv_heads=4).eval()
    prompt = torch.randint(0, 128, (1, args.prompt))
    options = {"max_new_tokens": args.new, "min_new_tokens": args.new, "do_sample": False}
    outputs: dict[str, torch.Tensor] = {}

    def hf_case(implementation: str) -> Case:
        def step(_state, _i):
            llama.set_attn_implementation(implementation)
            outputs[implementation] = llama.generate(prompt, **options)

        return Case(f"HF Llama, {implementation}", lambda: None, step)

    cases = [hf_case("sdpa"), hf_case("eager"), hf_case("posenc")]
    cases.append(
        Case("posenc TransformerLM.generate", lambda: None, lambda s, i: lm.generate(prompt, args.new))
    )
    _interleave(cases, 1, args.repeats)
    if not torch.equal(outputs["posenc"], outputs["sdpa"]):
        raise AssertionError("HF Llama: posenc's tokens differ from sdpa's")
    steps = time_steps(llama, prompt, args.new, args.repeats)
    sdpa_case = cases[0]
    rows = []
    for case in cases:
        per_token = case.median / args.new
        rows.append([
            case.name, f"{per_token * 1e3:.2f} ms", f"{1 / per_token:.0f}", f"{sdpa_case.median / case.median:.2f}×",
        ])  # fmt: skip
    return (
        f"**Generation**: greedy, {args.new} tokens after {args.prompt}, batch 1, float32, {args.repeats} repeats "
        "(the HF rows give the same tokens; checked)\n\n"
        + markdown_table(["model, attention", "per token", "tokens/s", "tokens/s vs HF sdpa"], rows)
        + f"\n\n**HF Llama, the same greedy decode step by step**, sdpa and posenc steps interleaved, "
        f"{args.repeats} rounds (same tokens; checked)\n\n" + markdown_table(STEP_HEADER, step_rows(steps))
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--caches", default="256,4096")
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--tables", default=",".join(TABLES))
    parser.add_argument("--no-compile", dest="compile", action="store_false")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    args.caches = [int(c) for c in args.caches.split(",") if c]
    torch.set_num_threads(args.threads)
    tables = {"layer": layer_table, "split": split_table, "generate": generate_table}
    for name in args.tables.split(","):
        if name not in tables:
            parser.error(f"--tables: unknown table {name!r}; choose from {', '.join(TABLES)}")
        print(tables[name](args) + "\n")


if __name__ == "__main__":
    main()
