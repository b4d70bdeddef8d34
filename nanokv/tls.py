"""TLS for the public ports (a gateway's or a router's OpenAI HTTP and gRPC, one certificate for both)
and for the router's calls to its replicas. Off by default: plaintext on loopback.

Server side (`nanokv serve|gateway|router`): --ssl-certfile and --ssl-keyfile turn TLS on;
--ssl-ca-certs names the CA whose client certificates are accepted, and then --ssl-cert-reqs says
whether one is `required` (mutual TLS, the default once a CA is given) or `optional`.
Client side (`nanokv router` to its replicas): --replica-ssl-ca-certs (the CA that signed the
replicas' certificates; default: the system's roots), --replica-ssl-certfile/--replica-ssl-keyfile
(the router's own certificate, for replicas that require one) and --replica-ssl-server-name (the
name their certificates carry, where the router reaches them by address: a headless Service's pods).

Every file is read and checked once at start-up, so a wrong path or a key that does not match its
certificate stops the process with the flag named, not the first handshake.
"""

from __future__ import annotations

import argparse
import ssl
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from nanokv.errors import ConfigError

if TYPE_CHECKING:
    import grpc

CERT_REQS = {"none": ssl.CERT_NONE, "optional": ssl.CERT_OPTIONAL, "required": ssl.CERT_REQUIRED}


