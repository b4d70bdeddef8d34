"""inference.GRPCInferenceService (KServe v2 / Triton) over the same engine.

The model takes one BYTES tensor `text_input` (shape [1]: the prompt) and answers `text_output`
(BYTES [1]) and `output_ids` (INT32 [n]). Sampling settings travel as request parameters with
vLLM's names (`max_tokens`, `temperature`, ...; see docs/grpc-api.md). ModelInfer answers once with
the whole text; ModelStreamInfer answers every request with one response per token, the last one
marked `triton_final_response`. A failed request in a stream gets `error_message` and the stream
goes on, as Triton does.
"""

from __future__ import annotations

import asyncio
import struct
from collections.abc import AsyncIterator
from typing import Any

import grpc

from nanokv import __version__
from nanokv.errors import RequestError
from nanokv.gateway.grpc_api import validate
from nanokv.gateway.grpc_api.auth import KeyRing
from nanokv.gateway.grpc_api.errors import ModelNotFound, stream_error_message
from nanokv.gateway.grpc_api.generation import GenerationServicer
from nanokv.protos import nanokv_v1_pb2 as pb
from nanokv.protos.kserve import grpc_service_pb2 as ks

INPUT, TEXT_OUT, IDS_OUT = "text_input", "text_output", "output_ids"
# parameter -> the proto type it must carry; "int" accepts int64/uint64, "float" also ints
_PARAMS = {"max_tokens": "int", "temperature": "float", "top_p": "float", "top_k": "int", "min_p": "float",
           "seed": "int", "ignore_eos": "bool", "stop": "string", "cache_salt": "string"}
_IGNORED_PREFIX = "triton_"  # client-side switches tritonclient adds (e.g. triton_enable_empty_final_response)


def _bytes_elements(raw: bytes, field: str) -> list[bytes]:
    """Decode a BYTES tensor's raw form: each element is a 4-byte little-endian length + bytes."""
    out, i = [], 0
    while i < len(raw):
        if i + 4 > len(raw):
            raise RequestError(field, "truncated BYTES tensor (a 4-byte length prefix is cut off)")
        (n,) = struct.unpack_from("<I", raw, i)
        if i + 4 + n > len(raw):
            raise RequestError(field, f"truncated BYTES tensor (element of {n} bytes runs past the end)")
        out.append(raw[i + 4:i + 4 + n])
        i += 4 + n
    return out


def _param(name: str, p: ks.InferParameter) -> Any:
    kind = _PARAMS.get(name)
    which = p.WhichOneof("parameter_choice")
    field = f"parameters[{name!r}]"
    if kind is None:
        raise RequestError(field, f"unknown parameter; allowed: {', '.join(_PARAMS)}")
    # floats may also come as decimal strings: tritonclient (2.41) sends no double parameters at all
    ok = {"int": ("int64_param", "uint64_param"),
          "float": ("double_param", "int64_param", "uint64_param", "string_param"),
          "bool": ("bool_param",), "string": ("string_param",)}[kind]
    if which not in ok:
        raise RequestError(field, f"must be a{'n' if kind == 'int' else ''} {kind} parameter, got {which or 'none'}")
    value = getattr(p, which)
    if kind == "float" and which == "string_param":
        try:
            return float(value)
        except ValueError:
            raise RequestError(field, f"got {value!r}; allowed: a number (double_param, int64_param or a "
                                      f"decimal string_param)") from None
    return value


