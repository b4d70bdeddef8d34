"""User-facing errors. Every bad input raises one of these, naming the field and what is allowed."""

from __future__ import annotations


class NanoKVError(ValueError):
    """A request or configuration value is invalid.

    `field` names the offending field (e.g. ``"max_tokens"``, ``"block_size"``) so that the
    server can put it into the OpenAI error ``param`` and users see exactly what to fix.
    """

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class ConfigError(NanoKVError):
    """An engine configuration value is unknown or out of range."""


class RequestError(NanoKVError):
    """A single request is invalid; it fails alone and costs the batch nothing."""
