"""OpenAI-compatible HTTP server around one nanokv Engine (see docs/server.md)."""

from nanokv.gateway.http.app import build_app

__all__ = ["build_app"]
