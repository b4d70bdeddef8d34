"""Body bytes -> validated request model, with errors that name the offending field.

FastAPI's own body parsing answers 422 with a list of errors; OpenAI clients expect one 400 in the
OpenAI error shape with `param` set, so routes parse the body here instead.
"""

from __future__ import annotations

import json
from typing import TypeVar

from pydantic import BaseModel, ValidationError

from nanokv.gateway.http.errors import OpenAIError

M = TypeVar("M", bound=BaseModel)

# Unions produce one error per member; a single sentence is clearer than all of them.
_UNION_HINTS = {
    "prompt": "must be a string, a list of token ids (integers >= 0), or a one-element list of either",
    "stop": "must be a string or a list of strings",
    "content": "must be a string or a list of {'type': 'text', 'text': ...} parts",
}
_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "literal"}


def parse_body(body: bytes, model: type[M]) -> M:
    try:
        # decode explicitly: json.loads(bytes) would guess UTF-16/32 from odd leading bytes
        data = json.loads(body.decode("utf-8"), parse_constant=_reject_constant)
    except UnicodeDecodeError as e:
        raise OpenAIError(400, f"request body is not valid UTF-8: {e.reason} at byte {e.start}") from None
    except json.JSONDecodeError as e:
        where = f"line {e.lineno} column {e.colno}"
        raise OpenAIError(400, f"request body is not valid JSON: {e.msg} ({where})") from None
    if not isinstance(data, dict):
        raise OpenAIError(400, f"request body must be a JSON object, got {type(data).__name__}")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise _to_openai_error(e) from None


def _reject_constant(name: str) -> None:
    # Python's json accepts NaN/Infinity; JSON does not, and NaN would slip past range checks.
    raise OpenAIError(400, f"request body is not valid JSON: {name} is not a JSON number")


def _field_path(loc: tuple[int | str, ...]) -> str:
    """('messages', 0, 'role') -> 'messages[0].role'; stops at pydantic's union-member tags."""
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
            continue
        if part.split("[")[0].split("-")[0] in _TYPE_TAGS or "[" in part or "-" in part:
            break
        path += f".{part}" if path else part
    return path


def _to_openai_error(err: ValidationError) -> OpenAIError:
    first = err.errors()[0]
    param = _field_path(first["loc"]) or None
    last = param.rsplit(".", 1)[-1].split("[")[0] if param else ""
    n_same = sum(1 for e in err.errors() if _field_path(e["loc"]) == param)
    if first["type"] == "missing":
        msg = "required field is missing"
    elif first["type"] == "extra_forbidden":
        msg = "unknown field (not part of the OpenAI API subset nanokv serves)"
    elif n_same > 1 and last in _UNION_HINTS:
        msg = _UNION_HINTS[last]
    else:
        msg = first["msg"]
    shown = repr(first.get("input"))
    if first["type"] not in ("missing",) and len(shown) <= 60:
        msg += f" (got {shown})"
    return OpenAIError(400, f"{param}: {msg}" if param else msg, param=param)
