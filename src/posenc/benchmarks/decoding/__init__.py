"""Decoding benchmarks: one-token steps of a layer and whole generation, posenc's own and through HF
(``bench_decode``, ``bench_compile``, ``bench_hf``; ``_hf_generate`` times HF models step by step)."""
