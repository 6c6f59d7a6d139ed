"""Benchmark tools: segmented real workloads, a streaming load generator, metrics, reports (see cli.py)."""
