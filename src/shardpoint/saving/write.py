"""Write: this rank's staged chunks into one data file, its index beside it.

The data file is a safetensors file streamed chunk by chunk (checksummed block by
block as the bytes go, fsynced); its index (each chunk's offset, length and block
CRCs) is written after it. With an incremental session, a chunk whose bytes an
earlier save already wrote is not written again: the index refers to it.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from ..errors import ShardpointError
from ..format import datafile
from ..format.datafile import WrittenChunk, crc32, data_header
from ..format.index import Located, digest, index_bytes, index_name
from ..runtime import PROCESS
from ..storage import Storage
from .buffers import Source, pool, sources
from .coordinator import replica_digest
from .incremental import Session
from .records import IndexRecord, Staged, WriteStatus


def write(storage: Storage, fname: str, staged: Staged, incremental: Session | None) -> WriteStatus:
    """Write ``staged`` to ``fname`` (with its index); return the file's size, the
    index's record and the checksum digests of the replica rows: those another rank
    writes (checksummed when staged) and those this rank writes."""
    check = staged.check
    replicas: dict[int, int] = {i: replica_digest(c) for i, c in staged.checked.items()}
    rows, names, views = staged.rows, staged.names, staged.views
    refs: list[tuple[str, Located, str]] = []
    if incremental is not None:
        kept = []
        for row, name, v in zip(rows, names, views):
            loc = incremental.decide(name, v, _host(v))
            if loc is None:
                kept.append((row, name, v))
                continue
            assert loc.ref is not None
            refs.append((name, loc, loc.ref))
            if row is not None and check[row]:
                replicas[row] = replica_digest(loc.crc32)
        rows, names, views = [k[0] for k in kept], [k[1] for k in kept], [k[2] for k in kept]
    nonfinite = {chunk_key(name) for name, loc, _ in refs if incremental is not None and incremental.nonfinite(name)}
    if not names and not refs:
        return WriteStatus(None, replica_rows=tuple(replicas), replica_digests=tuple(replicas.values()),
                           nonfinite=tuple(sorted(nonfinite)))
    written, bad = write_data_file(storage, fname, list(zip(names, sources(views, pool()))))
    nonfinite.update(chunk_key(names[i]) for i in bad)
    for row, w in zip(rows, written):
        if row is not None and check[row]:
            replicas[row] = replica_digest(w.crc32)
    chunks = list(zip(names, written))
    idx = index_bytes(fname, chunks, refs)
    iname = index_name(fname)
    storage.write_file(iname, [idx])
    size = storage.size(fname)
    if incremental is not None:
        incremental.wrote(fname, size, chunks, {names[i] for i in bad})
    return WriteStatus(fname, size, IndexRecord(iname, len(idx), digest(idx)), tuple(replicas),
                       tuple(replicas.values()), (incremental.refs or None) if incremental is not None else None,
                       tuple(sorted(nonfinite)))


def chunk_key(name: str) -> str:
    """The state key a chunk name is about (``"/per_rank/<key>@<offsets>"`` or
    ``"<key>@<offsets>"``)."""
    return name.removeprefix("/per_rank/").rsplit("@", 1)[0]


def write_data_file(storage: Storage, name: str, chunks: Sequence[tuple[str, Source]]
                    ) -> tuple[list[WrittenChunk], list[int]]:
    """Write ``chunks`` (name, source) as one safetensors file, durable on return;
    return where each landed, and which of them (by position) hold a NaN or an
    infinity.

    The header is made first from shapes alone, then each chunk's bytes stream from
    its source's pieces (its own memory, or the pool's slots) with no other copy,
    checksummed block by block as they go; a floating-point chunk's pieces are
    checked for non-finite values in the same pass, while they are in cache, until
    the first one is found."""
    lengths = [src.numel() * src.element_size() for _, src in chunks]
    health = PROCESS.seams.health_check
    bad: list[int] = []
    header = data_header([(n, src.dtype, tuple(src.shape), length) for (n, src), length in zip(chunks, lengths)])
    crcs: list[list[int]] = []
    block = datafile.CRC_BLOCK  # read at the call: tests shrink it

    def parts() -> Iterator[memoryview | bytes]:
        yield header
        for j, ((cname, src), n) in enumerate(zip(chunks, lengths)):
            these: list[int] = []
            crc, filled, seen = 0, 0, 0
            dtype = src.dtype if health and (src.dtype.is_floating_point or src.dtype.is_complex) else None
            for view in src.pieces():
                i = 0
                while i < len(view):  # pieces cut at CRC block boundaries
                    piece = view[i : i + block - filled]
                    crc = crc32(piece, crc)
                    if dtype is not None and not _finite(piece, dtype):
                        bad.append(j)
                        dtype = None  # one is enough
                    filled += len(piece)
                    i += len(piece)
                    yield piece
                    if filled == block:
                        these.append(crc)
                        crc, filled = 0, 0
                seen += len(view)
            if seen != n:  # pragma: no cover - a source that lied about its size
                raise ShardpointError(f"chunk {cname!r}: {seen} bytes streamed, {n} expected; this is a bug")
            if filled or not these:
                these.append(crc)
            crcs.append(these)

    storage.write_file(name, parts())
    out = []
    off = len(header)
    for n, c in zip(lengths, crcs):
        out.append(WrittenChunk(off, n, c))
        off += n
    return out, bad


def _finite(piece: memoryview, dtype: torch.dtype) -> bool:
    """Whether the values in ``piece`` (whole elements of ``dtype``) are all finite.
    A dtype torch cannot test on the CPU (some float8 kinds) counts as finite."""
    if not len(piece):
        return True
    try:
        return bool(torch.isfinite(torch.frombuffer(piece, dtype=dtype)).all())
    except (RuntimeError, TypeError, ValueError):  # no isfinite kernel for this dtype, or a torn element
        return True


def _host(v: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU view of a chunk, for the incremental comparison (a copy only for
    device or strided tensors)."""
    v = v.detach()
    return v if v.device.type == "cpu" and v.is_contiguous() else v.to("cpu").contiguous()
