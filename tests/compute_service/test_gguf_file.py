"""compute_service/model/gguf_file.py against gguf.GGUFReader on the embedded SmolLM2 GGUF: the same
tensors (names, types, shapes, bytes) and the same metadata values, read in a fraction of the time;
a truncated or foreign file is refused with the `model` field named, never half-loaded."""

from __future__ import annotations

import time

import gguf
import numpy as np
import pytest
import torch

from nanokv.compute_service.model.gguf_file import GGUFFile
from nanokv.compute_service.model.gguf_loader import read_gguf
from nanokv.errors import NanoKVError
from nanokv.model_files import embedded_model_path


def test_same_tensors_and_metadata_as_the_gguf_package():
    path = embedded_model_path()
    t0 = time.perf_counter()
    ours = GGUFFile(path)
    ours_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    ref = gguf.GGUFReader(path)
    ref_s = time.perf_counter() - t0
    assert [t.name for t in ours.tensors] == [t.name for t in ref.tensors] and len(ours.tensors) == 272
    for a, b in zip(ours.tensors, ref.tensors):
        assert a.tensor_type == b.tensor_type and a.shape.tolist() == b.shape.tolist(), a.name
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape, a.name
        assert np.array_equal(np.asarray(a.data), np.asarray(b.data)), a.name
    scalars = 0
    for key, field in ref.fields.items():
        if key.startswith("GGUF."):
            continue
        value = field.contents()
        if isinstance(value, list) and value and isinstance(value[0], str):
            assert ours.get(key, "absent") == "absent", key  # string arrays (the vocabulary) are not decoded
            continue
        assert ours.get(key) == value, key
        scalars += 1
    assert scalars >= 20 and ours.get("general.architecture") == "llama"
    assert ours_s < ref_s / 5, (ours_s, ref_s)  # the point of it: the tokenizer arrays are stepped over


def test_the_weights_it_gives_equal_the_gguf_packages(monkeypatch):
    """The dequantized weights through our reader equal those through gguf.GGUFReader, tensor for tensor."""
    import nanokv.compute_service.model.gguf_loader as loader

    path = embedded_model_path()
    cfg, ours = read_gguf(path)
    monkeypatch.setattr(loader, "_reader", lambda p: _RefReader(gguf.GGUFReader(p)))
    cfg_ref, ref = read_gguf(path)
    assert cfg == cfg_ref
    n = 0
    for (name, a), (name_ref, b) in zip(ours, ref, strict=True):
        assert name == name_ref and isinstance(a, torch.Tensor) and torch.equal(a, b), name
        n += 1
    assert n == 272


class _RefReader:
    """gguf.GGUFReader seen through GGUFFile's get()."""

    def __init__(self, r: gguf.GGUFReader) -> None:
        self.tensors = r.tensors
        self._fields = r.fields

    def get(self, key: str, default=None):
        f = self._fields.get(key)
        return default if f is None else f.contents()


@pytest.mark.parametrize("cut", ["magic", "header", "data"])
def test_a_damaged_file_is_refused_naming_the_model(tmp_path, cut):
    data = open(embedded_model_path(), "rb").read()
    bad = {"magic": b"GGUX" + data[4:200], "header": data[:100_000], "data": data[:len(data) - 4096]}[cut]
    path = tmp_path / "bad.gguf"
    path.write_bytes(bad)
    with pytest.raises(NanoKVError) as e:
        read_gguf(str(path))
    assert e.value.field == "model" and "not a readable GGUF file" in str(e.value), str(e.value)
