"""OpenAI-compatible HTTP server around one nanokv Engine (see docs/server.md)."""

from typing import Any

__all__ = ["build_app"]


def __getattr__(name: str) -> Any:
    # lazily: `nanokv cache` / `nanokv compute` read the server's flag defaults from this package,
    # in processes (and images) that have no FastAPI
    if name == "build_app":
        from nanokv.gateway.http.app import build_app

        return build_app
    raise AttributeError(name)
