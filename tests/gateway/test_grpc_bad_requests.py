"""Bad requests to the public gRPC API of a real `nanokv serve`: each gets the right status code and
a message that names the field and what is allowed, while a good greedy stream keeps running beside
them with the same tokens as alone, and nothing is left holding KV blocks afterwards.

Every case is sent as raw bytes on the method path (a unary_stream or unary_unary call with no
serializer), so malformed, oversized and hand-built wire messages go through the same code as
well-formed ones. One server serves the whole table (tests/helpers_grpc.py).
"""

from __future__ import annotations

import struct
import threading
import time
from dataclasses import dataclass, field

import grpc
import pytest

from nanokv.protos import nanokv_v1_pb2 as pb
from nanokv.protos.kserve import grpc_service_pb2 as ks
from tests.helpers_grpc import KEY_A, NUM_BLOCKS, auth, collect, free_blocks_settle

GEN = "/nanokv.v1.Generation/"
KS = "/inference.GRPCInferenceService/"
STREAMING = {GEN + "Generate"}
VOCAB = 49152  # SmolLM2's vocabulary (GetModelInfo says so; test_grpc_api checks it)
CONTEXT = 8192  # its max_position_embeddings, the server's max_model_len
CACHE = NUM_BLOCKS * 16  # tokens the test server's whole KV cache holds (--block-size 16)
GOOD = pb.GenerateRequest(text="The capital of France is Paris. The capital of Italy is",
                          sampling_params=pb.SamplingParams(max_tokens=24, temperature=0.0))
I = grpc.StatusCode.INVALID_ARGUMENT


@dataclass
class Case:
    name: str
    method: str
    body: bytes
    code: grpc.StatusCode
    says: tuple[str, ...]  # substrings the details must hold: the field and the allowed values
    metadata: tuple = field(default_factory=auth)
    timeout: float = 30.0


def gen(say: tuple[str, ...], code: grpc.StatusCode = I, **kw) -> tuple[bytes, grpc.StatusCode, tuple[str, ...]]:
    """A Generate request with a valid prompt unless `kw` sets the input; sampling params via `sp`."""
    sp, no_input = kw.pop("sp", {}), kw.pop("no_input", False)
    req = pb.GenerateRequest(sampling_params=pb.SamplingParams(**sp), **kw)
    if req.WhichOneof("input") is None and not no_input:
        req.text = "Hello"
    return req.SerializeToString(), code, say


def sp(say: tuple[str, ...], **params) -> tuple[bytes, grpc.StatusCode, tuple[str, ...]]:
    return gen(say, sp=params)


def varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def infer(*, inputs=None, params=None, outputs=(), model="SmolLM2-135M-Instruct", version="",
          raw: bytes | None = None) -> bytes:
    """A KServe ModelInferRequest; `inputs` is a list of (name, datatype, shape, [bytes elements])."""
    r = ks.ModelInferRequest(model_name=model, model_version=version, id="bad")
    for name, dt, shape, elems in inputs if inputs is not None else [("text_input", "BYTES", [1], [b"Hi"])]:
        t = r.inputs.add(name=name, datatype=dt, shape=shape)
        if raw is None:
            t.contents.bytes_contents.extend(elems)
    if raw is not None:
        r.raw_input_contents.append(raw)
    for k, v in (params or {}).items():
        p = r.parameters[k]
        if isinstance(v, bool):
            p.bool_param = v
        elif isinstance(v, int):
            p.int64_param = v
        elif isinstance(v, float):
            p.double_param = v
        else:
            p.string_param = v
    for o in outputs:
        r.outputs.add(name=o)
    return r.SerializeToString()


def ks_case(name: str, body: bytes, say: tuple[str, ...], code: grpc.StatusCode = I, method: str = "ModelInfer"
            ) -> Case:
    return Case(name, KS + method, body, code, say)


def g(name: str, made: tuple[bytes, grpc.StatusCode, tuple[str, ...]], **kw) -> Case:
    body, code, say = made
    return Case(name, GEN + "Generate", body, code, say, **kw)


VALID = GOOD.SerializeToString()
NF = grpc.StatusCode.NOT_FOUND
UN = grpc.StatusCode.UNAUTHENTICATED
SPF = "sampling_params."

