"""Speed and memory benchmarks of posenc against its baselines (``posenc bench``).

Each ``bench_*`` module runs as ``python -m posenc.benchmarks.bench_bias`` (``--help`` lists its
options) and prints markdown tables; ``_harness`` holds the shared timing and memory machinery.
The baselines they compare with (HF transformers, x-transformers, rotary-embedding-torch) are the
``bench`` extra: ``pip install "posenc[bench]"``. Measured tables: ``benchmarks/RESULTS.md`` in the
source repository.
"""
