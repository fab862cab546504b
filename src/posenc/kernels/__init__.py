"""Fused helpers used by encodings and backends (no registration, no side effects)."""