def to_generate_request(req: ks.ModelInferRequest, served: str) -> pb.GenerateRequest:
    validate.check_model(req.model_name, served, "model_name")
    if req.model_version not in ("", "1"):
        raise ModelNotFound(f"model_version: '{req.model_version}' does not exist; allowed: '' or '1'")
    names = [t.name for t in req.inputs]
    if names != [INPUT]:
        raise RequestError("inputs", f"got {names}; allowed: exactly one input named '{INPUT}'")
    t = req.inputs[0]
    if t.datatype != "BYTES":
        raise RequestError(f"inputs['{INPUT}'].datatype", f"got '{t.datatype}'; allowed: 'BYTES'")
    if list(t.shape) not in ([1], [1, 1]):
        raise RequestError(f"inputs['{INPUT}'].shape", f"got {list(t.shape)}; allowed: [1] or [1, 1]")
    if req.raw_input_contents:
        elems = _bytes_elements(req.raw_input_contents[0], f"raw_input_contents[0] ('{INPUT}')")
    else:
        elems = list(t.contents.bytes_contents)
    if len(elems) != 1:
        raise RequestError(f"inputs['{INPUT}']", f"holds {len(elems)} elements; allowed: exactly 1 (the prompt)")
    try:
        text = elems[0].decode("utf-8")
    except UnicodeDecodeError as e:
        raise RequestError(f"inputs['{INPUT}']", f"not valid UTF-8 ({e.reason} at byte {e.start})") from None
    for o in req.outputs:
        if o.name not in (TEXT_OUT, IDS_OUT):
            raise RequestError("outputs", f"unknown output '{o.name}'; allowed: '{TEXT_OUT}', '{IDS_OUT}'")
    out = pb.GenerateRequest(request_id=req.id, text=text)
    sp = out.sampling_params
    for name, p in req.parameters.items():
        if name.startswith(_IGNORED_PREFIX) or name in ("priority", "timeout"):
            continue
        value = _param(name, p)
        if name == "stop":
            sp.stop.append(value)
        elif name == "cache_salt":
            out.cache_salt = value
        elif name == "ignore_eos":
            sp.ignore_eos = value
        else:
            try:
                setattr(sp, name, value)
            except (ValueError, TypeError):
                bits = 64 if name == "seed" else 32  # the nanokv.v1 field it lands in
                raise RequestError(f"parameters[{name!r}]", f"got {value!r}; allowed: a {bits}-bit signed "
                                                            f"integer") from None
    return out


def kserve_field(field: str) -> str:
    """The KServe name of a nanokv.v1 field an error names: what the Triton client actually sent."""
    head, _, rest = field.partition(".")
    if head == "sampling_params":
        return f"parameters[{rest.split('.')[0]!r}]"
    if head in ("text", "token_ids"):
        return f"inputs['{INPUT}']"
    if head == "cache_salt":
        return "parameters['cache_salt']"
    return {"request_id": "id"}.get(field, field)


def _response(req: ks.ModelInferRequest, served: str, text: str, ids: list[int], params: dict[str, Any]
              ) -> ks.ModelInferResponse:
    wanted = {o.name for o in req.outputs} or {TEXT_OUT, IDS_OUT}
    r = ks.ModelInferResponse(model_name=served, model_version="1", id=req.id)
    if TEXT_OUT in wanted:
        r.outputs.add(name=TEXT_OUT, datatype="BYTES", shape=[1])
        data = text.encode()
        r.raw_output_contents.append(struct.pack("<I", len(data)) + data)
    if IDS_OUT in wanted:
        r.outputs.add(name=IDS_OUT, datatype="INT32", shape=[len(ids)])
        r.raw_output_contents.append(struct.pack(f"<{len(ids)}i", *ids))
    for k, v in params.items():
        p = r.parameters[k]
        if isinstance(v, bool):
            p.bool_param = v
        elif isinstance(v, int):
            p.int64_param = v
        else:
            p.string_param = str(v)
    return r


def _final_params(last: pb.GenerateResponse) -> dict[str, Any]:
    u = last.usage
    return {"finish_reason": last.finish_reason, "prompt_tokens": u.prompt_tokens,
            "completion_tokens": u.completion_tokens, "cached_prompt_tokens": u.cached_prompt_tokens,
            **{f"cached_prompt_tokens_{t}": n for t, n in sorted(u.cached_prompt_tokens_by_tier.items())}}


