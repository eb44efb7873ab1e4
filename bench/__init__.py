"""Benchmarks: each prints its figure on its last line (docs/benchmarks.md)."""
