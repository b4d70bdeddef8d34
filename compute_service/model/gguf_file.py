"""A GGUF file's metadata and tensor table, read in one pass over its header; tensors stay views of
the memory-mapped file.

Why not gguf.GGUFReader: it builds a numpy view for every item of every metadata array, and a
chat model's tokenizer arrays (SmolLM2: 49,152 tokens and 48,900 merges) made that 6.5 s of each
model load, three quarters of it. Here string arrays are stepped over (their lengths read, their
bytes never decoded: nothing here needs the vocabulary) and numeric arrays are one frombuffer.
`tensors` matches GGUFReader's: name, tensor_type (gguf.GGMLQuantizationType), shape (ggml order,
fastest dimension first), data (float types as their numpy dtype in row-major order, quantized
types as uint8 rows of blocks), so gguf.quants.dequantize takes `data` as it is.

Format (little-endian, versions 2 and 3): magic "GGUF", u32 version, u64 tensor count, u64 metadata
count; metadata as (string key, u32 type, value); tensor infos as (string name, u32 n_dims, u64 dims
[n_dims], u32 ggml type, u64 offset); the data section starts at the next multiple of
`general.alignment` (default 32) and each offset is relative to it. A string is u64 length + bytes.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

_SCALARS = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8",
            12: "<f8"}
_STRING, _ARRAY = 8, 9
_FLOAT_TENSORS = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8, "I16": np.int16,
                  "I32": np.int32, "I64": np.int64}
_NOT_READ = object()  # a string array's value: stepped over


class GGUFFormatError(ValueError):
    pass


@dataclass(frozen=True)
class Tensor:
    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: np.ndarray  # [n_dims] uint64, fastest dimension first (ggml order)
    data: np.ndarray  # a read-only view of the mapped file


class GGUFFile:
    def __init__(self, path: str) -> None:
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

        self.buf = np.memmap(path, mode="r")
        self._mv = memoryview(self.buf)  # type: ignore[arg-type]
        self._pos = 0
        if bytes(self._take(4)) != b"GGUF":
            raise GGUFFormatError("GGUF magic invalid")
        version, n_tensors, n_meta = self._unpack("<IQQ")
        if version not in (2, 3):
            raise GGUFFormatError(f"GGUF version {version} is not supported (2, 3)")
        self.meta: dict[str, Any] = {}
        for _ in range(n_meta):
            key = self._string()
            (vtype,) = self._unpack("<I")
            self.meta[key] = self._value(vtype)
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            (n_dims,) = self._unpack("<I")
            dims = np.frombuffer(self._take(8 * n_dims), dtype="<u8").copy()
            qtype, offset = self._unpack("<IQ")
            infos.append((name, dims, qtype, offset))
        align = int(self.meta.get("general.alignment", 32))
        if align <= 0 or align & (align - 1):
            raise GGUFFormatError(f"general.alignment {align} is not a power of two")
        start = -(-self._pos // align) * align
        self.tensors: list[Tensor] = []
        for name, dims, qtype, offset in infos:
            try:
                ggml = GGMLQuantizationType(qtype)
            except ValueError:
                raise GGUFFormatError(f"tensor {name}: unknown ggml type {qtype}") from None
            block, type_size = GGML_QUANT_SIZES[ggml]
            rows = [int(d) for d in reversed(dims.tolist())]  # row-major: slowest first
            n = int(np.prod(rows)) if rows else 1
            if rows and rows[-1] % block:
                raise GGUFFormatError(f"tensor {name}: row of {rows[-1]} is not whole {ggml.name} blocks")
            nbytes = n // block * type_size
            lo = start + offset
            if lo + nbytes > len(self.buf):
                raise GGUFFormatError(f"tensor {name}: data ends past the end of the file (truncated?)")
            raw = self.buf[lo:lo + nbytes]
            if ggml.name in _FLOAT_TENSORS:
                data = raw.view(_FLOAT_TENSORS[ggml.name]).reshape(rows)
            else:
                data = raw.reshape(*rows[:-1], rows[-1] // block * type_size)
            self.tensors.append(Tensor(name, ggml, dims, data))

    def _take(self, n: int) -> memoryview:
        end = self._pos + n
        if n < 0 or end > len(self._mv):
            raise GGUFFormatError(f"header ends early at byte {self._pos} (truncated file?)")
        out = self._mv[self._pos:end]
        self._pos = end
        return out

    def _unpack(self, fmt: str) -> tuple:
        return struct.unpack(fmt, self._take(struct.calcsize(fmt)))

    def _string(self) -> str:
        (n,) = self._unpack("<Q")
        return bytes(self._take(n)).decode("utf-8", errors="replace")

    def _value(self, vtype: int) -> Any:
        if vtype in _SCALARS:
            dt = np.dtype(_SCALARS[vtype])
            return np.frombuffer(self._take(dt.itemsize), dtype=dt)[0].item()
        if vtype == _STRING:
            return self._string()
        if vtype != _ARRAY:
            raise GGUFFormatError(f"unknown metadata type {vtype} at byte {self._pos}")
        itype, count = self._unpack("<IQ")
        if itype in _SCALARS:
            dt = np.dtype(_SCALARS[itype])
            return np.frombuffer(self._take(dt.itemsize * count), dtype=dt).tolist()
        if itype == _STRING:  # step over: u64 length, bytes
            mv, pos = self._mv, self._pos
            for _ in range(count):
                if pos + 8 > len(mv):
                    raise GGUFFormatError("a string array ends past the end of the file (truncated?)")
                pos += 8 + int.from_bytes(mv[pos:pos + 8], "little")
            self._take(pos - self._pos)
            return _NOT_READ
        return [self._value(itype) for _ in range(count)]

    def get(self, key: str, default: Any = None) -> Any:
        v = self.meta.get(key, default)
        return default if v is _NOT_READ else v
