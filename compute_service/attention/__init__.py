"""Attention glue between model layers and kernels: metadata, context, backend choice."""
