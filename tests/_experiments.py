"""The tiny model and schedule the experiment tests train (tests/experiments/: the runner, training,
results folders, workers): one layer, 16 wide, two steps."""

from __future__ import annotations

TINY = dict(
    d_model=16,
    num_layers=1,
    num_heads=2,
    d_ff=16,
    batch_size=4,
    steps=2,
    warmup=1,
    eval_examples=3,
    checkpoint_every=1,
)