CASES = [
    # bytes that are not the message
    Case("junk-generate", GEN + "Generate", b"\xff\xfe\x00junk\x12", I, ("nanokv.v1.GenerateRequest", "decode")),
    Case("junk-model-info", GEN + "GetModelInfo", b"\x0a\xff\xff\xff", I, ("nanokv.v1.GetModelInfoRequest",)),
    Case("junk-model-infer", KS + "ModelInfer", b"\x0a\x05ab", I, ("inference.ModelInferRequest", "decode")),
    Case("truncated-valid-message", GEN + "Generate", VALID[:-3], I, ("nanokv.v1.GenerateRequest",)),
    Case("text-not-utf8", GEN + "Generate", b"\x1a\x02\xc3\x28", I, ("nanokv.v1.GenerateRequest",)),
    Case("oversized-message", GEN + "Generate", pb.GenerateRequest(text="x" * (2 << 20)).SerializeToString(),
         grpc.StatusCode.RESOURCE_EXHAUSTED, ("larger than max", "1048576")),
    # fields this server does not know, or known fields with the wrong wire type
    Case("unknown-top-level-field", GEN + "Generate", VALID + varint(99 << 3) + varint(1), I,
         ("GenerateRequest", "[99]", "sampling_params")),
    Case("unknown-sampling-field-n", GEN + "Generate",
         pb.GenerateRequest(text="Hi", sampling_params=pb.SamplingParams(max_tokens=2)).SerializeToString()
         + b"\x2a\x02" + varint(12 << 3) + varint(4), I, ("sampling_params", "[12]", "max_tokens, temperature")),
    Case("max-tokens-as-string", GEN + "Generate", b"\x1a\x02Hi\x2a\x04\x0a\x02ab", I,
         ("sampling_params", "wrong type", "max_tokens")),
    Case("sampling-params-as-varint", GEN + "Generate", b"\x1a\x02Hi" + varint(5 << 3) + varint(7), I,
         ("GenerateRequest", "[5]", "wrong type")),
    # out-of-range sampling values
    g("temperature-negative", sp((SPF + "temperature", "0 (greedy) to 100"), temperature=-0.5)),
    g("temperature-too-high", sp((SPF + "temperature", "0 (greedy) to 100"), temperature=101.0)),
    g("temperature-nan", sp((SPF + "temperature", "nan", "0 (greedy) to 100"), temperature=float("nan"))),
    g("temperature-inf", sp((SPF + "temperature", "inf"), temperature=float("inf"))),
    g("top-p-zero", sp((SPF + "top_p", "(0, 1]"), top_p=0.0)),
    g("top-p-above-one", sp((SPF + "top_p", "(0, 1]"), top_p=1.5)),
    g("top-k-below-minus-one", sp((SPF + "top_k", "-1 or 0 (off)"), top_k=-2)),
    g("min-p-above-one", sp((SPF + "min_p", "[0, 1]"), min_p=1.01)),
    g("max-tokens-zero", sp((SPF + "max_tokens", "at least 1"), max_tokens=0)),
    g("max-tokens-negative", sp((SPF + "max_tokens", "at least 1"), max_tokens=-5)),
    g("max-tokens-beyond-context", sp((SPF + "max_tokens", "context"), max_tokens=1_000_000)),
    g("seed-negative", sp((SPF + "seed", "[0, 2**63)"), seed=-1)),
    g("logprobs-too-many", sp((SPF + "logprobs", "0 to 20"), logprobs=21)),
    g("logprobs-negative", sp((SPF + "logprobs", "0 to 20"), logprobs=-1)),
    g("stop-empty-string", sp((SPF + "stop", "non-empty"), stop=[""])),
    g("stop-too-many", sp((SPF + "stop", "at most 16"), stop=[f"s{i}" for i in range(17)])),
    g("stop-token-id-negative", sp((SPF + "stop_token_ids", "non-negative"), stop_token_ids=[-1])),
    # prompts
    Case("both-text-and-token-ids", GEN + "Generate", pb.GenerateRequest(text="Hi").SerializeToString()
         + pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 2])).SerializeToString(), I,
         ("input", "got text and token_ids", "exactly one of text or token_ids")),
    Case("token-ids-then-text", GEN + "Generate", pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1])).SerializeToString()
         + VALID, I, ("input", "got text and token_ids", "exactly one")),
    g("no-input", gen(("input", "text", "token_ids"), no_input=True)),
    g("empty-text", gen(("text", "must not be empty"), text="")),
    g("empty-token-ids", gen(("token_ids.ids", "must not be empty"), token_ids=pb.TokenIds(ids=[]))),
    g("token-id-past-vocab", gen(("token_ids.ids", f"[0, {VOCAB})", str(VOCAB)),
                                 token_ids=pb.TokenIds(ids=[1, VOCAB]))),
    g("token-id-negative", gen(("token_ids.ids", f"[0, {VOCAB})", "-3"), token_ids=pb.TokenIds(ids=[-3]))),
    g("prompt-longer-than-context", gen(("token_ids.ids", "max_model_len", "at most"),
                                        token_ids=pb.TokenIds(ids=[42] * 9000))),
    g("prompt-plus-max-tokens-past-context", gen((SPF + "max_tokens", f"context of {CONTEXT}", "allowed: at most 92"),
                                                 token_ids=pb.TokenIds(ids=[42] * 8100), sp={"max_tokens": 200})),
    g("prompt-plus-max-tokens-past-kv-cache", gen((SPF + "max_tokens", f"has {NUM_BLOCKS}",
                                                   f"allowed: at most {CACHE - 4000}"),
                                                  token_ids=pb.TokenIds(ids=[42] * 4000), sp={"max_tokens": 200})),
    g("prompt-past-kv-cache", gen(("token_ids.ids", f"holds {CACHE}", f"at most {CACHE - 1}"),
                                  token_ids=pb.TokenIds(ids=[42] * (CACHE + 10)), sp={"max_tokens": 1})),
    # identity and routing
    g("unknown-model", gen(("model", "gpt-4", "SmolLM2-135M-Instruct"), NF, model="gpt-4")),
    g("request-id-too-long", gen(("request_id", "at most 128"), request_id="r" * 129)),
    g("request-id-not-printable", gen(("request_id", "printable"), request_id="a\nb")),
    g("cache-salt-too-long", gen(("cache_salt", "at most 256"), cache_salt="s" * 257)),
    Case("no-api-key", GEN + "Generate", VALID, UN, ("API key", "authorization: Bearer"), metadata=()),
    Case("wrong-api-key", GEN + "Generate", VALID, UN, ("API key",), metadata=auth("not-a-key")),
    Case("basic-scheme", GEN + "Generate", VALID, UN, ("Bearer",), metadata=(("authorization", f"Basic {KEY_A}"),)),
    Case("no-key-model-infer", KS + "ModelInfer", infer(), UN, ("API key",), metadata=()),
    Case("abort-without-id", GEN + "Abort", pb.AbortRequest().SerializeToString(), I, ("request_id", "required")),
    Case("unknown-method", GEN + "Translate", b"", grpc.StatusCode.UNIMPLEMENTED, ()),
    Case("deadline-exceeded", GEN + "Generate",
         pb.GenerateRequest(text="Count: one two three", sampling_params=pb.SamplingParams(
             max_tokens=500, temperature=0.0, ignore_eos=True)).SerializeToString(),
         grpc.StatusCode.DEADLINE_EXCEEDED, (), timeout=0.3),
    # KServe v2
    ks_case("kserve-wrong-input-name", infer(inputs=[("prompt", "BYTES", [1], [b"Hi"])]),
            ("inputs", "'prompt'", "text_input")),
    ks_case("kserve-two-inputs", infer(inputs=[("text_input", "BYTES", [1], [b"Hi"])] * 2),
            ("inputs", "exactly one input")),
    ks_case("kserve-wrong-datatype", infer(inputs=[("text_input", "INT32", [1], [b"Hi"])]),
            ("datatype", "INT32", "'BYTES'")),
    ks_case("kserve-wrong-shape", infer(inputs=[("text_input", "BYTES", [2], [b"Hi", b"Ho"])]),
            ("shape", "[2]", "[1] or [1, 1]")),
    ks_case("kserve-two-elements", infer(inputs=[("text_input", "BYTES", [1], [b"Hi", b"Ho"])]),
            ("text_input", "2 elements", "exactly 1")),
    ks_case("kserve-truncated-raw", infer(raw=struct.pack("<I", 50) + b"short"),
            ("raw_input_contents[0]", "truncated")),
    ks_case("kserve-not-utf8", infer(inputs=[("text_input", "BYTES", [1], [b"\xc3\x28"])]),
            ("text_input", "UTF-8")),
    ks_case("kserve-empty-prompt", infer(inputs=[("text_input", "BYTES", [1], [b""])]),
            ("inputs['text_input']", "must not be empty")),
    ks_case("kserve-unknown-output", infer(outputs=["logits"]), ("outputs", "'logits'", "text_output")),
    ks_case("kserve-unknown-parameter-n", infer(params={"n": 2}), ("parameters['n']", "max_tokens", "temperature")),
    ks_case("kserve-temperature-as-string", infer(params={"temperature": "hot"}),
            ("parameters['temperature']", "'hot'", "a number", "decimal string_param")),
    ks_case("kserve-temperature-as-bool", infer(params={"temperature": True}),
            ("parameters['temperature']", "float", "bool_param")),
    ks_case("kserve-max-tokens-as-float", infer(params={"max_tokens": 2.5}),
            ("parameters['max_tokens']", "int", "double_param")),
    ks_case("kserve-max-tokens-past-int32", infer(params={"max_tokens": 1 << 40}),
            ("parameters['max_tokens']", str(1 << 40), "allowed")),
    ks_case("kserve-top-p-out-of-range", infer(params={"top_p": 3.0}), ("parameters['top_p']", "(0, 1]")),
    ks_case("kserve-unknown-model", infer(model="llama"), ("model_name", "llama", "SmolLM2-135M-Instruct"), NF),
    ks_case("kserve-unknown-version", infer(version="7"), ("model_version", "'7'", "'1'"), NF),
    ks_case("kserve-metadata-unknown-model", ks.ModelMetadataRequest(name="llama").SerializeToString(),
            ("name", "llama"), NF, method="ModelMetadata"),
]


