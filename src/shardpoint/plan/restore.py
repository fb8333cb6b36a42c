"""Restore planning: which byte ranges each rank of a new world reads, and from whom.

A snapshot of the memory tier lies spread over hosts: each host holds its own ranks'
data files and the replicas it keeps for other hosts (whole files), and may hold byte
ranges of others (fetched by an earlier restore). A restore on a new world (any number
of hosts, any ranks per host) needs on each new rank only the bytes of the boxes that
rank loads. Planned here, with no I/O:

1. :func:`needed_ranges`: each new rank's target boxes (as a load computes them;
   FSDP-style ``Shard(0)`` boxes by :func:`shard0_targets`) intersected with the saved
   chunks, as byte ranges of data files: exactly the bytes of its shards;
2. :func:`choose_sources`: where each range is read from: the reader's own host when
   it holds it, else a peer host holding it (a whole file, or a range covering it),
   the holders of a file sharing its readers so that no host is a hot spot, else the
   durable root.

Arrays, one row per range, not an object per range: at 1,024 hosts x 8 ranks and
2,000 sharded tensors a plan has millions of rows (benchmarks/restore_plan_bench.py).
The records one rank needs come out typed (:meth:`RestorePlan.reads_of`).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from ..format.boxes import Box
from .read import plan_reads
from .save import PlanError
from .table import row_prod

#: The source "host" of a range read from the durable root.
DURABLE = -1

__all__ = [
    "DURABLE",
    "HeldRange",
    "Inventory",
    "NewWorld",
    "Needs",
    "PlacedChunk",
    "RangeRead",
    "RestorePlan",
    "SnapshotLayout",
    "Targets",
    "Tier",
    "choose_sources",
    "needed_ranges",
    "plan_restore",
    "shard0_targets",
]


# -- inputs ---------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class PlacedChunk:
    """One saved chunk and where its bytes lie: ``box`` of tensor ``tensor``, at byte
    ``offset`` (absolute) of data file ``file`` (an index into the snapshot's files)."""

    tensor: int
    file: int
    offset: int
    box: Box


@dataclass(frozen=True, slots=True, eq=False)
class SnapshotLayout:
    """Where every chunk of a snapshot lies, one row per chunk. Boxes are padded to
    ``D`` dimensions as the save planner pads them (offset 0, size 1), shapes too."""

    shape: np.ndarray  # int64 (T, D): each tensor's global shape, padded with 1
    itemsize: np.ndarray  # int64 (T,): bytes per element
    tensor: np.ndarray  # int32 (n,): the chunk's tensor
    file: np.ndarray  # int32 (n,): the data file holding it (index into ``file_size``)
    offset: np.ndarray  # int64 (n,): absolute byte offset of its first byte there
    box_offsets: np.ndarray  # int64 (n, D)
    box_sizes: np.ndarray  # int64 (n, D)
    file_size: np.ndarray  # int64 (F,): each data file's size
    block: int = 1 << 20
    """Checksum block size (docs/format.md, section 6): a reader that verifies reads whole blocks."""

    @staticmethod
    def of(shapes: Sequence[tuple[int, ...]], itemsizes: Sequence[int], chunks: Sequence[PlacedChunk],
           file_sizes: Sequence[int], block: int = 1 << 20) -> SnapshotLayout:
        """From typed records (a parsed manifest and its indexes; small tests)."""
        d = max([1, *(len(s) for s in shapes)])
        shape = np.ones((len(shapes), d), dtype=np.int64)
        for t, s in enumerate(shapes):
            shape[t, : len(s)] = s
        offs = np.zeros((len(chunks), d), dtype=np.int64)
        sizes = np.ones((len(chunks), d), dtype=np.int64)
        for i, c in enumerate(chunks):
            offs[i, : len(c.box.offsets)] = c.box.offsets
            sizes[i, : len(c.box.sizes)] = c.box.sizes
        return SnapshotLayout(shape, np.asarray(itemsizes, dtype=np.int64),
                              np.array([c.tensor for c in chunks], dtype=np.int32),
                              np.array([c.file for c in chunks], dtype=np.int32),
                              np.array([c.offset for c in chunks], dtype=np.int64), offs, sizes,
                              np.asarray(file_sizes, dtype=np.int64), block)

    @property
    def length(self) -> np.ndarray:
        """Each chunk's bytes."""
        return row_prod(self.box_sizes) * self.itemsize[self.tensor]


@dataclass(frozen=True, slots=True, eq=False)
class Targets:
    """The boxes each new rank loads, one row per (tensor, rank) box, padded as the
    layout's (same ``D``)."""

    tensor: np.ndarray  # int32 (m,)
    rank: np.ndarray  # int32 (m,)
    offsets: np.ndarray  # int64 (m, D)
    sizes: np.ndarray  # int64 (m, D)


def shard0_targets(shape: np.ndarray, world: int) -> Targets:
    """Each rank's box of every tensor sharded ``Shard(0)`` over ``world`` ranks (FSDP2's
    layout), as DTensor cuts it (``torch.chunk``: ``ceil(rows / world)`` rows a rank, the
    last ranks short or empty). ``shape``: (T, D) padded shapes; empty boxes are left
    out. Rows are by tensor, then rank."""
    rows = shape[:, 0]
    full = np.maximum(1, -(-rows // world))
    held = -(-rows // full)  # ranks with rows
    held[row_prod(shape[:, 1:]) == 0] = 0  # a tensor with no elements: no box
    m = int(held.sum())
    tensor = np.repeat(np.arange(len(shape), dtype=np.int32), held)
    rank = np.arange(m, dtype=np.int32 if m < 1 << 31 else np.int64)
    rank -= np.repeat((np.cumsum(held) - held).astype(rank.dtype), held)
    step = np.repeat(full, held)
    # column-major: each column one contiguous run, the offsets' zero columns never touched
    offsets = np.zeros((m, shape.shape[1]), dtype=np.int64, order="F")
    np.multiply(rank, step, out=offsets[:, 0])
    sizes = np.empty((m, shape.shape[1]), dtype=np.int64, order="F")
    for d in range(1, shape.shape[1]):
        sizes[:, d] = np.repeat(shape[:, d], held)
    np.subtract(np.repeat(rows, held), offsets[:, 0], out=sizes[:, 0])
    np.minimum(step, sizes[:, 0], out=sizes[:, 0])
    return Targets(tensor, rank.astype(np.int32, copy=False), offsets, sizes)


@dataclass(frozen=True, slots=True)
class HeldRange:
    """Bytes ``[start, stop)`` of data file ``file`` that a host holds (fetched by an
    earlier restore: not the whole file)."""

    file: int
    start: int
    stop: int


@dataclass(frozen=True, slots=True)
class Inventory:
    """What one host holds of a snapshot: whole data files (its ranks' own, the
    replicas it keeps for others; counted only at their full size) and byte ranges."""

    host: int
    files: frozenset[int]
    ranges: tuple[HeldRange, ...] = ()


@dataclass(frozen=True, slots=True, eq=False)
class NewWorld:
    """The world a snapshot is restored on: ``host[r]`` is the host new rank ``r`` runs
    on (host ids are those of the inventories; a host with no inventory holds nothing,
    as a replacement host)."""

    host: np.ndarray  # int32 (ranks,)

    @staticmethod
    def even(hosts: Sequence[int], per_host: int) -> NewWorld:
        """``per_host`` ranks on each host of ``hosts``, host-major (the launcher's order)."""
        return NewWorld(np.repeat(np.asarray(hosts, dtype=np.int32), per_host))

    def __len__(self) -> int:
        return int(self.host.shape[0])


# -- step 1: what each rank needs -----------------------------------------------------

@dataclass(frozen=True, slots=True, eq=False)
class Needs:
    """Byte ranges each new rank reads, exactly the bytes of its target boxes: one row
    per (target box, saved chunk) intersection. A region that is not one contiguous
    range of its chunk (a box cut on an inner dimension) is its span, as a load reads it."""

    rank: np.ndarray  # int32 (k,)
    chunk: np.ndarray  # int64 (k,): row of the layout
    start: np.ndarray  # int64 (k,): absolute byte offset in the chunk's file
    stop: np.ndarray  # int64 (k,)

    def __len__(self) -> int:
        return int(self.rank.shape[0])


def _scan(tensor: np.ndarray, sizes: np.ndarray, rowel: np.ndarray, n_tensors: int) -> tuple[np.ndarray, np.ndarray]:
    """Which boxes hold elements, and per tensor how many of those are not row slabs:
    spanning every dimension but the first in full, one byte range of any slab chunk
    that holds them (a box inside its tensor spans them all exactly when its elements
    are its rows times a row's). In batches, so that no temporary is as long as the table."""
    n = len(tensor)
    keep = np.empty(n, dtype=bool)
    bad = np.zeros(n_tensors, dtype=np.int64)
    for a in range(0, n, _BATCH):
        b = min(n, a + _BATCH)
        box = sizes[a:b]
        numel = row_prod(box)
        np.greater(numel, 0, out=keep[a:b])
        if box.shape[1] > 1:
            off = numel != box[:, 0] * np.take(rowel, tensor[a:b])
            off &= keep[a:b]
            if bool(off.any()):
                bad += np.bincount(tensor[a:b][off], minlength=n_tensors)
    return keep, bad


def needed_ranges(layout: SnapshotLayout, targets: Targets) -> Needs:
    """Intersect every target box with the saved chunks of its tensor: the byte ranges
    each rank reads. Tensors whose chunks and targets are all row slabs (any
    ``Shard(0)`` over ``Shard(0)``) are intersected together as intervals of one row
    axis (vectorised); the others tensor by tensor (:func:`~.read.plan_reads`).

    Raises :class:`PlanError` when a target is not covered by the saved chunks."""
    shp = layout.shape
    rowel = row_prod(shp[:, 1:])
    c_keep, bad = _scan(layout.tensor, layout.box_sizes, rowel, len(shp))
    t_keep, t_bad = _scan(targets.tensor, targets.sizes, rowel, len(shp))
    bad += t_bad
    slab = bad == 0
    if slab.all():
        c_sel, t_sel = c_keep, t_keep
    else:
        c_sel, t_sel = c_keep & np.take(slab, layout.tensor), t_keep & np.take(slab, targets.tensor)
    parts = [_slab_ranges(layout, targets, None if c_sel.all() else np.nonzero(c_sel)[0],
                          None if t_sel.all() else np.nonzero(t_sel)[0])]
    for t in np.nonzero(~slab)[0]:
        parts.append(_box_ranges(layout, targets, int(t), np.nonzero(c_keep & (layout.tensor == t))[0],
                                 np.nonzero(t_keep & (targets.tensor == t))[0]))
    if len(parts) == 1:
        return parts[0]
    return Needs(*(np.concatenate([getattr(p, f) for p in parts]) for f in ("rank", "chunk", "start", "stop")))


def _take(a: np.ndarray, rows: np.ndarray | None) -> np.ndarray:
    return a if rows is None else a[rows]


def _slab_ranges(layout: SnapshotLayout, targets: Targets, chunks: np.ndarray | None,
                 tgts: np.ndarray | None) -> Needs:
    """Row slabs (``chunks``/``tgts``: rows of the layout and targets, None for all):
    every tensor laid end to end on one row axis, its chunks sorted intervals tiling its
    rows (checked), each target found among them by binary search. Target ``q`` covers
    chunks ``i0 .. i0 + count - 1``; its pieces start at its own start, then at each
    next chunk's start, and each ends where the next begins (the last at the target's
    end). A byte of global row ``x`` in chunk ``c`` is at ``x * rowbytes + delta[c]``.

    Chunks and targets already in tensor order (as a save and :func:`shard0_targets`
    make them) are planned in batches of whole tensors (:func:`_sorted_slab_ranges`);
    others sorted first, in one piece."""
    shp = layout.shape
    base = np.zeros(len(shp) + 1, dtype=np.int64)
    np.cumsum(shp[:, 0], out=base[1:])
    ct = _take(layout.tensor, chunks)
    fast = _sorted_slab_ranges(layout, targets, chunks, tgts, base, ct)
    if fast is not None:
        return fast
    c0, c1 = _take(layout.box_offsets[:, 0], chunks), _take(layout.box_sizes[:, 0], chunks)
    gs = base[ct] + c0
    if len(gs) > 1 and not bool(np.all(gs[1:] > gs[:-1])):
        order = np.argsort(gs, kind="stable")
        chunks = order if chunks is None else chunks[order]
        ct, c0, c1, gs = ct[order], c0[order], c1[order], gs[order]
    _check_tiling(shp, ct, c0, c1, gs)
    del c0
    rowbytes = row_prod(shp[:, 1:]) * layout.itemsize
    delta = _take(layout.offset, chunks) - gs * rowbytes[ct]
    del ct
    tt = _take(targets.tensor, tgts)
    t0 = _take(targets.offsets[:, 0], tgts)
    t1 = _take(targets.sizes[:, 0], tgts)
    if len(tt) and bool(np.any(t0 + t1 > shp[tt, 0])):
        raise PlanError({int(tt[np.argmax(t0 + t1 > shp[tt, 0])]): "a target box lies outside its tensor"})
    tc = base[tt] + t0
    td = tc + t1
    del t0, t1
    trb = rowbytes[tt]
    i0 = np.searchsorted(gs, tc, "right") - 1
    count = _ends(gs, tc, td, i0) - i0
    ge = gs + c1
    del c1
    if len(tc):  # its first row in a chunk (of its tensor: tensors' rows are disjoint): all of it, chunks tile
        lost = (i0 < 0) | (tc >= ge[i0])
        if bool(lost.any()):
            raise PlanError({int(tt[np.argmax(lost)]): "a target box is not covered by the saved chunks"})
    del tt
    m, k = len(tc), int(count.sum())
    rank = np.empty(k, dtype=np.int32)
    ci = np.empty(k, dtype=np.intp)
    start = np.empty(k, dtype=np.int64)
    stop = np.empty(k, dtype=np.int64)
    trank = _take(targets.rank, tgts)
    # each target's first piece: from its start to its end or its first chunk's, whichever is first
    rank[:m], ci[:m] = trank, i0
    _bytes(tc, np.minimum(td, ge[i0]), trb, delta[i0], start[:m], stop[:m])
    if k > m:  # the targets over several chunks: their later pieces, from each chunk's start
        multi = np.nonzero(count > 1)[0]
        extra = count[multi] - 1
        rep = np.repeat(multi, extra)
        c = np.repeat(i0[multi] - (np.cumsum(extra) - extra) + 1, extra)
        c += np.arange(k - m)
        rank[m:], ci[m:] = trank[rep], c
        _bytes(gs[c], np.minimum(td[rep], ge[c]), trb[rep], delta[c], start[m:], stop[m:])
    return Needs(rank, ci if chunks is None else chunks[ci], start, stop)


#: Rows of chunks and targets planned together by :func:`_sorted_slab_ranges`: a batch's
#: temporaries stay in the CPU's cache and their memory is reused by the next batch
#: (at 12 million rows, first touching fresh memory costs more than the work).
_BATCH = 1 << 18


def _nondecreasing(a: np.ndarray) -> bool:
    return len(a) < 2 or bool(np.all(a[1:] >= a[:-1]))


@dataclass(frozen=True, slots=True, eq=False)
class _Slabs:
    """The row-slab chunks and targets :func:`_slab_ranges` plans (already selected):
    each chunk's tensor, first row, rows and byte offset; each target's tensor, first
    row, rows and rank; where each tensor's rows start on the one row axis
    (``base``), and each tensor's bytes per row."""

    ct: np.ndarray
    c0: np.ndarray
    c1: np.ndarray
    offset: np.ndarray
    tt: np.ndarray
    t0: np.ndarray
    t1: np.ndarray
    trank: np.ndarray
    base: np.ndarray
    rowbytes: np.ndarray


def _sorted_slab_ranges(layout: SnapshotLayout, targets: Targets, chunks: np.ndarray | None,
                        tgts: np.ndarray | None, base: np.ndarray, ct: np.ndarray) -> Needs | None:
    """:func:`_slab_ranges` in batches of whole tensors, when the chunks' global rows
    and the targets' tensors are already in order (None when not: the caller sorts).
    The same rows in the same order, the same errors: every batch is checked before
    any is planned, and the first failure of each kind raised in the order
    :func:`_check_tiling` and the target check raise them."""
    shp = layout.shape
    tt = _take(targets.tensor, tgts)
    if not (_nondecreasing(ct) and _nondecreasing(tt)):
        return None
    s = _Slabs(ct, _take(layout.box_offsets[:, 0], chunks), _take(layout.box_sizes[:, 0], chunks),
               _take(layout.offset, chunks), tt, _take(targets.offsets[:, 0], tgts), _take(targets.sizes[:, 0], tgts),
               _take(targets.rank, tgts), base, row_prod(shp[:, 1:]) * layout.itemsize)
    tensors = np.arange(len(shp) + 1, dtype=ct.dtype if len(ct) else np.int64)
    c_at = np.searchsorted(ct, tensors).astype(np.int64)
    q_at = np.searchsorted(tt, tensors.astype(tt.dtype) if len(tt) else tensors).astype(np.int64)
    both = c_at + q_at
    cuts = np.unique(np.concatenate([[0], np.searchsorted(both, np.arange(_BATCH, int(both[-1]), _BATCH), "right") - 1,
                                     [len(shp)]]))
    batches = [(int(c_at[a]), int(c_at[b]), int(q_at[a]), int(q_at[b])) for a, b in zip(cuts[:-1], cuts[1:]) if b > a]
    if not _check_batches(s, shp[:, 0], batches):
        return None
    rank, ci, start, stop = _plan_batches(s, batches)
    return Needs(rank, ci if chunks is None else chunks[ci], start, stop)


def _check_batches(s: _Slabs, rows: np.ndarray, batches: list[tuple[int, int, int, int]]) -> bool:
    """Check every batch ((chunk rows, target rows) of whole tensors): False if the
    chunks' global rows are not strictly increasing (the caller sorts them); raise the
    first failure of the first kind of :func:`_check_tiling`'s, then of the target
    check; True when all is well."""
    first: dict[str, int] = {}  # the first failure of each kind: its tensor
    last = None
    for ca, cb, qa, qb in batches:
        c0, c1, cts = s.c0[ca:cb], s.c1[ca:cb], s.ct[ca:cb]
        gs = np.take(s.base, cts)
        gs += c0
        if len(gs) and ((last is not None and gs[0] <= last) or not bool(np.all(gs[1:] > gs[:-1]))):
            return False
        if len(gs):
            last = gs[-1]
            out = c0 + c1 > np.take(rows, cts)
            if "out" not in first and bool(out.any()):
                first["out"] = int(cts[np.argmax(out)])
            gs += c1
            over = gs[:-1] > gs[1:] - c1[1:]
            if "over" not in first and bool(over.any()):
                first["over"] = int(cts[np.argmax(over)])
            has = cts[np.concatenate([[True], cts[1:] != cts[:-1]])]
            if "gap" not in first and int(c1.sum()) != int(rows[has].sum()):
                got = np.bincount(cts - has[0], weights=c1)[has - has[0]]
                first["gap"] = int(has[np.argmax(got != rows[has])])
        tts = s.tt[qa:qb]
        if "target" not in first and len(tts):
            bad = s.t0[qa:qb] + s.t1[qa:qb] > np.take(rows, tts)
            if bool(bad.any()):
                first["target"] = int(tts[np.argmax(bad)])
    for kind, why in (("out", "a saved chunk lies outside its tensor"),
                      ("over", "saved chunks overlap (the layout does not tile the tensor)"),
                      ("gap", "the saved chunks do not cover the tensor (a gap)"),
                      ("target", "a target box lies outside its tensor")):
        if kind in first:
            raise PlanError({first[kind]: why})
    return True


def _plan_batches(s: _Slabs, batches: list[tuple[int, int, int, int]]) -> tuple[np.ndarray, ...]:
    """Rank, chunk (a row of ``s``), start and stop of every piece: each target's first
    piece at the target's own row, the later pieces after all of them, target by
    target, as :func:`_slab_ranges` orders them; written batch by batch into arrays
    allocated once."""
    m = len(s.tt)
    cap = m + len(s.ct)  # targets that do not overlap have at most one later piece per chunk
    rank = np.empty(cap, dtype=np.int32)
    ci = np.empty(cap, dtype=np.intp)
    start = np.empty(cap, dtype=np.int64)
    stop = np.empty(cap, dtype=np.int64)
    k = m
    for ca, cb, qa, qb in batches:
        if qb == qa:
            continue
        cts, tts = s.ct[ca:cb], s.tt[qa:qb]
        gs = np.take(s.base, cts)
        gs += s.c0[ca:cb]
        ge = gs + s.c1[ca:cb]
        delta = np.take(s.rowbytes, cts)
        delta *= gs
        np.subtract(s.offset[ca:cb], delta, out=delta)
        tc = np.take(s.base, tts)
        tc += s.t0[qa:qb]
        td = tc + s.t1[qa:qb]
        trb = np.take(s.rowbytes, tts)
        i0 = np.searchsorted(gs, tc, "right")
        i0 -= 1
        count = _ends(gs, tc, td, i0) - i0
        lost = (i0 < 0) | (tc >= (np.take(ge, i0) if len(ge) else tc))
        if bool(lost.any()):
            raise PlanError({int(tts[np.argmax(lost)]): "a target box is not covered by the saved chunks"})
        trank = s.trank[qa:qb]
        rank[qa:qb] = trank
        np.add(i0, ca, out=ci[qa:qb])
        _bytes(tc, np.minimum(td, np.take(ge, i0)), trb, np.take(delta, i0), start[qa:qb], stop[qa:qb])
        multi = np.nonzero(count > 1)[0]
        if not len(multi):
            continue
        extra = count[multi] - 1
        e = int(extra.sum())
        if k + e > len(rank):  # overlapping targets: more pieces than chunks
            cap = max(2 * len(rank), k + e)
            rank, ci, start, stop = (np.concatenate([a[:k], np.empty(cap - k, dtype=a.dtype)])
                                     for a in (rank, ci, start, stop))
        rep = np.repeat(multi, extra)
        c = np.repeat(i0[multi] - (np.cumsum(extra) - extra) + 1, extra)
        c += np.arange(e)
        rank[k : k + e] = trank[rep]
        np.add(c, ca, out=ci[k : k + e])
        _bytes(gs[c], np.minimum(td[rep], ge[c]), trb[rep], delta[c], start[k : k + e], stop[k : k + e])
        k += e
    return rank[:k], ci[:k], start[:k], stop[:k]


def _ends(gs: np.ndarray, tc: np.ndarray, td: np.ndarray, i0: np.ndarray) -> np.ndarray:
    """``np.searchsorted(gs, td, "left")``: the first chunk starting at or after each
    target's end. Where a target ends where the next begins (Shard(0) targets tile
    their tensor), that is the next target's first chunk, or the one after it when
    that one starts before the next target: one binary search for both."""
    out = np.empty(len(td), dtype=np.intp)
    if not len(td):
        return out
    nxt = np.empty(len(td), dtype=bool)
    np.equal(td[:-1], tc[1:], out=nxt[:-1])
    nxt[-1] = False
    j = i0[1:][nxt[:-1]]
    out[:-1][nxt[:-1]] = j + (gs[j] < tc[1:][nxt[:-1]])
    rest = ~nxt
    out[rest] = np.searchsorted(gs, td[rest], "left")
    return out


def _bytes(lo: np.ndarray, hi: np.ndarray, rowbytes: np.ndarray, delta: np.ndarray,
           start: np.ndarray, stop: np.ndarray) -> None:
    """Rows ``[lo, hi)`` (global) as bytes ``[start, stop)`` of the file, into the arrays given."""
    np.multiply(lo, rowbytes, out=start)
    start += delta
    np.multiply(hi, rowbytes, out=stop)
    stop += delta


def _check_tiling(shp: np.ndarray, ct: np.ndarray, c0: np.ndarray, c1: np.ndarray, gs: np.ndarray) -> None:
    """That the (sorted) row-slab chunks tile every tensor they belong to: each inside
    its tensor, none overlapping the next, their rows adding up to the tensor's."""
    if not len(ct):
        return
    out = c0 + c1 > shp[:, 0][ct]
    if bool(out.any()):
        raise PlanError({int(ct[np.argmax(out)]): "a saved chunk lies outside its tensor"})
    over = gs[1:] < gs[:-1] + c1[:-1]
    if bool(over.any()):
        raise PlanError({int(ct[np.argmax(over)]): "saved chunks overlap (the layout does not tile the tensor)"})
    has = np.zeros(len(shp), dtype=bool)
    has[ct] = True
    if int(c1.sum()) != int(shp[has, 0].sum()):  # inside their tensors, not overlapping: then short somewhere
        rows = np.bincount(ct, weights=c1, minlength=len(shp))
        short = has & (rows != shp[:, 0])
        raise PlanError({int(np.argmax(short)): "the saved chunks do not cover the tensor (a gap)"})


def _box_ranges(layout: SnapshotLayout, targets: Targets, t: int, chunks: np.ndarray, tgts: np.ndarray) -> Needs:
    """One tensor of any layout: the read plan a load makes (:func:`~.read.plan_reads`),
    each region's span in its chunk as a byte range."""
    def box(off: np.ndarray, size: np.ndarray) -> Box:
        return Box(tuple(int(x) for x in off), tuple(int(x) for x in size))

    saved = [box(layout.box_offsets[c], layout.box_sizes[c]) for c in chunks]
    want = [box(targets.offsets[i], targets.sizes[i]) for i in tgts]
    try:
        ops = plan_reads(saved, want)
    except ValueError as e:
        raise PlanError({t: str(e)}) from None
    size = int(layout.itemsize[t])
    rank = np.array([targets.rank[tgts[op.target]] for op in ops], dtype=np.int32)
    chunk = np.array([chunks[op.source] for op in ops], dtype=np.int64)
    first = np.array([op.first for op in ops], dtype=np.int64)
    last = np.array([op.last for op in ops], dtype=np.int64)
    base = layout.offset[chunk] if len(ops) else np.zeros(0, dtype=np.int64)
    return Needs(rank, chunk, base + first * size, base + last * size)


# -- step 2: where each range comes from ----------------------------------------------

class Tier(enum.Enum):
    """Where a rank's range comes from."""

    LOCAL = "local"  # its own host's memory
    PEER = "peer"  # another host's memory, over the network
    DURABLE = "durable"  # the durable root


@dataclass(frozen=True, slots=True)
class RangeRead:
    """Read bytes ``[start, stop)`` of data file ``file`` (chunk ``chunk`` of the layout)
    from host ``source`` (:data:`DURABLE`: the durable root)."""

    file: int
    start: int
    stop: int
    chunk: int
    source: int
    tier: Tier


@dataclass(frozen=True, slots=True, eq=False)
class RestorePlan:
    """Who reads which byte ranges from whom: one row per range, as :class:`Needs`
    with a source each. A range read from the durable root is rounded out to whole
    checksum blocks of its chunk (the reader verifies it); so is one read from a peer
    unless the holder verifies (then exactly the bytes needed travel)."""

    rank: np.ndarray  # int32 (k,)
    chunk: np.ndarray  # int64 (k,)
    file: np.ndarray  # int32 (k,)
    start: np.ndarray  # int64 (k,)
    stop: np.ndarray  # int64 (k,)
    source: np.ndarray  # int32 (k,): host id, or DURABLE
    world: NewWorld
    hosts: int
    """Host ids are ``0 .. hosts - 1`` (the inventories' and the new world's)."""
    needed: np.ndarray = field(repr=False)
    """int64 (hosts,): the bytes of each host's ranks' shards (exact, before any rounding)."""

    def __len__(self) -> int:
        return int(self.rank.shape[0])

    def reads_of(self, rank: int) -> list[RangeRead]:
        """Rank ``rank``'s reads, by file and offset."""
        rows = np.nonzero(self.rank == rank)[0]
        rows = rows[np.lexsort((self.start[rows], self.file[rows]))]
        home = int(self.world.host[rank])
        out = []
        for i in rows.tolist():
            src = int(self.source[i])
            tier = Tier.DURABLE if src == DURABLE else Tier.LOCAL if src == home else Tier.PEER
            out.append(RangeRead(int(self.file[i]), int(self.start[i]), int(self.stop[i]), int(self.chunk[i]), src, tier))
        return out

    def _reader_host(self) -> np.ndarray:
        return self.world.host[self.rank]

    def received(self) -> np.ndarray:
        """int64 (hosts,): bytes into each host from elsewhere (peers and the durable root)."""
        dst = self._reader_host()
        away = self.source != dst
        return _sum(dst[away], (self.stop - self.start)[away], self.hosts)

    def served(self) -> np.ndarray:
        """int64 (hosts,): bytes each host sends to other hosts."""
        peer = (self.source != DURABLE) & (self.source != self._reader_host())
        return _sum(self.source[peer], (self.stop - self.start)[peer], self.hosts)

    def from_durable(self) -> int:
        """Bytes read from the durable root, all hosts together."""
        d = self.source == DURABLE
        return int((self.stop - self.start)[d].sum())

    def local(self) -> int:
        """Bytes read from the reader's own host's memory, all hosts together."""
        d = self.source == self._reader_host()
        return int((self.stop - self.start)[d].sum())


def _sum(at: np.ndarray, nbytes: np.ndarray, n: int) -> np.ndarray:
    """Bytes summed by host (``np.bincount``'s float64 weights: exact below 2**53 bytes)."""
    if len(at) == 0:
        return np.zeros(n, dtype=np.int64)
    if int(nbytes.sum()) >= 1 << 53:
        raise PlanError({-1: "more than 2**53 bytes to restore in one plan"})
    return np.rint(np.bincount(at, weights=nbytes, minlength=n)).astype(np.int64)


def _local_sources(layout: SnapshotLayout, needs: Needs, world: NewWorld,
                   holds: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per range: its file, and its source where its reader's host holds the file
    whole (else :data:`DURABLE`). And the bytes each host's ranks need (float64, exact
    below 2**53: the caller checks). In batches, so that no temporary is as long as the plan."""
    k, n_files, hosts = len(needs), holds.shape[1], holds.shape[0]
    file = np.empty(k, dtype=np.int32)
    source = np.empty(k, dtype=np.int32)
    needed = np.zeros(hosts, dtype=np.float64)
    flat = holds.ravel()
    for a in range(0, k, _BATCH):
        b = min(k, a + _BATCH)
        d = np.take(world.host, needs.rank[a:b])
        f = file[a:b]
        f[:] = np.take(layout.file, needs.chunk[a:b])
        src = source[a:b]
        src.fill(DURABLE)
        np.copyto(src, d, where=np.take(flat, _unit_keys(d, f, n_files)))
        needed += np.bincount(d, weights=np.subtract(needs.stop[a:b], needs.start[a:b], dtype=np.float64),
                              minlength=hosts)
    return file, source, needed


def _unit_keys(dst: np.ndarray, file: np.ndarray, n_files: int) -> np.ndarray:
    """Each range's unit: ``reader host * files + file``."""
    key = np.multiply(dst, n_files, dtype=np.intp)
    key += file
    return key


#: Rows of a plan whose units are summed in one ``np.bincount`` by :func:`_by_unit`
#: (each sum allocates a table of every (host, file) unit: few and large).
_UNIT_BATCH = 1 << 22


def _by_unit(world: NewWorld, rank: np.ndarray, file: np.ndarray, start: np.ndarray, stop: np.ndarray,
             away: np.ndarray, source: np.ndarray, n_files: int, hosts: int,
             choose: Callable[[np.ndarray, np.ndarray], np.ndarray]) -> None:
    """Group the rows ``away`` by unit (reader host, file), sum their bytes per unit,
    ``choose`` a source per unit (from the units, sorted, and their bytes), and set
    every such row's ``source`` to its unit's, in place. By a dense table of the units
    in batches of rows (no per-row key or inverse as long as the plan) when there are
    few enough possible units, which is several times faster than sorting; else by
    sorting the rows' keys."""
    span = hosts * n_files
    k = len(rank)
    if span > 1 << 26:
        rows = np.nonzero(away)[0]
        key = _unit_keys(np.take(world.host, rank[rows]), file[rows], n_files)
        units, inverse = np.unique(key, return_inverse=True)
        pick = choose(units, _sum(inverse, stop[rows] - start[rows], len(units)))
        source[rows] = pick[inverse]
        return
    summed = np.zeros(span + 1, dtype=np.float64)
    seen = np.zeros(span + 1, dtype=bool)

    def keys(a: int, b: int) -> np.ndarray:  # rows a:b's units; span for the rows not away
        key = _unit_keys(np.take(world.host, rank[a:b]), file[a:b], n_files)
        key[~away[a:b]] = span
        return key

    for a in range(0, k, _UNIT_BATCH):
        b = min(k, a + _UNIT_BATCH)
        key = keys(a, b)
        summed += np.bincount(key, weights=np.subtract(stop[a:b], start[a:b], dtype=np.float64), minlength=span + 1)
        seen[key] = True
    if summed[:span].sum() >= 1 << 53:
        raise PlanError({-1: "more than 2**53 bytes to restore in one plan"})
    units = np.nonzero(seen[:span])[0]
    del seen
    pick = choose(units, np.rint(summed[units]).astype(np.int64))
    del summed
    table = np.empty(span + 1, dtype=pick.dtype)
    table[units] = pick
    for a in range(0, k, _UNIT_BATCH):
        b = min(k, a + _UNIT_BATCH)
        rows = away[a:b]
        source[a:b][rows] = np.take(table, keys(a, b)[rows])


def choose_sources(layout: SnapshotLayout, needs: Needs, world: NewWorld, inventories: Sequence[Inventory],
                   *, holder_verifies: bool = True) -> RestorePlan:
    """The source of every needed range, nearest first: the reader's own host when it
    holds the range (the file whole, or a range covering it); else a peer host holding
    the file whole, one holder for all the ranges a host reads of one file (one stream
    per pair of hosts), holders chosen largest demand first, each to the least loaded
    holder (the ones that are the only holder first); else a peer holding a covering
    range; else the durable root.

    ``holder_verifies``: a peer checks the whole checksum blocks in its memory and sends
    the exact bytes (with a checksum of its own); when False the reader verifies, and
    peer ranges are rounded out to whole blocks like durable ones."""
    n_files = len(layout.file_size)
    hosts = 1 + max([-1, *(i.host for i in inventories), *(world.host.tolist() if len(world) else [])])
    holds = np.zeros((hosts, n_files), dtype=bool)
    holders: list[list[int]] = [[] for _ in range(n_files)]
    ranges: dict[tuple[int, int], list[HeldRange]] = {}
    for inv in inventories:
        for f in sorted(inv.files):
            holds[inv.host, f] = True
            holders[f].append(inv.host)
        for r in inv.ranges:
            ranges.setdefault((inv.host, r.file), []).append(r)
    start, stop = needs.start, needs.stop
    file, source, needed_f = _local_sources(layout, needs, world, holds)
    if needed_f.sum() >= 1 << 53:
        raise PlanError({-1: "more than 2**53 bytes to restore in one plan"})
    needed = np.rint(needed_f).astype(np.int64)
    dst = world.host[needs.rank] if ranges else np.zeros(0, dtype=np.int32)
    if ranges:  # ranges a host holds itself
        _held_ranges(start, stop, dst, file, source, ranges, own=True)
    away = source == DURABLE
    if not holder_verifies:  # the reader verifies what it gets from elsewhere: whole blocks travel
        start, stop = start.copy(), stop.copy()
        _round_out(layout, needs.chunk, np.nonzero(away)[0], start, stop)
    _by_unit(world, needs.rank, file, start, stop, away, source, n_files, hosts,
             lambda units, demand: _balance(units, demand, holders, n_files, hosts))
    if ranges:  # ranges peers hold, for what no whole copy is left of
        _held_ranges(start, stop, dst, file, source, ranges, own=False)
    if holder_verifies:  # the durable root's bytes are checked by their reader
        durable = np.nonzero(source == DURABLE)[0]
        if len(durable):
            start, stop = start.copy(), stop.copy()
            _round_out(layout, needs.chunk, durable, start, stop)
    return RestorePlan(needs.rank, needs.chunk, file, start, stop, source, world, hosts, needed)


def _round_out(layout: SnapshotLayout, chunk: np.ndarray, rows: np.ndarray, start: np.ndarray, stop: np.ndarray) -> None:
    """Rows ``rows`` of ``start``/``stop`` rounded out, in place, to whole checksum blocks of their chunk."""
    c = chunk[rows]
    c0 = layout.offset[c]
    end = c0 + row_prod(layout.box_sizes[c]) * layout.itemsize[layout.tensor[c]]
    b = layout.block
    start[rows] = c0 + (start[rows] - c0) // b * b
    stop[rows] = np.minimum(end, c0 + -(-(stop[rows] - c0) // b) * b)


def _balance(units: np.ndarray, demand: np.ndarray, holders: list[list[int]], n_files: int, hosts: int) -> np.ndarray:
    """A holder for each (reader host, file) unit: units with one holder first, then the
    others by demand, largest first, each to its least loaded holder (ties: the one
    after the reader in host order, so that equal holders are shared round the ring).
    Then, while a unit of the most loaded host can go to another of its holders and
    stay below that host's load, it moves (each move lowers the largest load or the
    number of hosts at it: it ends): on return no unit of the most loaded host can."""
    pick = np.full(len(units), DURABLE, dtype=np.int32)
    load = np.zeros(hosts, dtype=np.int64)
    dst_of = (units // n_files).tolist()
    file_of = (units % n_files).tolist()
    need = demand.tolist()
    order = sorted(range(len(units)), key=lambda u: (len(holders[file_of[u]]) > 1, -need[u], u))
    on: list[list[int]] = [[] for _ in range(hosts)]  # units that could go elsewhere, by host
    for u in order:
        cands = holders[file_of[u]]
        if not cands:
            continue
        d = dst_of[u]
        best = min(cands, key=lambda h: (int(load[h]), (h - d) % hosts))
        load[best] += need[u]
        pick[u] = best
        if len(cands) > 1:
            on[best].append(u)
    for _ in range(4 * len(units) + 1):
        h = int(np.argmax(load))
        move = next(((u, c) for u in on[h] for c in holders[file_of[u]]
                     if c != h and load[c] + need[u] < load[h]), None)
        if move is None:
            break
        u, c = move
        on[h].remove(u)
        on[c].append(u)
        load[h] -= need[u]
        load[c] += need[u]
        pick[u] = c
    return pick


def _held_ranges(start: np.ndarray, stop: np.ndarray, dst: np.ndarray, file: np.ndarray, source: np.ndarray,
                 ranges: dict[tuple[int, int], list[HeldRange]], *, own: bool) -> None:
    """Sources from held byte ranges, for the rows still read from the durable root:
    ``own``: a range the reader's host holds; else any host's covering range."""
    todo = np.nonzero(source == DURABLE)[0]
    if own:
        keys = np.array([h * (1 << 32) + f for h, f in ranges], dtype=np.int64)
        todo = todo[np.isin(dst[todo].astype(np.int64) * (1 << 32) + file[todo], keys)]
    else:
        files = np.array(sorted({f for _h, f in ranges}), dtype=np.int64)
        todo = todo[np.isin(file[todo], files)]
    by_file: dict[int, list[tuple[int, HeldRange]]] = {}
    for (h, f), rs in ranges.items():
        by_file.setdefault(f, []).extend((h, r) for r in rs)
    for i in todo.tolist():
        d, f, s, e = int(dst[i]), int(file[i]), int(start[i]), int(stop[i])
        for h, r in by_file.get(f, []):
            if (h == d) == own and r.start <= s and e <= r.stop:
                source[i] = h
                break


def plan_restore(layout: SnapshotLayout, targets: Targets, world: NewWorld, inventories: Sequence[Inventory],
                 *, holder_verifies: bool = True) -> RestorePlan:
    """:func:`needed_ranges`, then :func:`choose_sources`."""
    return choose_sources(layout, needed_ranges(layout, targets), world, inventories,
                          holder_verifies=holder_verifies)
