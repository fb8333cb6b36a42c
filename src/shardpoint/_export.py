"""A self-contained copy of one checkpoint: every chunk it stores by reference is
copied into the new data files, so the copy loads with nothing beside it. Reads
through the load's stages (locate, verified reads) and writes through storage."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator

from .errors import CorruptCheckpointError, ShardpointError, StorageError
from .format.chunks import ChunkLoc
from .format.datafile import ALIGN, HeaderEntry, file_order, header_bytes, header_length, parse_header
from .format.index import Located, digest, index_name
from .format.manifest import FORMAT_VERSION, MANIFEST_NAME
from .format.model import DataFile, IndexFile
from .load.locate import read_index, read_manifest, with_refs
from .load.read import read_verified
from .saving.commit import commit_checkpoint, exists_error
from .storage import Storage

#: Bytes copied per read.
_PIECE = 1 << 24


def _header(storage: Storage, name: str) -> dict[str, HeaderEntry]:
    where = f"{storage.url}/{name}"
    try:
        size = storage.size(name)
        n = header_length(bytes(storage.read(name, 0, min(8, size))), size, where)
        return parse_header(bytes(storage.read(name, 8, n)), size, where)
    except OSError as e:
        raise CorruptCheckpointError(f"{where}: its safetensors header cannot be read ({e})") from None


def export_checkpoint(src: Storage, dst: Storage, *, overwrite: bool = False,
                      advance: Callable[[int], None] | None = None) -> None:
    """Copy the checkpoint at ``src`` to ``dst`` with every referenced chunk copied
    in, checking every byte's CRC on the way; ``dst``'s manifest is written last, so
    a failed export leaves no checkpoint at ``dst``. ``advance`` is called with the
    size of each piece copied (a progress bar)."""
    try:
        _export(src, dst, overwrite, advance or (lambda n: None))
    except ShardpointError:  # named already (some are OSErrors too: a checkpoint in the way)
        raise
    except OSError as e:  # the destination (a full disk, no permission): the source's damage is named otherwise
        raise StorageError(
            f"exporting {src.url} to {dst.url} failed: {e}. Nothing was committed at {dst.url} (its manifest is written "
            "last); free space or fix the destination's permissions, then export again"
        ) from None


def _export(src: Storage, dst: Storage, overwrite: bool, advance: Callable[[int], None]) -> None:
    m = read_manifest(src)
    if not overwrite and dst.exists(MANIFEST_NAME):  # before anything is copied
        raise exists_error(dst)
    if not m.refs:  # self-contained already (any version): a byte copy
        for name in m.stored_files():
            dst.write_file(name, _counted(_pieces(src, name), advance))
        commit_checkpoint(dst, m, replace=overwrite, data=bytes(src.read(MANIFEST_NAME)), what="the export")
        return
    reader = with_refs(src, m)
    headers: dict[str, dict[str, HeaderEntry]] = {}
    files: dict[str, DataFile] = {}
    for fname, info in sorted(m.files.items()):
        idx = read_index(src, m, fname)
        order = sorted(idx.items(), key=lambda kv: (kv[1].ref or "", kv[1].offset))
        order = [order[i] for i in file_order([loc.length for _, loc in order])]  # aligned, as a save writes it
        declared: list[tuple[str, str, tuple[int, ...], int]] = []
        for name, loc in order:
            where = loc.ref or fname
            if where not in headers:
                headers[where] = _header(reader, where)
            h = headers[where].get(name)
            if h is None:
                raise CorruptCheckpointError(f"{src.url}: chunk {name!r} is not in the header of {where}")
            declared.append((name, h.dtype, h.shape, loc.length))
        head = header_bytes(declared, align=ALIGN)
        dst.write_file(fname, _counted(_copied(reader, fname, order, m.crc_block, head), advance))
        off = len(head)
        chunks = {}
        for name, loc in order:
            chunks[name] = [off, loc.length, loc.crc32]
            off += loc.length
        idx_bytes = json.dumps({"format": "shardpoint-index", "file": fname, "chunks": chunks},
                               separators=(",", ":")).encode()
        iname = index_name(fname)
        dst.write_file(iname, [idx_bytes])
        files[fname] = DataFile(dst.size(fname), info.rank, IndexFile.of(iname, len(idx_bytes), digest(idx_bytes)))
    m.files, m.refs, m.version = files, {}, FORMAT_VERSION  # its indexes' digests are this version's
    m._by_rank = None
    commit_checkpoint(dst, m, replace=overwrite, what="the export")


def _copied(reader: Storage, fname: str, order: list[tuple[str, Located]], block: int, head: bytes,
            ) -> Iterator[bytes | memoryview]:
    """The new data file's bytes: its header, then each chunk's bytes, verified."""
    yield head
    for name, loc in order:
        where = loc.ref or fname
        try:
            for piece in read_verified(reader, ChunkLoc(where, loc.offset, loc.length, loc.crc32), block):
                yield memoryview(piece)
        except CorruptCheckpointError as e:
            raise CorruptCheckpointError(f"{e} (chunk {name!r}); the source is damaged: nothing was exported") from None


def _counted(pieces: Iterator[bytes | memoryview], advance: Callable[[int], None]) -> Iterator[bytes | memoryview]:
    for p in pieces:
        advance(len(p))
        yield p


def _pieces(storage: Storage, name: str) -> Iterator[bytes | memoryview]:
    size = storage.size(name)
    for a in range(0, size, _PIECE):
        yield memoryview(storage.read(name, a, min(_PIECE, size - a)))
