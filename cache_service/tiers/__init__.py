"""The KV cache's memory hierarchy below the device pool (docs/hierarchy.md): lower-tier indexes
and the hierarchy that decides which blocks move between them (lower_tier, hierarchy), and the disk
tier's block files (disk_store, docs/hierarchy-disk.md). Pure Python: no torch."""
