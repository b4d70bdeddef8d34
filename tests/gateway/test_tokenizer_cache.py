"""nanokv/tokenizer_cache.py: the embedded GGUF's tokenizer converted once, stored owner-only, and read
back as the same tokenizer (ids, chat template, special tokens); a damaged entry is converted again."""

from __future__ import annotations

import os

import pytest
from transformers import AutoTokenizer

from nanokv.model_files import embedded_model_path
from nanokv.tokenizer_cache import cache_root, load_gguf_tokenizer

TEXTS = ["Hello world, the capital of France is Paris.", "  spaces\tand\nnewlines  ", "naïve café 東京 🙂", ""]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]


@pytest.fixture
def fresh(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    path = embedded_model_path()
    folder, name = os.path.split(path)
    calls = []

    def convert():
        calls.append(1)
        return AutoTokenizer.from_pretrained(folder, gguf_file=name)
    return path, convert, calls


def _same(a, b):
    for t in TEXTS:
        assert a.encode(t) == b.encode(t), t
    chat = {"add_generation_prompt": True}
    assert a.apply_chat_template(CHAT, **chat) == b.apply_chat_template(CHAT, **chat)
    assert (a.eos_token_id, a.bos_token_id, len(a)) == (b.eos_token_id, b.bos_token_id, len(b))


def test_converted_once_then_read_back_the_same(fresh):
    path, convert, calls = fresh
    first = load_gguf_tokenizer(path, convert)
    assert calls == [1]
    entries = os.listdir(cache_root())
    assert len(entries) == 1 and not entries[0].startswith(".tmp")
    folder = os.path.join(cache_root(), entries[0])
    assert os.stat(cache_root()).st_mode & 0o777 == 0o700 and os.stat(folder).st_mode & 0o777 == 0o700
    for f in os.listdir(folder):
        assert os.stat(os.path.join(folder, f)).st_mode & 0o777 == 0o600, f
    second = load_gguf_tokenizer(path, convert)
    assert calls == [1]  # read from the folder, not converted
    _same(first, second)


def test_a_damaged_entry_is_converted_again(fresh):
    path, convert, calls = fresh
    reference = load_gguf_tokenizer(path, convert)
    folder = os.path.join(cache_root(), os.listdir(cache_root())[0])
    with open(os.path.join(folder, "tokenizer.json"), "w") as f:
        f.write("{ not json")
    again = load_gguf_tokenizer(path, convert)
    assert calls == [1, 1]
    _same(reference, again)
    _same(reference, load_gguf_tokenizer(path, convert))  # and stored again, whole
    assert calls == [1, 1]
