"""Write: this rank's staged chunks into one data file, its index beside it.

The data file is a safetensors file streamed chunk by chunk (checksummed block by
block as the bytes go, fsynced); its index (each chunk's offset, length and block
CRCs) is written after it. With an incremental session, a chunk whose bytes an
earlier save already wrote is not written again: the index refers to it.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from ..errors import InternalError
from ..format import datafile
from ..format.datafile import WrittenChunk, crc32, data_header
from ..format.index import Located, digest, index_bytes, index_name
from ..health import FINITE, INF, NAN
from ..runtime import PROCESS
from ..storage import Storage
from .buffers import Source, cpu_bytes, pool, sources
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
    found: dict[str, int] = {}  # key -> what its chunks hold at worst (health.INF, NAN)
    if incremental is not None:  # a referenced chunk carries what the save that wrote it found
        for name, _loc, _ref in refs:
            _note(found, name, incremental.health(name))
    if not names and not refs:
        return WriteStatus(None, replica_rows=tuple(replicas), replica_digests=tuple(replicas.values()),
                           nonfinite=tuple(sorted(found)), nan=_nans(found))
    written, bad = write_data_file(storage, fname, list(zip(names, views)))
    for i, kind in bad.items():
        _note(found, names[i], kind)
    for row, w in zip(rows, written):
        if row is not None and check[row]:
            replicas[row] = replica_digest(w.crc32)
    chunks = list(zip(names, written))
    idx = index_bytes(fname, chunks, refs)
    iname = index_name(fname)
    storage.write_file(iname, [idx])
    size = storage.size(fname)
    if incremental is not None:
        incremental.wrote(fname, size, chunks, {names[i]: kind for i, kind in bad.items()})
    return WriteStatus(fname, size, IndexRecord(iname, len(idx), digest(idx)), tuple(replicas),
                       tuple(replicas.values()), (incremental.refs or None) if incremental is not None else None,
                       nonfinite=tuple(sorted(found)), nan=_nans(found))


def _note(found: dict[str, int], name: str, kind: int) -> None:
    if kind:
        key = chunk_key(name)
        found[key] = max(found.get(key, FINITE), kind)


def _nans(found: dict[str, int]) -> tuple[str, ...]:
    """The keys of ``found`` with a NaN."""
    return tuple(sorted(k for k, v in found.items() if v == NAN))


def chunk_key(name: str) -> str:
    """The state key a chunk name is about (``"/per_rank/<key>@<offsets>"`` or
    ``"<key>@<offsets>"``)."""
    return name.removeprefix("/per_rank/").rsplit("@", 1)[0]


def write_data_file(storage: Storage, name: str, chunks: Sequence[tuple[str, torch.Tensor]]
                    ) -> tuple[list[WrittenChunk], dict[int, int]]:
    """Write ``chunks`` (name, tensor) as one safetensors file, durable on return;
    return where each landed, and which of them hold an infinity or a NaN
    (:data:`~shardpoint.health.INF`, :data:`~shardpoint.health.NAN`), both by position
    in ``chunks``.

    The file holds the chunks in :func:`~shardpoint.format.datafile.file_order`
    (those whose length is a multiple of 64 bytes first, so that each starts at a
    64-byte aligned offset). The header is made first from shapes alone, then each
    chunk's bytes stream from its memory (a device tensor's through the pool's slots,
    copied in file order) with no other copy, checksummed block by block as they go;
    a floating-point chunk's pieces are checked for non-finite values in the same
    pass, while they are in cache, until the first NaN is found."""
    lengths = [t.nbytes for _, t in chunks]
    order = datafile.file_order(lengths)
    if order == list(range(len(chunks))):  # often: every chunk a multiple of 64 bytes
        views = [c[1] for c in chunks]
        return _write_in_order(storage, name, [c[0] for c in chunks], views, _sources(views), lengths)
    views = [chunks[i][1] for i in order]
    placed, bad = _write_in_order(storage, name, [chunks[i][0] for i in order], views, _sources(views),
                                  [lengths[i] for i in order])
    written = placed[:]
    for w, i in zip(placed, order):
        written[i] = w
    return written, {order[j]: kind for j, kind in bad.items()}


def _sources(views: list[torch.Tensor]) -> list[Source] | None:
    """The :func:`sources` of ``views``, or None when every one streams in place (CPU
    memory, the common case: no source object a chunk)."""
    if PROCESS.seams.force_pool or not all(v.is_cpu for v in views):
        return sources(views, pool())
    return None


def _write_in_order(storage: Storage, name: str, names: list[str], tensors: list[torch.Tensor],
                    srcs: list[Source] | None, lengths: list[int]) -> tuple[list[WrittenChunk], dict[int, int]]:
    """:func:`write_data_file` of ``tensors`` (of ``lengths`` bytes) in the order given,
    through ``srcs`` (their :func:`sources`; None: every one streams in place)."""
    health = PROCESS.seams.health_check
    bad: dict[int, int] = {}
    dtypes = [t.dtype for t in tensors]
    header = data_header(list(zip(names, dtypes, [t.shape for t in tensors], lengths)))
    crcs: list[list[int]] = []
    block = datafile.CRC_BLOCK  # read at the call: tests shrink it
    scanned = _scanned(dtypes) if health else None  # the dtypes whose values the health scan looks at

    small = _SmallScan(bad)

    def parts() -> Iterator[memoryview | bytes]:
        yield header
        for j, (t, n) in enumerate(zip(tensors, lengths)):
            dtype = dtypes[j] if scanned is not None and dtypes[j] in scanned else None
            src = srcs[j] if srcs is not None else None
            if (src is None or src.copier is None) and n <= block:  # the common case: one piece in one CRC block
                if not n:
                    crcs.append([0])
                    continue
                piece = cpu_bytes(t, n, dtypes[j])
                if len(piece) != n:  # pragma: no cover - a source that lied about its size
                    raise InternalError(f"chunk {names[j]!r}: {len(piece)} bytes streamed, {n} expected; this is a bug")
                crcs.append([crc32(piece, 0)])
                if dtype is not None:
                    if n <= _SMALL:
                        small.add(j, piece, dtype)
                    else:
                        kind = _health(piece, dtype)
                        if kind:
                            bad[j] = kind
                yield piece
                continue
            these: list[int] = []
            crc, filled, seen = 0, 0, 0
            for view in (src if src is not None else Source(t)).pieces():
                i = 0
                while i < len(view):  # pieces cut at CRC block boundaries
                    piece = view[i : i + block - filled]
                    crc = crc32(piece, crc)
                    if dtype is not None:
                        kind = _health(piece, dtype)
                        if kind:
                            bad[j] = max(bad.get(j, FINITE), kind)
                            if kind == NAN:
                                dtype = None  # the worst there is: the rest need not be looked at
                    filled += len(piece)
                    i += len(piece)
                    yield piece
                    if filled == block:
                        these.append(crc)
                        crc, filled = 0, 0
                seen += len(view)
            if seen != n:  # pragma: no cover - a source that lied about its size
                raise InternalError(f"chunk {names[j]!r}: {seen} bytes streamed, {n} expected; this is a bug")
            if filled or not these:
                these.append(crc)
            crcs.append(these)

    storage.write_file(name, parts())
    small.close()
    if bad:  # in chunk order, as found one by one
        bad = dict(sorted(bad.items()))
    out = []
    off = len(header)
    for n, c in zip(lengths, crcs):
        out.append(WrittenChunk(off, n, c))
        off += n
    return out, bad


def _scanned(dtypes: list[torch.dtype]) -> set[torch.dtype]:
    """Of ``dtypes``, the floating-point and complex ones: those the health scan looks at."""
    return {d for d in set(dtypes) if d.is_floating_point or d.is_complex}


#: Chunks of at most this many bytes are scanned for non-finite values in batches of
#: about :data:`_BATCH` bytes (one sum over many small chunks instead of one each).
_SMALL = 16 << 10
_BATCH = 1 << 20


class _SmallScan:
    """The health scan of small chunks, batched: each chunk's bytes, when they are
    checksummed and streamed, join the others of its dtype (kept by reference, joined
    in one copy when the batch is scanned: the chunks' memory stays as it is while the
    save writes it); a batch whose values are all finite (the common case) clears all
    of its chunks with one :func:`_health`, and only a batch that is not is scanned
    again chunk by chunk, so each chunk's finding is exactly its own. ``bad``: the
    findings by chunk index, filled as batches fill and by :meth:`close`."""

    __slots__ = ("_bad", "_batches")

    def __init__(self, bad: dict[int, int]) -> None:
        self._bad = bad
        #: per dtype: [bytes so far, the chunks' indexes, their pieces]
        self._batches: dict[torch.dtype, list[Any]] = {}

    def add(self, j: int, piece: memoryview, dtype: torch.dtype) -> None:
        got = self._batches.get(dtype)
        if got is None:
            got = self._batches[dtype] = [0, [], []]
        got[1].append(j)
        got[2].append(piece)
        got[0] += len(piece)
        if got[0] >= _BATCH:
            self._scan(dtype)

    def close(self) -> None:
        """Scan what is left in every batch."""
        for dtype in list(self._batches):
            self._scan(dtype)

    def _scan(self, dtype: torch.dtype) -> None:
        _, members, pieces = self._batches.pop(dtype)
        view = memoryview(bytearray().join(pieces))  # writable: torch.frombuffer warns on a read-only buffer
        if _health(view, dtype) == FINITE:
            return
        a = 0
        for j, piece in zip(members, pieces):
            b = a + len(piece)
            kind = _health(view[a:b], dtype)
            if kind:
                self._bad[j] = kind
            a = b


def _health(piece: memoryview, dtype: torch.dtype) -> int:
    """What the values in ``piece`` (whole elements of ``dtype``) hold:
    :data:`~shardpoint.health.FINITE`, ``INF`` (an infinity, no NaN) or ``NAN``.

    A sum is one fast vectorised pass, and a NaN or an infinity anywhere makes it
    non-finite (IEEE arithmetic propagates them in any order); so a finite sum proves
    the piece finite. Only a non-finite sum, which finite values can also give by
    overflowing, is looked at again: summed in float64, then element by element
    (``torch.isfinite`` is some 30 times slower than the sum). A dtype torch cannot sum
    on the CPU (some float8 kinds) counts as finite."""
    if not len(piece):
        return FINITE
    try:
        t = torch.frombuffer(piece, dtype=dtype)
        if t.is_complex():
            t = torch.view_as_real(t)
        if math.isfinite(float(t.sum())) or math.isfinite(float(t.sum(dtype=torch.float64))):
            return FINITE
        if bool(torch.isnan(t).any()):
            return NAN
        return FINITE if bool(torch.isfinite(t).all()) else INF
    except (RuntimeError, TypeError, ValueError):  # no kernel for this dtype, or a torn element
        return FINITE


def _host(v: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU view of a chunk, for the incremental comparison (a copy only for
    device or strided tensors)."""
    v = v.detach()
    return v if v.device.type == "cpu" and v.is_contiguous() else v.to("cpu").contiguous()
