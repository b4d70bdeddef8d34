"""The server's limits, importable without the web framework (the service CLIs build their flags
from them in processes that have no FastAPI)."""

DEFAULT_MAX_WAITING = 256
DEFAULT_MAX_BODY_BYTES = 1 << 20  # 1 MiB: far above any prompt the context can hold