class KServeServicer:
    def __init__(self, gen: GenerationServicer, keys: KeyRing):
        self.gen = gen
        self.keys = keys
        self.name = gen.info.name

    def _check_model(self, name: str, version: str) -> None:
        validate.check_model(name or "-", self.name, "name")
        if version not in ("", "1"):
            raise ModelNotFound(f"version: '{version}' does not exist; allowed: '' or '1'")

    async def ServerLive(self, req: Any, context: Any) -> ks.ServerLiveResponse:
        return ks.ServerLiveResponse(live=True)

    async def ServerReady(self, req: Any, context: Any) -> ks.ServerReadyResponse:
        return ks.ServerReadyResponse(ready=self.gen.aengine.healthy)

    async def ModelReady(self, req: ks.ModelReadyRequest, context: Any) -> ks.ModelReadyResponse:
        self._check_model(req.name, req.version)
        return ks.ModelReadyResponse(ready=self.gen.aengine.healthy)

    async def ServerMetadata(self, req: Any, context: Any) -> ks.ServerMetadataResponse:
        return ks.ServerMetadataResponse(name="nanokv", version=__version__, extensions=["model_stream_infer"])

    async def ModelMetadata(self, req: ks.ModelMetadataRequest, context: Any) -> ks.ModelMetadataResponse:
        self._check_model(req.name, req.version)
        T = ks.ModelMetadataResponse.TensorMetadata
        return ks.ModelMetadataResponse(
            name=self.name, versions=["1"], platform="nanokv",
            inputs=[T(name=INPUT, datatype="BYTES", shape=[1])],
            outputs=[T(name=TEXT_OUT, datatype="BYTES", shape=[1]), T(name=IDS_OUT, datatype="INT32", shape=[-1])])

    async def _chunks(self, req: ks.ModelInferRequest, tenant: str | None) -> AsyncIterator[pb.GenerateResponse]:
        greq = to_generate_request(req, self.name)
        try:
            rid, stream = await self.gen.start(greq, tenant, track=False)  # KServe ids need not be unique
        except RequestError as e:
            raise RequestError(kserve_field(e.field), e.message) from None
        try:
            async for u in stream:
                out = u.output
                chunk = pb.GenerateResponse(request_id=req.id, token_ids=out.new_token_ids, text=out.delta_text,
                                            finished=out.finished, finish_reason=out.finish_reason or "")
                if out.finished:
                    chunk.usage.prompt_tokens = len(out.prompt_token_ids)
                    chunk.usage.completion_tokens = len(out.token_ids)
                    chunk.usage.cached_prompt_tokens = out.num_cached_tokens
                    chunk.usage.cached_prompt_tokens_by_tier.update(out.cached_tokens_by_tier or {})
                yield chunk
        finally:
            self.gen.finish(tenant, rid, stream)

    async def ModelInfer(self, req: ks.ModelInferRequest, context: grpc.aio.ServicerContext) -> ks.ModelInferResponse:
        tenant = self.keys.tenant(context.invocation_metadata())
        text, ids, last = [], [], pb.GenerateResponse()
        async for c in self._chunks(req, tenant):
            text.append(c.text)
            ids.extend(c.token_ids)
            last = c
        return _response(req, self.name, "".join(text), ids, _final_params(last))

    async def ModelStreamInfer(self, requests: AsyncIterator[ks.ModelInferRequest | Exception],
                               context: grpc.aio.ServicerContext) -> AsyncIterator[ks.ModelStreamInferResponse]:
        tenant = self.keys.tenant(context.invocation_metadata())
        out: asyncio.Queue[ks.ModelStreamInferResponse | None] = asyncio.Queue()
        tasks: set[asyncio.Task[None]] = set()

        async def one(req: ks.ModelInferRequest | Exception) -> None:
            try:
                if isinstance(req, Exception):
                    raise req  # a message that did not parse: this request fails, the stream goes on
                async for c in self._chunks(req, tenant):
                    params: dict[str, Any] = {"triton_final_response": c.finished}
                    if c.finished:
                        params.update(_final_params(c))
                    resp = _response(req, self.name, c.text, list(c.token_ids), params)
                    await out.put(ks.ModelStreamInferResponse(infer_response=resp))
            except Exception as exc:
                await out.put(ks.ModelStreamInferResponse(error_message=stream_error_message(exc)))

        async def read() -> None:
            try:
                async for req in requests:
                    task = asyncio.ensure_future(one(req))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
                while tasks:
                    await asyncio.wait(set(tasks))
            finally:
                await out.put(None)

        reader = asyncio.ensure_future(read())
        try:
            while (item := await out.get()) is not None:
                yield item
        finally:
            for t in (reader, *tasks):
                t.cancel()  # client gone: each request's own `finally` releases its blocks

