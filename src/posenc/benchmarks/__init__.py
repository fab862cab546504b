"""Speed and memory benchmarks of posenc against its baselines (``posenc bench``).

Each ``bench_*`` module runs as ``python -m posenc.benchmarks.bench_bias`` (``--help`` lists its
options) and prints markdown tables; ``_harness`` holds the shared timing and memory machinery.
The attention benchmarks sit here; decoding and generation in :mod:`.decoding`, the CUDA run in
:mod:`.gpu`.
The baselines they compare with (HF transformers, x-transformers, rotary-embedding-torch) are the
``bench`` extra: ``pip install "posenc[bench]"``. Measured tables: ``benchmarks/RESULTS.md`` in the
source repository.
"""
