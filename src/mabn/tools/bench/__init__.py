"""Benchmarks: ``python -m mabn bench --help`` (``mabn.tools.bench.command``)."""
