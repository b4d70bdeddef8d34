"""Run an app on a real uvicorn server in a background thread (tests, benchmarks, notebooks).

    with serve_in_thread(app) as base_url:
        OpenAI(base_url=f"{base_url}/v1", api_key=...)
"""

from __future__ import annotations

import functools
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import uvicorn

if TYPE_CHECKING:
    from fastapi import FastAPI

    from nanokv.gateway.engine import Engine

# A small CPU configuration: the embedded model, fp32, a KV cache of 256 blocks x 16 tokens (about
# 190 MB for SmolLM2-135M) so tests bound their memory and can build a request that never fits.
SMALL_ENGINE_CONFIG = dict(device="cpu", dtype="float32", block_size=16, num_gpu_blocks=256, max_num_seqs=32)


@functools.lru_cache(maxsize=2)
def _cached_engine(items: tuple[tuple[str, Any], ...]) -> Engine:
    from nanokv.config import EngineConfig
    from nanokv.gateway.engine import Engine

    return Engine(EngineConfig.from_kwargs(**dict(items)))


def shared_engine(**overrides: Any) -> Engine:
    """One Engine per configuration per process, so test modules don't each reload the model.

    Apps built over it must run one at a time (each drives it from its own engine thread).
    """
    return _cached_engine(tuple(sorted({**SMALL_ENGINE_CONFIG, **overrides}.items())))


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@contextmanager
def serve_in_thread(app: FastAPI, host: str = "127.0.0.1", port: int | None = None,
                    startup_timeout_s: float = 120.0) -> Iterator[str]:
    """Start uvicorn on host:port (a free port by default); yields the base URL; stops on exit."""
    port = port or free_port(host)
    # backlog well above the load tests' concurrency so connects are never refused
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="on",
                            backlog=2048, timeout_keep_alive=30)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="nanokv-uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + startup_timeout_s
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError("uvicorn exited during start-up (see log above)")
        if time.monotonic() > deadline:
            server.should_exit = True
            raise TimeoutError(f"uvicorn did not start within {startup_timeout_s}s")
        time.sleep(0.02)
    try:
        yield f"http://{host}:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=60)
