"""Benchmarks: ``python -m mabn bench --help`` (``mabn.commands.bench``)."""
