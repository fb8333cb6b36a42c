"""A self-contained copy of one checkpoint: every chunk it stores by reference is
copied into the new data files, so the copy loads with nothing beside it."""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from typing import Any

from .errors import CorruptCheckpointError, ShardpointError
from .format.datafile import crc32
from .format.index import digest, index_name
from .format.manifest import MANIFEST_NAME, read_manifest
from .format.refs import with_refs
from .storage import Storage

#: Bytes copied per read.
_PIECE = 1 << 24


def _header(storage: Storage, name: str) -> dict[str, Any]:
    try:
        (n,) = struct.unpack("<Q", bytes(storage.read(name, 0, 8)))
        return json.loads(bytes(storage.read(name, 8, n)))
    except (OSError, ValueError, struct.error) as e:
        raise CorruptCheckpointError(f"{storage.url}/{name}: its safetensors header cannot be read ({e})") from None


def export_checkpoint(src: Storage, dst: Storage, *, overwrite: bool = False) -> None:
    """Copy the checkpoint at ``src`` to ``dst`` with every referenced chunk copied
    in, checking every byte's CRC on the way; ``dst``'s manifest is written last."""
    from .load.place import read_index

    m = read_manifest(src)
    if dst.exists(MANIFEST_NAME) and not overwrite:
        raise ShardpointError(f"a checkpoint already exists at {dst.url}; pass overwrite=True to replace it")
    reader = with_refs(src, m)
    headers: dict[str, dict[str, Any]] = {}
    files: dict[str, Any] = {}
    if not m.refs:  # self-contained already (any version): a byte copy
        for name in m.stored_files():
            dst.write_file(name, _pieces(src, name))
        dst.write_atomic(MANIFEST_NAME, bytes(src.read(MANIFEST_NAME)))
        return
    for fname, info in sorted(m.files.items()):
        idx = read_index(src, m, fname)
        order = sorted(idx.items(), key=lambda kv: (kv[1].ref or "", kv[1].offset))
        head: dict[str, Any] = {"__metadata__": {"format": "shardpoint"}}
        pos = 0
        for name, loc in order:
            where = loc.ref or fname
            if where not in headers:
                headers[where] = _header(reader, where)
            h = headers[where].get(name)
            if not isinstance(h, dict):
                raise CorruptCheckpointError(f"{src.url}: chunk {name!r} is not in the header of {where}")
            head[name] = {"dtype": h["dtype"], "shape": h["shape"], "data_offsets": [pos, pos + loc.length]}
            pos += loc.length
        hb = json.dumps(head, separators=(",", ":")).encode()
        hb += b" " * (-len(hb) % 8)
        base = 8 + len(hb)
        block = m.crc_block

        def parts(order: list[Any] = order, hb: bytes = hb, fname: str = fname, block: int = block) -> Iterator[bytes | bytearray]:
            yield struct.pack("<Q", len(hb)) + hb
            for name, loc in order:
                where = loc.ref or fname
                for j, a in enumerate(range(0, max(loc.length, 1), block)):
                    n = min(block, loc.length - a)
                    data = reader.read(where, loc.offset + a, n) if n else b""
                    if crc32(data) != loc.crc32[j]:
                        raise CorruptCheckpointError(
                            f"checksum mismatch in {where} for chunk {name!r}: the source is damaged; nothing was exported"
                        )
                    if n:
                        yield data

        dst.write_file(fname, parts())
        off = base
        chunks = {}
        for name, loc in order:
            chunks[name] = [off, loc.length, loc.crc32]
            off += loc.length
        idx_bytes = json.dumps({"format": "shardpoint-index", "file": fname, "chunks": chunks},
                               separators=(",", ":")).encode()
        iname = index_name(fname)
        dst.write_file(iname, [idx_bytes])
        files[fname] = {**info, "size": dst.size(fname),
                        "index": {"name": iname, "size": len(idx_bytes), "sha256": digest(idx_bytes)}}
    m.files, m.refs = files, {}
    m._by_rank = None
    dst.write_atomic(MANIFEST_NAME, m.to_bytes())


def _pieces(storage: Storage, name: str) -> Iterator[bytes | bytearray]:
    size = storage.size(name)
    for a in range(0, size, _PIECE):
        yield storage.read(name, a, min(_PIECE, size - a))
