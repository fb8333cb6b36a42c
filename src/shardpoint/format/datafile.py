"""Data files: valid safetensors files written in one streaming pass, with a
CRC-32 per block computed while the bytes are in cache."""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Sequence
from typing import NamedTuple

import msgspec
import numpy as np
import torch

from ..errors import CorruptCheckpointError

try:  # the same CRC-32 as zlib's, about 5x faster (carry-less multiply): checksums stop costing a save its throughput
    from zlib_ng.zlib_ng import crc32  # noqa: F401 - the format's checksum, used by the writer and the readers
except ImportError:  # pragma: no cover - zlib-ng is a dependency; fall back where its wheel is missing
    from zlib import crc32  # noqa: F401

#: Bytes covered by one CRC-32 in the manifest; partial reads are rounded out to it.
CRC_BLOCK = int(os.environ.get("SHARDPOINT_CRC_BLOCK", 1 << 20))


def crc_count(length: int, block: int) -> int:
    """How many block CRCs a chunk of ``length`` bytes has: one per ``block`` bytes,
    the last block short, and one (of no bytes) for an empty chunk."""
    return -(-length // block) or 1


def first_bad_block(data: bytes | bytearray | memoryview, crcs: Sequence[int], block: int) -> int | None:
    """The first block of a whole chunk's bytes ``data`` whose CRC-32 is not the one
    ``crcs`` lists for it (``crcs`` has :func:`crc_count` entries), or None."""
    if len(data) <= block:
        return None if crc32(data) == crcs[0] else 0
    view = memoryview(data)
    for k, s in enumerate(range(0, len(view), block)):
        if crc32(view[s : s + block]) != crcs[k]:
            return k
    return None

# torch dtype name -> safetensors dtype code (None: stored as raw bytes, "U8")
DTYPES: dict[str, str | None] = {
    "float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16",
    "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL",
    "uint16": "U16", "uint32": "U32", "uint64": "U64",
    "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2",
    "complex64": None, "complex128": None, "float8_e4m3fnuz": None, "float8_e5m2fnuz": None,
}


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"``."""
    return str(dtype).removeprefix("torch.")


#: The manifest's dtype names that this torch has, with their torch dtypes.
TORCH_DTYPES: dict[str, torch.dtype] = {
    n: d for n in DTYPES if isinstance(d := getattr(torch, n, None), torch.dtype)
}


def dtype_from_name(name: str, key: str | None = None) -> torch.dtype:
    """The torch dtype for a manifest dtype name. Raises
    :class:`~shardpoint.CorruptCheckpointError` naming ``key`` (where the caller knows
    it) for a name shardpoint does not know or this torch does not have."""
    dtype = TORCH_DTYPES.get(name) if isinstance(name, str) else None
    if dtype is None:
        where = f"key {key!r}" if key is not None else "a tensor of the checkpoint"
        why = f"this torch {torch.__version__} lacks" if name in DTYPES else "shardpoint does not know"
        raise CorruptCheckpointError(
            f"{where} has dtype {name!r}, which {why} (known: {', '.join(sorted(DTYPES))}); the manifest is "
            "damaged or was written by a newer version: upgrade torch and shardpoint, or leave the key out with exclude="
        )
    return dtype


#: Bytes per element of each dtype (docs/format.md, section 5).
ITEMSIZES: dict[str, int] = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "int16": 2, "int8": 1,
    "uint8": 1, "bool": 1, "uint16": 2, "uint32": 4, "uint64": 8, "float8_e4m3fn": 1, "float8_e5m2": 1,
    "complex64": 8, "complex128": 16, "float8_e4m3fnuz": 1, "float8_e5m2fnuz": 1,
}


