"""Benchmarks of stacktools: one script per question, run as ``python -m
benchmarks.<name>`` from the repository root; what they share is in
``benchmarks.common``. The docs' benchmark pages show the results."""
