"""Benchmarks (`python -m bench.<name>`); shared helpers live in bench.common."""
