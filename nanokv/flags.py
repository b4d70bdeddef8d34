"""Command-line flags for every EngineConfig key, generated from the dataclass (`block_size` ->
`--block-size`), so no key can drift out of sync. Flags left out are not passed at all: defaults
live in EngineConfig only. `--config-json` passes a whole config (how `nanokv up` hands the same
config to every service)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import types
import typing
from typing import Any

from nanokv.config import EngineConfig


def _flag_type(annotation: Any) -> type | None:
    """bool -> None (a --x/--no-x switch); int/float/str as is; anything else (dicts, Any) -> str."""
    args = typing.get_args(annotation) if isinstance(annotation, types.UnionType) else (annotation,)
    args = tuple(a for a in args if a is not type(None))
    if args == (bool,):
        return None
    return args[0] if len(args) == 1 and args[0] in (int, float, str) else str


def add_config_args(parser: argparse.ArgumentParser) -> None:
    eng = parser.add_argument_group("engine (EngineConfig keys)")
    hints = typing.get_type_hints(EngineConfig)
    for f in dataclasses.fields(EngineConfig):
        if f.name == "extra":
            continue
        flag = "--" + f.name.replace("_", "-")
        default = f.default if f.default is not dataclasses.MISSING else None
        kind = _flag_type(hints[f.name])
        help_text = f"default: {default!r}"
        if kind is None:
            eng.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction,
                             default=argparse.SUPPRESS, help=help_text)
        else:
            eng.add_argument(flag, dest=f.name, type=kind, default=argparse.SUPPRESS, help=help_text)

    eng.add_argument("--config-json", dest="config_json", default=None,
                     help="a whole EngineConfig as JSON; flags given beside it override its keys")


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    names = {f.name for f in dataclasses.fields(EngineConfig)} - {"extra"}
    kw: dict[str, Any] = dict(json.loads(args.config_json)) if getattr(args, "config_json", None) else {}
    kw.update({k: v for k, v in vars(args).items() if k in names})
    return kw