@pytest.fixture(scope="module")
def good_alone(grpc_stub):
    """The good request's greedy answer with nothing else running."""
    assert free_blocks_settle(grpc_stub).num_running == 0
    return collect(grpc_stub.Generate(GOOD, metadata=auth(), timeout=120))[:2]


@pytest.fixture(scope="module")
def good_beside(grpc_server, good_alone):
    """Runs the good request over and over, on its own channel, while the bad cases are sent."""
    stop, results, errors = threading.Event(), [], []

    def loop() -> None:
        with grpc_server.channel() as ch:
            stub = grpc_server.stub(ch)
            while not stop.is_set():
                try:
                    t0 = time.monotonic()
                    answer = collect(stub.Generate(GOOD, metadata=auth(), timeout=120))[:2]
                    results.append((t0, time.monotonic(), answer))
                except Exception as exc:  # reported by the last test
                    errors.append(exc)
                    return

    t = threading.Thread(target=loop, daemon=True)
    t.start()
    yield stop, t, results, errors


SENT: list[float] = []  # when each bad case went out


def send(channel: grpc.Channel, case: Case) -> grpc.RpcError:
    SENT.append(time.monotonic())
    if case.method in STREAMING:
        call = channel.unary_stream(case.method)(case.body, metadata=case.metadata, timeout=case.timeout)
        with pytest.raises(grpc.RpcError) as e:
            list(call)
    else:
        with pytest.raises(grpc.RpcError) as e:
            channel.unary_unary(case.method)(case.body, metadata=case.metadata, timeout=case.timeout)
    return e.value


