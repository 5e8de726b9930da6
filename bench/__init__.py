"""Benchmark harness (installed as ``memzoo.bench``)."""
