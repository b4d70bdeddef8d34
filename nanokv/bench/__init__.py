"""Benchmarks: commands that print numbers and write JSON (never timed tests)."""
