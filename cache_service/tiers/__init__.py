"""The KV cache's memory hierarchy below the device pool: lower-tier indexes and the hierarchy that
moves blocks between them (docs/hierarchy.md). Pure Python: no torch, no data movement."""
