"""Benchmarks of stacktools: one script per question; see README_SECTION.md."""
