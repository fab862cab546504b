"""The CUDA benchmark (``bench_gpu``: every encoding and backend against float64 eager, flex against
SDPA, RoPE, HF generation) and its exactness and timing helpers."""
