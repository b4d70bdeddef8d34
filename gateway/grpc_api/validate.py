"""Request bytes -> checked messages -> engine inputs, with errors that name the field.

Handlers receive raw bytes and parse them here, so a malformed message is INVALID_ARGUMENT with a
clear sentence (gRPC's own deserializer would answer INTERNAL). Fields the server does not know
are refused rather than ignored: a client built against a newer schema (or sending a value with
the wrong wire type, which protobuf files as unknown) must not get a silently different sampling.
"""

from __future__ import annotations

from typing import Any, TypeVar, cast

from google.protobuf.message import DecodeError, Message
from google.protobuf.unknown_fields import UnknownFieldSet

from nanokv.errors import RequestError
from nanokv.gateway.grpc_api.errors import ModelNotFound
from nanokv.protos import nanokv_v1_pb2 as pb
from nanokv.sampling import SamplingParams

M = TypeVar("M", bound=Message)

MAX_REQUEST_ID_CHARS = 128
MAX_CACHE_SALT_CHARS = 256
# SamplingParams fields of the proto that map 1:1 onto nanokv.sampling.SamplingParams
_OPTIONAL_PARAMS = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "logprobs")


def parse(data: bytes, cls: type[M]) -> M:
    msg = cls()
    try:
        msg.ParseFromString(data)
    except DecodeError:
        raise RequestError("request", f"not a valid {cls.DESCRIPTOR.full_name} message "
                                      f"({len(data)} bytes that protobuf cannot decode)") from None
    reject_unknown(msg, "")
    reject_two_of_a_oneof(data, msg)
    return cast(M, msg)  # (protobuf's Message is untyped here: cls() reads as Any)


def _top_level_numbers(data: bytes) -> set[int]:
    """Field numbers present at the top level of a message that already parsed (so it is well formed)."""
    seen, i = set(), 0

    def varint() -> int:
        nonlocal i
        shift = value = 0
        while True:
            b = data[i]
            i += 1
            value |= (b & 0x7F) << shift
            shift += 7
            if not b & 0x80:
                return value

    while i < len(data):
        key = varint()
        number, wire = key >> 3, key & 7
        seen.add(number)
        if wire == 0:
            varint()
        elif wire == 2:
            n = varint()  # read before `i +=`, which would load i first
            i += n
        elif wire in (1, 5):
            i += 8 if wire == 1 else 4
        else:  # groups: not in our protos; parsing already accepted them, stop looking
            break
    return seen


def reject_two_of_a_oneof(data: bytes, msg: Message) -> None:
    """Protobuf keeps the last of two oneof members on the wire; a request that sends both (a prompt
    as text and as token ids) is refused instead of having one silently dropped."""
    oneofs = msg.DESCRIPTOR.oneofs
    if not oneofs:
        return
    present = _top_level_numbers(data)
    for oneof in oneofs:
        sent = [f.name for f in oneof.fields if f.number in present]
        if len(sent) > 1:
            allowed = " or ".join(f.name for f in oneof.fields)
            raise RequestError(oneof.name, f"got {' and '.join(sent)}; allowed: exactly one of {allowed}")


def reject_unknown(msg: Message, path: str) -> None:
    """Raise on unknown fields in msg or any message inside it (map entries included)."""
    unknown = UnknownFieldSet(msg)
    if len(unknown):
        numbers = sorted({f.field_number for f in unknown})
        known = ", ".join(f.name for f in msg.DESCRIPTOR.fields)
        where = path or msg.DESCRIPTOR.name
        raise RequestError(where, f"unknown field number(s) {numbers} or a known field sent with the wrong type; "
                                  f"{msg.DESCRIPTOR.full_name} has: {known}")
    for field, value in msg.ListFields():
        if field.type != field.TYPE_MESSAGE:
            continue
        sub = f"{path}.{field.name}" if path else field.name
        if field.message_type.GetOptions().map_entry:
            for k, v in value.items():
                if isinstance(v, Message):
                    reject_unknown(v, f"{sub}[{k!r}]")
        elif field.is_repeated:
            for i, v in enumerate(value):
                reject_unknown(v, f"{sub}[{i}]")
        else:
            reject_unknown(value, sub)


def check_model(requested: str, served: str, field: str = "model") -> None:
    if requested and requested != served:
        raise ModelNotFound(f"{field}: model '{requested}' does not exist; this server serves '{served}'")


def check_request_id(rid: str, field: str = "request_id") -> None:
    if len(rid) > MAX_REQUEST_ID_CHARS:
        raise RequestError(field, f"{len(rid)} characters; allowed: at most {MAX_REQUEST_ID_CHARS}")
    if not rid.isprintable():
        raise RequestError(field, "allowed: printable characters only")


def check_cache_salt(salt: str, field: str = "cache_salt") -> None:
    if len(salt) > MAX_CACHE_SALT_CHARS:
        raise RequestError(field, f"{len(salt)} characters; allowed: at most {MAX_CACHE_SALT_CHARS}")


def sampling_params(p: pb.SamplingParams, max_model_len: int, prefix: str = "sampling_params") -> SamplingParams:
    kw: dict[str, Any] = {name: getattr(p, name) for name in _OPTIONAL_PARAMS if p.HasField(name)}
    mt = kw.get("max_tokens")
    if mt is not None and mt > max_model_len:
        raise RequestError(f"{prefix}.max_tokens", f"got {mt}; the model's context is {max_model_len} tokens")
    try:
        return SamplingParams(stop=list(p.stop), stop_token_ids=list(p.stop_token_ids), ignore_eos=p.ignore_eos,
                              include_stop_str_in_output=p.include_stop_str_in_output, **kw)
    except RequestError as e:
        raise RequestError(f"{prefix}.{e.field}", e.message) from None


def prompt_of(req: pb.GenerateRequest) -> str | list[int]:
    which = req.WhichOneof("input")
    if which is None:
        raise RequestError("input", "required; allowed: text (a string) or token_ids (a list of token ids)")
    if which == "text":
        if not req.text:
            raise RequestError("text", "must not be empty")
        return req.text
    if not req.token_ids.ids:
        raise RequestError("token_ids.ids", "must not be empty")
    return list(req.token_ids.ids)


def prompt_field(req: pb.GenerateRequest, engine_field: str) -> str:
    """The proto field a client sent for what the engine calls `engine_field` (its errors say 'prompt')."""
    if engine_field == "prompt":
        return "text" if req.WhichOneof("input") == "text" else "token_ids.ids"
    if engine_field in ("max_tokens",):
        return f"sampling_params.{engine_field}"
    return engine_field
