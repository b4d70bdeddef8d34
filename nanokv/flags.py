"""Command-line flags generated from a config class (`block_size` -> `--block-size`), so no key can
drift out of sync: EngineConfig's flat names for `serve`, `up` (every service in one command), or one
service's config (CacheConfig, ComputeConfig, GatewayConfig) for `nanokv cache|compute|gateway`, whose
--help then lists only that service's settings. Flags left out are not passed at all: defaults live
in the config classes only. `--config-json` passes a whole EngineConfig as JSON (how `nanokv up` hands
one config to every service); a service takes its own keys from it."""

from __future__ import annotations

import argparse
import dataclasses
import json
import types
import typing
from typing import Any

from nanokv.config import IN_PROCESS, OWNERS, SECTIONS, EngineConfig
from nanokv.config_checks import check_keys, keys
from nanokv.errors import ConfigError

TITLES = {EngineConfig: "engine (EngineConfig keys)", SECTIONS["cache"]: "cache service (CacheConfig keys)",
          SECTIONS["compute"]: "compute service (ComputeConfig keys)",
          SECTIONS["gateway"]: "gateway (GatewayConfig keys)"}


def _flag_type(annotation: Any) -> type | None:
    """bool -> None (a --x/--no-x switch); int/float/str as is; anything else (dicts, Any) -> str."""
    args = typing.get_args(annotation) if isinstance(annotation, types.UnionType) else (annotation,)
    args = tuple(a for a in args if a is not type(None))
    if args == (bool,):
        return None
    return args[0] if len(args) == 1 and args[0] in (int, float, str) else str


def _fields(config_cls: type) -> list[tuple[str, Any, Any]]:
    """(name, type hint, default) of every key of config_cls (EngineConfig: of its flat names)."""
    if config_cls is EngineConfig:
        out = []
        for name in EngineConfig.keys():
            if name in IN_PROCESS:
                out.append((name, typing.get_type_hints(EngineConfig)[name], IN_PROCESS[name]))
            else:
                out += [r for r in _fields(SECTIONS[OWNERS[name]]) if r[0] == name]
        return out
    hints = typing.get_type_hints(config_cls)
    return [(f.name, hints[f.name], f.default) for f in dataclasses.fields(config_cls)]


def config_keys(config_cls: type) -> list[str]:
    return EngineConfig.keys() if config_cls is EngineConfig else keys(config_cls)


def add_config_args(parser: argparse.ArgumentParser, config_cls: type = EngineConfig,
                    exclude: tuple[str, ...] = (), helps: dict[str, str] | None = None) -> None:
    """exclude: keys the command sets from flags of its own (`gateway --cache ADDR`); helps: longer help
    texts by key (the default is added), from the layers that know them (the policies' caveats)."""
    group = parser.add_argument_group(TITLES[config_cls])
    for name, hint, default in _fields(config_cls):
        if name in exclude:
            continue
        flag = "--" + name.replace("_", "-")
        kind = _flag_type(hint)
        help_text = f"default: {default!r}"
        if helps and name in helps:
            help_text = f"{helps[name]} ({help_text})"
        if kind is None:
            group.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction,
                               default=argparse.SUPPRESS, help=help_text)
        else:
            group.add_argument(flag, dest=name, type=kind, default=argparse.SUPPRESS, help=help_text)
    group.add_argument("--config-json", dest="config_json", default=None,
                       help="a whole EngineConfig as JSON (this command takes its own keys); flags given beside "
                            "it override its keys")
    parser.set_defaults(config_class=config_cls)


def config_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The keys of the parser's config class (add_config_args) given on the command line: those of
    --config-json first (any EngineConfig key is allowed there; this command's are kept), then flags."""
    config_cls = getattr(args, "config_class", EngineConfig)
    names = config_keys(config_cls)
    kw: dict[str, Any] = {}
    if getattr(args, "config_json", None):
        try:
            given = json.loads(args.config_json)
        except json.JSONDecodeError as e:
            raise ConfigError("config_json", f"invalid JSON: {e}") from None
        if not isinstance(given, dict):
            raise ConfigError("config_json", f"got {type(given).__name__}; a JSON object of config keys")
        check_keys(given, [*EngineConfig.keys(), *names])
        kw.update({k: v for k, v in given.items() if k in names})
    kw.update({k: v for k, v in vars(args).items() if k in names})
    return kw


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """config_kwargs, for EngineConfig (a service's own process-only keys, e.g. metrics_port, dropped)."""
    names = set(EngineConfig.keys())
    return {k: v for k, v in config_kwargs(args).items() if k in names}


def service_config(args: argparse.Namespace) -> Any:
    """The config of the parser's class, built (validated) from the command line."""
    config_cls = getattr(args, "config_class", EngineConfig)
    return config_cls(**config_kwargs(args))
