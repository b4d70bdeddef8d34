"""Names of KV formats, without torch (the cache service's traces and the compute service's both use them)."""

from __future__ import annotations


def kv_format(layer_bits: list[int], dtype: str) -> str:
    """The pool's KV format: the dtype at full precision, else the integer widths its layers use
    ("int8", "int4", "int4+int8"; a full-precision layer adds the dtype)."""
    kinds = sorted({f"int{b}" if b < 16 else dtype for b in layer_bits})
    return "+".join(kinds) if kinds else dtype
