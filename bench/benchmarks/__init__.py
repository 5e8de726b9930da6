"""pytest-benchmark timings of single layers: ``pytest bench/benchmarks/bench_layers.py --benchmark-enable``."""
