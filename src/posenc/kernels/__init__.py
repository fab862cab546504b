"""Fused helpers used by encodings and backends (no registration, no side effects): the rotary
kernels (:mod:`.rope`, :mod:`.rope_native`) and the position tensors that carry their range
(:mod:`.position_ranges`), which the rotary tables and the layers' checks read."""
