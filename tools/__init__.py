"""Offline tools for tests and benchmarks, outside the served package."""
