"""The disk tier's file format: one file per KV block, a fixed header followed by the payload.

    offset  size  field
    0       8     magic b"NKVBLK\\r\\n" (the CR LF catches a file mangled by a text-mode copy)
    8       2     format version, uint16 little-endian
    10      2     header length in bytes (184 for version 1)
    12      4     flags: bit 0 set when the block has a parent hash
    16      32    fingerprint digest: blake2b-256 of the model + KV-format fingerprint
    48      32    block hash: the salted chained hash of cache_service/hashing.py
    80      32    parent block hash (zeros when flag bit 0 is clear)
    112     8     payload length in bytes, uint64 little-endian
    120     32    payload digest: blake2b-256 of the payload
    152     32    header digest: blake2b-256 of bytes 0..151
    184     n     payload (opaque here: the bytes of one block in every layer, in the caller's format)

The header digest covers the payload digest, so header and payload are tied together: a header
from one block in front of another block's payload fails the payload check. Header checks are
cheap (184 bytes) and run at re-index; the payload check reads the whole block and runs on get.
"""

from __future__ import annotations

import dataclasses
import hashlib
import struct
from collections.abc import Sequence

MAGIC = b"NKVBLK\r\n"
VERSION = 1
HASH_BYTES = 32  # cache_service/hashing.py's block hashes (sha256 or blake2b-256)
_BODY = struct.Struct("<8sHHI32s32s32sQ32s")  # everything the header digest covers
HEADER_SIZE = _BODY.size + 32
_FLAG_PARENT = 1
_ZERO_HASH = bytes(HASH_BYTES)


class BadFile(Exception):
    """A block file that must not be served. ``kind`` is one of: truncated, corrupt, foreign."""

    def __init__(self, kind: str, detail: str):
        super().__init__(f"{kind}: {detail}")
        self.kind, self.detail = kind, detail


@dataclasses.dataclass(frozen=True)
class Header:
    block_hash: bytes
    parent_hash: bytes | None
    payload_len: int
    payload_digest: bytes
    fingerprint_digest: bytes


def _digest(data: bytes | memoryview, person: bytes) -> bytes:
    # distinct personalisation strings keep a payload digest from ever passing as a header digest
    return hashlib.blake2b(data, digest_size=32, person=person).digest()


def fingerprint_digest(fingerprint: bytes | str) -> bytes:
    raw = fingerprint.encode("utf-8") if isinstance(fingerprint, str) else bytes(fingerprint)
    return _digest(raw, b"nkv-disk-fprint")


def pack_header(fp_digest: bytes, block_hash: bytes, parent_hash: bytes | None,
                payload: memoryview | Sequence[memoryview]) -> bytes:
    """The header for ``payload`` (a 1-D byte memoryview, or the parts it is made of, in order);
    hashes the whole payload once."""
    flags = _FLAG_PARENT if parent_hash is not None else 0
    parts = [payload] if isinstance(payload, memoryview) else payload
    h = hashlib.blake2b(digest_size=32, person=b"nkv-disk-payload")
    for part in parts:
        h.update(part)
    body = _BODY.pack(MAGIC, VERSION, HEADER_SIZE, flags, fp_digest, block_hash, parent_hash or _ZERO_HASH,
                      sum(p.nbytes for p in parts), h.digest())
    return body + _digest(body, b"nkv-disk-header")


def parse_header(raw: bytes, fp_digest: bytes, file_size: int, expect_hash: bytes | None = None) -> Header:
    """Check a file's first HEADER_SIZE bytes against this store's fingerprint, the file's name
    (``expect_hash``) and size; raise BadFile saying why the file cannot be used."""
    if len(raw) < HEADER_SIZE:
        if MAGIC.startswith(raw[:len(MAGIC)]):  # a prefix of a real header: the write was cut short
            raise BadFile("truncated", f"{file_size} bytes, shorter than the {HEADER_SIZE}-byte header")
        raise BadFile("corrupt", "no block-file magic")
    magic, version, header_len, flags, fp, bhash, parent, plen, pdigest = _BODY.unpack_from(raw)
    if magic != MAGIC:
        raise BadFile("corrupt", "no block-file magic")
    if version != VERSION or header_len != HEADER_SIZE:
        # another nanokv release's layout: unreadable here, though not damaged
        raise BadFile("foreign", f"format version {version} (header {header_len} bytes); this build reads {VERSION}")
    if _digest(raw[:_BODY.size], b"nkv-disk-header") != raw[_BODY.size:HEADER_SIZE]:
        raise BadFile("corrupt", "header digest mismatch")
    if fp != fp_digest:
        raise BadFile("foreign", "written for another model or KV format (fingerprint differs)")
    if expect_hash is not None and bhash != expect_hash:
        raise BadFile("corrupt", "block hash in the header differs from the file name")
    if file_size < HEADER_SIZE + plen:
        raise BadFile("truncated", f"{file_size} bytes, header says {HEADER_SIZE + plen}")
    if file_size > HEADER_SIZE + plen:
        raise BadFile("corrupt", f"{file_size} bytes, header says {HEADER_SIZE + plen}")
    return Header(bhash, parent if flags & _FLAG_PARENT else None, plen, pdigest, fp)


def check_payload(header: Header, payload: bytes) -> None:
    if len(payload) != header.payload_len:
        raise BadFile("truncated", f"payload of {len(payload)} bytes, header says {header.payload_len}")
    if _digest(payload, b"nkv-disk-payload") != header.payload_digest:
        raise BadFile("corrupt", "payload checksum mismatch")
