"""Attention kernels: Triton implementations and torch references with the same contract."""
