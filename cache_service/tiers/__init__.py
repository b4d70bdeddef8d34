"""The KV cache hierarchy below the device pool: L2 host memory and L3 disk (``disk_store``)."""