def itemsize_of(name: str) -> int:
    """Bytes per element of the dtype a manifest names; raises
    :class:`~shardpoint.CorruptCheckpointError` if unknown."""
    size = ITEMSIZES.get(name)
    if size is None:
        dtype_from_name(name)  # raises, naming the dtype
        raise AssertionError(name)  # pragma: no cover - every known dtype has a size
    return size


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """A byte view of a contiguous CPU tensor, without a copy."""
    if t.numel() == 0:
        return memoryview(b"")
    flat = t.reshape(-1)
    if flat.dtype != torch.uint8:
        flat = flat.view(torch.uint8)
    return flat.numpy().data.cast("B")


class WrittenChunk(msgspec.Struct, gc=False):
    """Where a chunk landed: absolute byte offset in its file, length, block CRCs (a
    record made in C: a save makes one per chunk it writes)."""

    offset: int
    length: int
    crc32: list[int]


#: safetensors refuses headers above 100 MB; so does every reader here.
MAX_HEADER = 100 << 20


class HeaderEntry(NamedTuple):
    """One tensor a data file's safetensors header declares."""

    dtype: str
    shape: tuple[int, ...]
    begin: int
    """Absolute byte offset of its first byte in the file."""
    end: int
    """Absolute byte offset one past its last byte."""


def header_length(prefix: bytes, file_size: int, where: str) -> int:
    """``N``, the JSON header's length, from a data file's first 8 bytes (of a file of
    ``file_size`` bytes); raises :class:`CorruptCheckpointError` naming ``where`` when
    no such header fits in the file."""
    if file_size < 8 or len(prefix) < 8:
        raise CorruptCheckpointError(f"{where}: too short to hold a safetensors header")
    (n,) = struct.unpack("<Q", bytes(prefix[:8]))
    if n > MAX_HEADER or 8 + n > file_size:
        raise CorruptCheckpointError(
            f"{where}: its safetensors header claims {n} bytes, more than the file ({file_size} bytes) can hold"
        )
    return int(n)


def parse_header(data: bytes, file_size: int, where: str) -> dict[str, HeaderEntry]:
    """The tensors a safetensors header declares (``data``: the ``N`` header bytes
    after the 8-byte length), by name, with absolute byte ranges; raises
    :class:`CorruptCheckpointError` naming ``where`` when the header is not sound.
    ``__metadata__`` is left out."""
    base = 8 + len(data)
    try:
        header = json.loads(bytes(data))
    except (ValueError, RecursionError):
        raise CorruptCheckpointError(f"{where}: its safetensors header is not valid JSON") from None
    if not isinstance(header, dict):
        raise CorruptCheckpointError(f"{where}: its safetensors header is not a JSON object")
    out: dict[str, HeaderEntry] = {}
    for tname, v in header.items():
        if tname == "__metadata__":
            continue
        off = v.get("data_offsets") if isinstance(v, dict) else None
        if not (isinstance(off, list) and len(off) == 2 and all(isinstance(x, int) and not isinstance(x, bool) for x in off)
                and 0 <= off[0] <= off[1] and base + off[1] <= max(file_size, base)):
            raise CorruptCheckpointError(f"{where}: its safetensors header entry {str(tname)[:80]!r} has invalid data_offsets")
        assert isinstance(v, dict)
        shape = v.get("shape")
        out[tname] = HeaderEntry(str(v.get("dtype")), tuple(shape) if isinstance(shape, list) else (), base + off[0],
                                 base + off[1])
    return out


#: A data file's data starts at a multiple of ``ALIGN`` bytes, and so does every chunk
#: whose length is one (:func:`file_order`): this machine's kernel copies page-cache
#: bytes at other offsets about 1.27x slower, both ways (benchmarks/README.md, issue 34).
ALIGN = 64


def file_order(lengths: Sequence[int]) -> list[int]:
    """The order (positions into ``lengths``, chunk byte lengths) in which a data file
    holds its chunks: those whose length is a multiple of :data:`ALIGN` first, in the
    order given, then the others, longest first (ties in the order given). Behind a
    header that ends at a multiple of :data:`ALIGN` (:func:`data_header`), every chunk
    of the first kind and the longest of the others start aligned, with no gap
    between chunks: the file stays a valid safetensors file."""
    n = np.fromiter(lengths, dtype=np.int64, count=len(lengths))  # array operations: a save may write 10,000s
    odd = n % ALIGN != 0
    if not odd.any():
        return list(range(len(n)))
    rest = np.flatnonzero(odd)
    rest = rest[np.argsort(-n[rest], kind="stable")]
    return np.concatenate([np.flatnonzero(~odd), rest]).tolist()


