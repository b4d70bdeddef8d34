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


class PreconditionError(NanoKVError):
    """A well-formed internal call that does not fit the receiver's state (a sequence it does not
    hold, another gateway's sequence): FAILED_PRECONDITION over gRPC, not INVALID_ARGUMENT."""


class StaleEpoch(PreconditionError):
    """A call names a KV pool (its epoch) that is no longer the one attached: a service restarted
    in between. The gateway answers by re-attaching (nanokv.gateway.recovery)."""

    def __init__(self, got: int, current: int, detail: str | None = None):
        super().__init__("epoch", detail or f"the call was made for pool epoch {got}; the attached pool is "
                                            f"epoch {current or 'none'} (a service restarted)")
        self.got, self.current = got, current


class ServiceUnavailable(ConnectionError):
    """A peer service is gone, stalled past its deadline, or restarted: the requests in flight end
    with this (HTTP 503, gRPC UNAVAILABLE) and the gateway re-attaches when the peer is back."""
