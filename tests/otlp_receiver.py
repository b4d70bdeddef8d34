"""The in-process OTLP/gRPC trace receiver of the tests (nanokv_tools.bench.otlp_receiver: the docs'
trace picture uses it too)."""

from nanokv_tools.bench.otlp_receiver import Receiver

__all__ = ["Receiver"]