def test_table_is_big_enough():
    assert len(CASES) >= 30 and len({c.name for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_request(grpc_channel, good_beside, case):
    err = send(grpc_channel, case)
    assert err.code() == case.code, f"{case.name}: {err.code()} {err.details()!r}"
    details = err.details() or ""
    for s in case.says:
        assert s in details, f"{case.name}: {s!r} not in {details!r}"
    assert "Traceback" not in details and "internal error" not in details


def test_message_just_under_the_size_limit_is_read(grpc_channel):
    """The oversized case above is refused by size; one just under --max-body-bytes (1 MiB) is parsed
    and refused for its content, so the limit is the documented one."""
    body = pb.GenerateRequest(text="x" * ((1 << 20) - 64)).SerializeToString()
    assert len(body) < 1 << 20  # just under --max-body-bytes: accepted, then refused for its length
    err = send(grpc_channel, Case("just-under", GEN + "Generate", body, I, ()))
    assert err.code() == I and "text" in err.details() and "max_model_len" in err.details()


def test_kserve_stream_answers_a_bad_request_and_goes_on(grpc_server, grpc_channel, good_alone):
    """In ModelStreamInfer a bad request gets an error_message and the stream serves the next one."""
    bad = ks.ModelInferRequest.FromString(infer(params={"top_p": 0.0}))
    good = ks.ModelInferRequest.FromString(infer(inputs=[("text_input", "BYTES", [1], [GOOD.text.encode()])],
                                                 params={"max_tokens": 24, "temperature": 0.0}))
    call = grpc_channel.stream_stream(KS + "ModelStreamInfer",
                                      request_serializer=ks.ModelInferRequest.SerializeToString,
                                      response_deserializer=ks.ModelStreamInferResponse.FromString)
    responses = list(call(iter([bad, good]), metadata=auth(), timeout=120))
    errors = [r.error_message for r in responses if r.error_message]
    assert len(errors) == 1 and "INVALID_ARGUMENT" in errors[0] and "parameters['top_p']" in errors[0]
    ids = []
    for r in responses:
        if not r.error_message:
            out = r.infer_response
            ids += list(struct.unpack(f"<{out.outputs[1].shape[0]}i", out.raw_output_contents[1]))
    assert ids == good_alone[0]


def test_good_stream_beside_the_bad_ones_and_no_leak(grpc_server, grpc_channel, good_alone, good_beside):
    stop, thread, results, errors = good_beside
    stop.set()
    thread.join(180)
    assert not thread.is_alive() and not errors, errors
    assert all(answer == good_alone for _, _, answer in results), (good_alone, results)
    beside = [t for t in SENT if any(t0 <= t <= t1 for t0, t1, _ in results)]
    assert len(beside) >= len(CASES) // 2, (len(beside), len(SENT))  # most bad cases met a running good one
    info = free_blocks_settle(grpc_server.stub(grpc_channel))
    assert info.num_running == 0 and info.num_waiting == 0
    assert info.kv_blocks_free == info.kv_blocks_total, info