def _read(field: str, path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise ConfigError(field, f"cannot read {path!r}: {e.strerror or e}") from None
    if b"-----BEGIN" not in data:
        raise ConfigError(field, f"{path!r} is not PEM (no -----BEGIN line)")
    return data


def _load_chain(ctx: ssl.SSLContext, cert_field: str, certfile: str, keyfile: str) -> None:
    try:
        ctx.load_cert_chain(certfile, keyfile)
    except ssl.SSLError as e:
        raise ConfigError(cert_field, f"{certfile!r} and its key {keyfile!r} do not load together: {e}") from None


def _load_ca(ctx: ssl.SSLContext, field: str, cafile: str) -> None:
    try:
        ctx.load_verify_locations(cafile)
    except ssl.SSLError as e:
        raise ConfigError(field, f"{cafile!r} holds no usable CA certificate: {e}") from None


@dataclass(frozen=True)
class ServerTLS:
    certfile: str
    keyfile: str
    ca_certs: str | None = None
    cert_reqs: str = "none"  # a key of CERT_REQS

    @classmethod
    def build(cls, certfile: str | None, keyfile: str | None, ca_certs: str | None = None,
              cert_reqs: str | None = None, prefix: str = "ssl") -> ServerTLS | None:
        """None when no TLS flag is given; else checked (ConfigError naming the flag's field)."""
        if certfile is None and keyfile is None:
            for name, value in (("ca_certs", ca_certs), ("cert_reqs", cert_reqs)):
                if value is not None:
                    raise ConfigError(f"{prefix}_{name}", f"needs {prefix}_certfile and {prefix}_keyfile "
                                                          "(TLS on this server)")
            return None
        if certfile is None or keyfile is None:
            missing = "certfile" if certfile is None else "keyfile"
            raise ConfigError(f"{prefix}_{missing}", f"{prefix}_certfile and {prefix}_keyfile go together")
        if cert_reqs is None:
            cert_reqs = "required" if ca_certs else "none"
        if cert_reqs not in CERT_REQS:
            raise ConfigError(f"{prefix}_cert_reqs", f"got {cert_reqs!r}; allowed: {', '.join(CERT_REQS)}")
        if cert_reqs != "none" and not ca_certs:
            raise ConfigError(f"{prefix}_cert_reqs", f"{cert_reqs!r} client certificates need {prefix}_ca_certs "
                                                     "(the CA that signs them)")
        _read(f"{prefix}_certfile", certfile)
        _read(f"{prefix}_keyfile", keyfile)
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        _load_chain(ctx, f"{prefix}_certfile", certfile, keyfile)
        if ca_certs:
            _read(f"{prefix}_ca_certs", ca_certs)
            _load_ca(ctx, f"{prefix}_ca_certs", ca_certs)
        return cls(certfile, keyfile, ca_certs, cert_reqs)

    @property
    def mutual(self) -> bool:
        return self.cert_reqs == "required"

    def uvicorn_kwargs(self) -> dict[str, Any]:
        return {"ssl_certfile": self.certfile, "ssl_keyfile": self.keyfile, "ssl_ca_certs": self.ca_certs,
                "ssl_cert_reqs": int(CERT_REQS[self.cert_reqs])}

    def grpc_credentials(self) -> grpc.ServerCredentials:
        import grpc

        with open(self.keyfile, "rb") as k, open(self.certfile, "rb") as c:
            pair = (k.read(), c.read())
        roots = None
        if self.cert_reqs != "none" and self.ca_certs:
            with open(self.ca_certs, "rb") as f:
                roots = f.read()
        return grpc.ssl_server_credentials([pair], root_certificates=roots, require_client_auth=self.mutual)

    def describe(self) -> str:
        return "TLS, client certificate " + {"none": "not asked", "optional": "optional",
                                             "required": "required (mutual TLS)"}[self.cert_reqs]


@dataclass(frozen=True)
class ClientTLS:
    ca_certs: str | None = None  # None: the system's roots (gRPC's own bundle for the gRPC calls)
    certfile: str | None = None
    keyfile: str | None = None
    server_name: str | None = None  # the name checked in the server's certificate (default: the host dialled)

    @classmethod
    def build(cls, enabled: bool, ca_certs: str | None, certfile: str | None, keyfile: str | None,
              server_name: str | None, prefix: str = "replica_ssl") -> ClientTLS | None:
        """None unless `enabled` or any of the files or the name is given; else checked."""
        if not (enabled or ca_certs or certfile or keyfile or server_name):
            return None
        if (certfile is None) != (keyfile is None):
            missing = "certfile" if certfile is None else "keyfile"
            raise ConfigError(f"{prefix}_{missing}", f"{prefix}_certfile and {prefix}_keyfile go together")
        if server_name is not None and not server_name.strip():
            raise ConfigError(f"{prefix}_server_name", "must be a host name, or left out (the host dialled)")
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        if ca_certs:
            _read(f"{prefix}_ca_certs", ca_certs)
            _load_ca(ctx, f"{prefix}_ca_certs", ca_certs)
        if certfile and keyfile:
            _read(f"{prefix}_certfile", certfile)
            _read(f"{prefix}_keyfile", keyfile)
            _load_chain(ctx, f"{prefix}_certfile", certfile, keyfile)
        return cls(ca_certs, certfile, keyfile, server_name)

    def ssl_context(self) -> ssl.SSLContext:
        """For HTTPS: verifies the server (chain and name), presents the client certificate if any."""
        ctx = ssl.create_default_context(cafile=self.ca_certs)
        if self.certfile and self.keyfile:
            ctx.load_cert_chain(self.certfile, self.keyfile)
        return ctx

    def grpc_credentials(self) -> grpc.ChannelCredentials:
        import grpc

        def read(path: str | None) -> bytes | None:
            if path is None:
                return None
            with open(path, "rb") as f:
                return f.read()
        return grpc.ssl_channel_credentials(root_certificates=read(self.ca_certs), private_key=read(self.keyfile),
                                            certificate_chain=read(self.certfile))

    def grpc_options(self) -> list[tuple[str, Any]]:
        return [("grpc.ssl_target_name_override", self.server_name)] if self.server_name else []


def add_server_tls_args(group: argparse._ArgumentGroup | argparse.ArgumentParser, what: str) -> None:
    """--ssl-certfile/--ssl-keyfile/--ssl-ca-certs/--ssl-cert-reqs, for both of `what`'s ports."""
    group.add_argument("--ssl-certfile", default=None, metavar="PEM",
                       help=f"serve {what} over TLS with this certificate (chain), on the HTTP and gRPC ports")
    group.add_argument("--ssl-keyfile", default=None, metavar="PEM", help="the certificate's private key")
    group.add_argument("--ssl-ca-certs", default=None, metavar="PEM",
                       help="CA bundle that signs accepted client certificates (mutual TLS)")
    group.add_argument("--ssl-cert-reqs", default=None, choices=tuple(CERT_REQS),
                       help="client certificates: default 'required' when --ssl-ca-certs is given, else 'none'")


def server_tls(args: argparse.Namespace) -> ServerTLS | None:
    return ServerTLS.build(args.ssl_certfile, args.ssl_keyfile, args.ssl_ca_certs, args.ssl_cert_reqs)
