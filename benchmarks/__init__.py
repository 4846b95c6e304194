"""Reproducible benchmarks of the server, with baselines measured in the same run."""
