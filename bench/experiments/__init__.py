"""Standalone experiments outside the bench (run as modules, e.g. ``python -m memzoo.bench.experiments.ba_retrieval``)."""
