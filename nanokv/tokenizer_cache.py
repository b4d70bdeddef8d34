"""A GGUF's tokenizer, converted once and kept as tokenizer files in the user's cache folder.

transformers builds the tokenizer of a GGUF checkpoint by parsing the whole file with
gguf.GGUFReader (one numpy view per vocabulary item: ~7 s for SmolLM2's 49,152 tokens and 48,900
merges) and converting it, in every process that starts: each gateway, each `LLM()`. The result is
an ordinary fast tokenizer, which `save_pretrained` writes as tokenizer.json + tokenizer_config.json
(data, no code) and `from_pretrained` reads back in a fraction of a second.

Key: the file's absolute path, size and mtime and the transformers version, hashed; a changed file or
library gets a fresh conversion. Folder: $XDG_CACHE_HOME/nanokv/tokenizers (default ~/.cache),
created owner-only; a folder appears complete or not at all (written to a temp name, then renamed).
Anything that fails here (no home, a full or read-only disk) falls back to converting in memory.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)


def cache_root() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "nanokv", "tokenizers")


def _key(gguf_path: str) -> str:
    import transformers

    st = os.stat(gguf_path)
    ident = f"{os.path.abspath(gguf_path)}\0{st.st_size}\0{st.st_mtime_ns}\0{transformers.__version__}"
    return hashlib.sha256(ident.encode()).hexdigest()[:32]


def load_gguf_tokenizer(gguf_path: str, convert: Callable[[], Any]) -> Any:
    """The tokenizer of `gguf_path`: from the cache folder when a conversion is there, else convert()
    (transformers' own GGUF path) and store it for the next process."""
    from transformers import AutoTokenizer

    try:
        folder = os.path.join(cache_root(), _key(gguf_path))
    except OSError:
        return convert()
    if os.path.isfile(os.path.join(folder, "tokenizer.json")):
        try:
            return AutoTokenizer.from_pretrained(folder)
        except (OSError, ValueError, KeyError) as e:  # a damaged entry: convert again, replace it
            log.warning("tokenizer cache %s unreadable (%s); converting the GGUF again", folder, e)
            shutil.rmtree(folder, ignore_errors=True)
    tok = convert()
    _store(tok, folder)
    return tok


def _store(tok: Any, folder: str) -> None:
    parent = os.path.dirname(folder)
    tmp = None
    try:
        os.makedirs(parent, mode=0o700, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=".tmp-", dir=parent)  # (mkdtemp: mode 0700)
        tok.save_pretrained(tmp)
        for name in os.listdir(tmp):
            os.chmod(os.path.join(tmp, name), 0o600)
        os.rename(tmp, folder)  # atomic; another process may have won the race: then keep theirs
        tmp = None
    except OSError as e:
        log.info("tokenizer not cached (%s): the next process converts the GGUF again", e)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
