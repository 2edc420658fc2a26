"""Benchmarks of stacktools: one script per question; the README shows the results."""
