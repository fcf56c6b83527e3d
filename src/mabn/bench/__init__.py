"""Benchmarks: ``python -m mabn.bench --help``."""
