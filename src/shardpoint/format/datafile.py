"""Data files: valid safetensors files written in one streaming pass, with a
CRC-32 per block computed while the bytes are in cache."""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..errors import CorruptCheckpointError

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


def data_header(tensors: Sequence[tuple[str, torch.dtype, Sequence[int], int]]) -> bytes:
    """The safetensors header of a data file holding ``tensors`` (name, dtype, shape,
    byte length), in order, with no gap: its 8-byte length and its JSON, padded to a
    multiple of 8. A dtype safetensors lacks is written as raw bytes (``U8`` of the
    byte length); the manifest keeps the real dtype."""
    header: dict[str, object] = {"__metadata__": {"format": "shardpoint"}}
    pos = 0
    for tname, dtype, shape, n in tensors:
        code = DTYPES.get(dtype_name(dtype))
        header[tname] = {"dtype": code or "U8", "shape": list(shape) if code else [n], "data_offsets": [pos, pos + n]}
        pos += n
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * (-len(hb) % 8)
    return struct.pack("<Q", len(hb)) + hb