def json_bytes(doc: object) -> bytes:
    """``json.dumps(doc, separators=(",", ":")).encode()`` of a document of strings,
    integers, lists, tuples, dicts and msgspec records (as ``msgspec.to_builtins``
    makes them: a header's declared tensors), an index, byte for byte, made by msgspec in
    C where that gives the same bytes: msgspec writes non-ASCII characters and DEL
    (0x7f) as they are where the json module escapes them (``\\u00e9``, ``\\u007f``), and
    otherwise writes such a document identically; any other output, or a value
    msgspec refuses, is made by the json module."""
    try:
        out = _ENCODE(doc)
    except (msgspec.EncodeError, TypeError, ValueError, OverflowError):
        out = None
    if out is not None and out.isascii() and b"\x7f" not in out:
        return out
    return json.dumps(doc, separators=(",", ":"), default=msgspec.to_builtins).encode()


_ENCODE = msgspec.json.Encoder().encode


def header_bytes(tensors: Sequence[tuple[str, str, Sequence[int], int]], fmt: str = "shardpoint",
                 align: int = 8) -> bytes:
    """The first bytes of a safetensors file holding ``tensors`` (name, safetensors dtype
    code, shape, byte length) back to back in that order: the 8-byte length and the
    JSON header (``__metadata__.format`` = ``fmt``), padded with spaces (which
    safetensors allows at the header's end) so the data starts at a multiple of
    ``align`` bytes: 8, as safetensors writes it, or a data file's :data:`ALIGN`."""
    header: dict[str, object] = {"__metadata__": {"format": fmt}}
    pos = 0
    for tname, code, shape, n in tensors:
        header[tname] = {"dtype": code, "shape": list(shape), "data_offsets": [pos, pos + n]}
        pos += n
    return _header_out(header, align)


def _header_out(header: dict[str, object], align: int) -> bytes:
    """The 8-byte length and the JSON of ``header``, padded to ``align`` (:func:`header_bytes`)."""
    hb = json_bytes(header)
    hb += b" " * (-(8 + len(hb)) % align)
    return struct.pack("<Q", len(hb)) + hb


#: Each torch dtype met, with its safetensors code (None: stored as raw bytes).
_CODES: dict[torch.dtype, str | None] = {}


class _Declared(msgspec.Struct, gc=False):
    """One tensor of a data file's header, as JSON writes it (made in C: a save
    declares every chunk it writes)."""

    dtype: str
    shape: Sequence[int]
    data_offsets: tuple[int, int]


def data_header(tensors: Sequence[tuple[str, torch.dtype, Sequence[int], int]]) -> bytes:
    """The safetensors header of a data file holding ``tensors`` (name, dtype, shape,
    byte length), in order, with no gap, its data starting at a multiple of
    :data:`ALIGN` (:func:`header_bytes`; the caller puts the chunks in
    :func:`file_order`). A dtype safetensors lacks is written as raw bytes (``U8`` of
    the byte length); the manifest keeps the real dtype."""
    header: dict[str, object] = {"__metadata__": {"format": "shardpoint"}}
    pos = 0
    codes = _CODES
    for tname, dtype, shape, n in tensors:  # header_bytes' loop, the dtype's code looked up once per dtype
        code = codes.get(dtype, "")
        if code == "":
            code = codes[dtype] = DTYPES.get(dtype_name(dtype))
        header[tname] = _Declared(code, shape, (pos, pos + n)) if code else _Declared("U8", (n,), (pos, pos + n))
        pos += n
    return _header_out(header, ALIGN)
