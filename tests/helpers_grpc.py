"""One real `nanokv serve` process with the gRPC API on, shared by the gRPC test modules of a run.

Small CPU configuration (the embedded SmolLM2, fp32, 256 KV blocks of 16 tokens, 32 running
sequences, 48 waiting), two API keys (two tenants). `free_blocks_settle` is how the tests prove a
request left no trace: every block allocatable again, nothing running or waiting. Tests get it
through the fixtures grpc_server, grpc_channel and grpc_stub of tests/conftest.py.
"""

from __future__ import annotations

import atexit
import functools
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from nanokv.protos import nanokv_v1_pb2 as pb
from nanokv.protos import nanokv_v1_pb2_grpc as pb_grpc

ROOT = Path(__file__).resolve().parent.parent
KEY_A, KEY_B = "grpc-tenant-a", "grpc-tenant-b"
MAX_WAITING = 48
NUM_BLOCKS = 256
SERVER_FLAGS = ["--device", "cpu", "--dtype", "float32", "--block-size", "16", "--num-gpu-blocks", str(NUM_BLOCKS),
                "--max-num-seqs", "32", "--max-waiting", str(MAX_WAITING)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Server:
    proc: subprocess.Popen
    http: str
    grpc_address: str
    log: Path

    def channel(self) -> grpc.Channel:
        return grpc.insecure_channel(self.grpc_address)

    def stub(self, channel: grpc.Channel) -> pb_grpc.GenerationStub:
        return pb_grpc.GenerationStub(channel)

    def stop(self) -> None:
        _stop(self.proc)


def auth(key: str = KEY_A) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {key}"),)


@functools.lru_cache(maxsize=1)
def shared_server() -> Server:
    return start_server(SERVER_FLAGS)


def start_server(flags: list[str], name: str = "grpc-test") -> Server:
    """A `nanokv serve` with the gRPC API on, both test keys and `flags`; stopped at exit."""
    http_port, grpc_port = free_port(), free_port()
    log = Path(os.environ.get("TMPDIR", "/tmp")) / f"nanokv-{name}-{os.getpid()}.log"
    out = open(log, "wb")  # noqa: SIM115 - the child keeps it
    cmd = [sys.executable, "-m", "nanokv.cli", "serve", "--port", str(http_port), "--grpc-port", str(grpc_port),
           "--api-key", KEY_A, "--api-key", KEY_B, "--log-level", "warning", *flags]
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, stdin=subprocess.DEVNULL)
    out.close()
    atexit.register(_stop, proc)
    server = Server(proc, f"http://127.0.0.1:{http_port}", f"127.0.0.1:{grpc_port}", log)
    deadline = time.monotonic() + 300
    with server.channel() as ch:
        health = health_pb2_grpc.HealthStub(ch)
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"nanokv serve exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
            try:
                if health.Check(health_pb2.HealthCheckRequest(), timeout=2).status == 1:
                    return server
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError("nanokv serve did not answer gRPC health in 300 s")
            time.sleep(0.3)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()


def server_info(stub: pb_grpc.GenerationStub) -> pb.ServerInfo:
    return stub.GetServerInfo(pb.GetServerInfoRequest(), metadata=auth(), timeout=10)


def free_blocks_settle(stub: pb_grpc.GenerationStub, timeout_s: float = 10.0) -> pb.ServerInfo:
    """Wait until nothing runs or waits and every block is allocatable again; returns the last info
    (the caller asserts on it, so a leak fails with the numbers)."""
    deadline = time.monotonic() + timeout_s
    while True:
        info = server_info(stub)
        idle = info.num_running == 0 and info.num_waiting == 0 and info.kv_blocks_free == info.kv_blocks_total
        if idle or time.monotonic() > deadline:
            return info
        time.sleep(0.05)


def collect(stream) -> tuple[list[int], str, pb.GenerateResponse]:
    """(token ids, text, last chunk) of a Generate stream."""
    ids: list[int] = []
    text = []
    last = None
    for chunk in stream:
        ids.extend(chunk.token_ids)
        text.append(chunk.text)
        last = chunk
    assert last is not None and last.finished
    return ids, "".join(text), last
