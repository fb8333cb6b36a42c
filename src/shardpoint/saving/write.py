"""Write: this rank's staged chunks into one data file, its index beside it.

The data file is a safetensors file streamed chunk by chunk (checksummed block by
block as the bytes go, fsynced); its index (each chunk's offset, length and block
CRCs) is written after it. With an incremental session, a chunk whose bytes an
earlier save already wrote is not written again: the index refers to it.
"""

from __future__ import annotations

import torch

from ..format.datafile import write_data_file
from ..format.index import Located, digest, index_bytes, index_name
from ..storage import Storage
from .buffers import pool, sources
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
    if not names and not refs:
        return WriteStatus(None, replica_rows=tuple(replicas), replica_digests=tuple(replicas.values()))
    written = write_data_file(storage, fname, list(zip(names, sources(views, pool()))))
    for row, w in zip(rows, written):
        if row is not None and check[row]:
            replicas[row] = replica_digest(w.crc32)
    chunks = list(zip(names, written))
    idx = index_bytes(fname, chunks, refs)
    iname = index_name(fname)
    storage.write_file(iname, [idx])
    size = storage.size(fname)
    if incremental is not None:
        incremental.wrote(fname, size, chunks)
    return WriteStatus(fname, size, IndexRecord(iname, len(idx), digest(idx)), tuple(replicas),
                       tuple(replicas.values()), (incremental.refs or None) if incremental is not None else None)


def _host(v: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU view of a chunk, for the incremental comparison (a copy only for
    device or strided tensors)."""
    v = v.detach()
    return v if v.device.type == "cpu" and v.is_contiguous() else v.to("cpu").contiguous()
