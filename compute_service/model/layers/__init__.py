"""Tensor-parallel-aware building blocks of the decoder, one concern per file."""
