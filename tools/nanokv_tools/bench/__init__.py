"""Benchmarks: commands that print numbers and write JSON (never timed tests)."""

from __future__ import annotations

import json


def write_json(path: str | None, result: dict, indent: int = 1) -> None:
    """A bench main's result to its --out file, when one was given."""
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=indent)
