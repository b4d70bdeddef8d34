"""A real Valkey (or Redis) server as a child process for tests: Debian's valkey-server or
redis-server (`make tools` installs whichever the distribution has), on a free loopback port, with
its own temporary folder, no persistence (--save ''), optionally a password (requirepass) and TLS,
client certificates required or not (certificates from tests/helpers_tls.py). Without a server
binary the tests skip, except under CI=true, where they fail.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.helpers_tls import CA, Pair


def server_binary() -> str | None:
    return shutil.which("valkey-server") or shutil.which("redis-server")


def require_server() -> str:
    exe = server_binary()
    if exe is None:
        reason = "no valkey-server or redis-server (make tools: apt-get install -y valkey-server or redis-server)"
        if os.environ.get("CI", "").lower() in ("true", "1"):
            pytest.fail(reason + "; under CI it must be installed")
        pytest.skip(reason)
    return exe


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Certs:
    ca: Path
    cert: Path
    key: Path
    client: Pair | None = None  # a client certificate the same CA signs (a server with client_auth)


def make_certs(folder: Path, host: str = "127.0.0.1") -> Certs:
    """A CA, a server certificate it signs, valid for `host` (IP SAN) and localhost, and a client
    certificate; keys owner-only (tests/helpers_tls.py)."""
    ca = CA.create(folder)
    server = ca.issue("server", host=host)
    return Certs(ca.cert, server.cert, server.key, ca.issue("client", server=False, client=True))


@dataclass
class Server:
    """One server process; `stop`/`start` keep the port, so a client sees the same store come back."""

    exe: str
    dir: Path
    password: str | None = None
    certs: Certs | None = None
    client_auth: bool = False  # TLS: refuse clients without a certificate the CA signed (--tls-auth-clients)
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        if self.certs is None:
            return f"redis://{auth}127.0.0.1:{self.port}/0"
        url = f"rediss://{auth}127.0.0.1:{self.port}/0?ssl_ca_certs={self.certs.ca}"
        if self.client_auth and self.certs.client is not None:
            url += f"&ssl_certfile={self.certs.client.cert}&ssl_keyfile={self.certs.client.key}"
        return url

    def argv(self) -> list[str]:
        args = [self.exe, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(self.dir),
                "--maxmemory", "64mb", "--maxmemory-policy", "allkeys-lru"]
        if self.certs is None:
            args += ["--port", str(self.port)]
        else:
            args += ["--port", "0", "--tls-port", str(self.port), "--tls-cert-file", str(self.certs.cert),
                     "--tls-key-file", str(self.certs.key), "--tls-ca-cert-file", str(self.certs.ca),
                     "--tls-auth-clients", "yes" if self.client_auth else "no"]
        if self.password:
            args += ["--requirepass", self.password]
        return args

    def start(self, timeout_s: float = 20.0) -> Server:
        self.dir.mkdir(parents=True, exist_ok=True)
        log = open(self.dir / "server.log", "ab")  # noqa: SIM115 - the child keeps it
        self.proc = subprocess.Popen(self.argv(), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        log.close()
        deadline = time.monotonic() + timeout_s
        while True:  # listening once a TCP connect succeeds (TLS and AUTH are the client's business)
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.exe} exited with {self.proc.returncode}:\n{self.log()[-2000:]}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.5).close()
                return self
            except OSError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{self.exe} not listening on {self.port}:\n{self.log()[-2000:]}") from None
                time.sleep(0.05)

    def log(self) -> str:
        p = self.dir / "server.log"
        return p.read_text(errors="replace") if p.exists() else ""

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def pause(self) -> None:
        """SIGSTOP: the port still accepts connections (the kernel's backlog) but nothing answers."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.resume()
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()


def tls_supported(exe: str) -> bool:
    """Whether the binary was built with TLS: without it, --tls-port is an unknown directive."""
    r = subprocess.run([exe, "--port", "0", "--tls-port", "1", "--save", ""], capture_output=True, text=True,
                       timeout=10)
    return "Bad directive" not in r.stdout + r.stderr


def require_tls() -> str:
    """The server binary, built with TLS (Debian's are); skipped without, failed under CI=true."""
    exe = require_server()
    if not tls_supported(exe):
        reason = f"{exe} was built without TLS (--tls-port is an unknown directive)"
        if os.environ.get("CI", "").lower() in ("true", "1"):
            pytest.fail(reason + "; under CI the installed server must support TLS")
        pytest.skip(reason)
    return exe
