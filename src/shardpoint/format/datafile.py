"""Data files: valid safetensors files written in one streaming pass, with a
CRC-32 per block computed while the bytes are in cache."""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import CorruptCheckpointError
from ..storage.base import Storage

try:  # the same CRC-32 as zlib's, about 5x faster (carry-less multiply): checksums stop costing a save its throughput
    from zlib_ng.zlib_ng import crc32
except ImportError:  # pragma: no cover - zlib-ng is a dependency; fall back where its wheel is missing
    from zlib import crc32

#: Bytes covered by one CRC-32 in the manifest; partial reads are rounded out to it.
CRC_BLOCK = int(os.environ.get("SHARDPOINT_CRC_BLOCK", 1 << 20))

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


def dtype_from_name(name: str, key: str | None = None) -> torch.dtype:
    """The torch dtype for a manifest dtype name. Raises
    :class:`~shardpoint.CorruptCheckpointError` naming ``key`` (where the caller knows
    it) for a name shardpoint does not know or this torch does not have."""
    dtype = getattr(torch, name, None) if isinstance(name, str) and name in DTYPES else None
    if not isinstance(dtype, torch.dtype):
        where = f"key {key!r}" if key is not None else "a tensor of the checkpoint"
        why = f"this torch {torch.__version__} lacks" if name in DTYPES else "shardpoint does not know"
        raise CorruptCheckpointError(
            f"{where} has dtype {name!r}, which {why} (known: {', '.join(sorted(DTYPES))}); the manifest is "
            "damaged or was written by a newer version: upgrade torch and shardpoint, or leave the key out with exclude="
        )
    return dtype


def itemsize_of(name: str) -> int:
    """Bytes per element of the dtype a manifest names; raises ``ValueError`` if unknown."""
    size = _ITEMSIZE.get(name)
    if size is None:
        size = _ITEMSIZE[name] = torch.empty(0, dtype=dtype_from_name(name)).element_size()
    return size


_ITEMSIZE: dict[str, int] = {}


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """A byte view of a contiguous CPU tensor, without a copy."""
    if t.numel() == 0:
        return memoryview(b"")
    flat = t.reshape(-1)
    if flat.dtype != torch.uint8:
        flat = flat.view(torch.uint8)
    return memoryview(flat.numpy()).cast("B")


@dataclass(slots=True)
class WrittenChunk:
    """Where a chunk landed: absolute byte offset in its file, length, block CRCs."""

    offset: int
    length: int
    crc32: list[int]


def block_crcs(view: memoryview, block: int = CRC_BLOCK) -> list[int]:
    """CRC-32 of each ``block``-byte piece of ``view`` (at least one entry)."""
    if len(view) == 0:
        return [0]
    return [crc32(view[i : i + block]) for i in range(0, len(view), block)]


def write_data_file(storage: Storage, name: str, tensors: Sequence[tuple[str, Any]]) -> list[WrittenChunk]:
    """Write ``tensors`` (name, contiguous CPU tensor or a source with ``dtype``,
    ``shape``, ``numel()``, ``element_size()`` and ``pieces()``, the bytes in order) as
    one safetensors file.

    The header is computed first from shapes alone, then each tensor's bytes are
    streamed straight from its memory (or its source's pieces) with no intermediate
    copy, checksummed block by block as they go. The file is durable when this returns.
    """
    header: dict[str, object] = {"__metadata__": {"format": "shardpoint"}}
    pos = 0
    lengths = []
    for tname, t in tensors:
        n = t.numel() * t.element_size()
        code = DTYPES.get(dtype_name(t.dtype))
        shape = list(t.shape) if code else [n]
        header[tname] = {"dtype": code or "U8", "shape": shape, "data_offsets": [pos, pos + n]}
        lengths.append(n)
        pos += n
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * (-len(hb) % 8)
    base = 8 + len(hb)
    crcs: list[list[int]] = []

    def parts() -> Iterator[memoryview | bytes]:
        yield struct.pack("<Q", len(hb)) + hb
        for (tname, t), n in zip(tensors, lengths):
            these: list[int] = []
            crc, filled, seen = 0, 0, 0
            for view in (t.pieces() if hasattr(t, "pieces") else (tensor_bytes(t),)):
                i = 0
                while i < len(view):  # pieces cut at CRC block boundaries
                    piece = view[i : i + CRC_BLOCK - filled]
                    crc = crc32(piece, crc)
                    filled += len(piece)
                    i += len(piece)
                    yield piece
                    if filled == CRC_BLOCK:
                        these.append(crc)
                        crc, filled = 0, 0
                seen += len(view)
            if seen != n:  # pragma: no cover - a source that lied about its size
                raise ValueError(f"{tname}: {seen} bytes streamed, {n} expected")
            if filled or not these:
                these.append(crc)
            crcs.append(these)

    storage.write_file(name, parts())
    out = []
    off = base
    for n, c in zip(lengths, crcs):
        out.append(WrittenChunk(off, n, c))
        off += n
    return out
