"""The gateway's public gRPC API: nanokv.v1.Generation and KServe v2's GRPCInferenceService,
served on the HTTP app's event loop over the same engine (docs/grpc-api.md)."""

from nanokv.gateway.grpc_api.server import GrpcApi

__all__ = ["GrpcApi"]
