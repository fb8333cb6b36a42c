"""Read: the load's I/O. Turns each target's read plan into typed jobs (the byte
range of a saved chunk to copy into a view), reads them in parallel and checks
every byte against its block CRC-32 before the load returns.

Many small chunks that lie next to each other in one file are read with one
call and placed from that buffer (a job each costs a few microseconds, not a
read, a thread hand-off and a file open); a large contiguous region is read
straight into its target's memory, with no staging copy.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from operator import attrgetter
from typing import NoReturn

import msgspec
import torch

from .._memory import COMPLEX
from .._memory import bytes_of as _bytes_of
from ..errors import CorruptCheckpointError, UsageError
from ..format.boxes import Box, box_runs
from ..format.chunks import ChunkLoc, SavedChunk, TensorSpec
from ..format.datafile import crc32, first_bad_block
from ..format.index import box_at
from ..plan.read import plan_reads, tiling_problem
from ..storage import Storage
from .locate import Locator

__all__ = ["FileRange", "ReadJob", "Reader", "Target", "io_threads", "plan_jobs", "read_ranges", "read_verified"]

_Bytes = bytes | bytearray | memoryview



def io_threads(storage: Storage) -> int:
    """Threads that read and verify chunks in parallel: ``SHARDPOINT_IO_THREADS`` when
    set, else what suits the storage (:attr:`Storage.read_threads`)."""
    env = os.environ.get("SHARDPOINT_IO_THREADS", "")
    try:
        return max(1, int(env)) if env else max(1, storage.read_threads)
    except ValueError:
        raise UsageError(f"SHARDPOINT_IO_THREADS={env!r} is not a whole number; set it to the reads per rank, "
                         "or unset it") from None

#: Largest single read while checksumming a whole chunk (verify, export).
_PIECE = 8 << 20


class Target(msgspec.Struct, frozen=True, gc=False):
    """A tensor to fill: its saved description and the views that hold this rank's
    boxes of it (a created tensor's one view is the whole of it). A
    :class:`msgspec.Struct` (made in C): a load makes one per tensor."""

    spec: TensorSpec
    boxes: list[Box]
    views: list[torch.Tensor]
    per_rank: bool
    direct: bool
    """Every view is a CPU tensor of the saved dtype (as the key check found): reads may
    go straight into the bytes of each one that is also contiguous, neither negative
    nor conjugate (:func:`plan_jobs`)."""


class ReadJob(msgspec.Struct, frozen=True, gc=False):
    """Bytes ``[lo, hi)`` of one saved chunk, to copy into ``dst`` (the part of a target
    view that ``region`` of the tensor covers). A :class:`msgspec.Struct` (made in C:
    a load makes one per chunk it reads)."""

    key: str
    loc: ChunkLoc
    chunk: Box
    region: Box
    lo: int
    hi: int
    contiguous: bool
    """The region is exactly bytes ``[lo, hi)`` of the chunk (else a strided part of them)."""
    dtype: torch.dtype
    """The saved dtype (``dst`` may have another: the copy converts)."""
    dst: torch.Tensor | None
    """The view to copy the region into (a conversion, a strided region, another
    device); with ``out``, the tensor whose memory ``out`` is (kept alive here)."""
    out: memoryview | None = None
    """The target's bytes when the job goes straight into them: one byte range of the
    chunk into one byte range of a contiguous CPU tensor of the saved dtype."""
    whole: bool = False
    """The job is a whole chunk of at least one byte going into ``out`` (set where
    the job is planned; a part of it, :meth:`Reader._pieces`, is not)."""


#: One read operation of a target, in bytes of one item size and independent of the
#: tensor's dtype and place (tensors of one layout, one local boxes and one item size
#: share their steps): ``(target, region, lo, hi, contiguous, narrows, into, box,
#: nbytes, numel, rank, at, loc, whole)``. The bytes ``[lo, hi)`` of the chunk
#: ``box`` (``nbytes``, ``numel`` elements) fill ``region`` of view ``target``;
#: ``contiguous``: they are one range of the chunk; ``narrows``: ``(dim, start,
#: length)`` that cut the region out of the view; ``into``: the bytes of the view it
#: fills when they are one contiguous range there and in the chunk (:data:`_WHOLE`:
#: all of them), else None; ``rank``: the saving rank whose index holds the chunk (-1:
#: ``loc`` says where it is); ``at``: its name after the key (``@o0,o1``); ``whole``:
#: the whole chunk (of at least one byte) is read. A plain tuple, not a NamedTuple:
#: the planner unpacks one per chunk, and Python unpacks only an exact tuple in C.
_Step = tuple[int, Box, int, int, bool, tuple[tuple[int, int, int], ...], "slice | None", Box, int, int, int, str,
              "ChunkLoc | None", bool]


#: ``into`` of a :data:`_Step` whose region fills the whole view (the view's bytes, no slice of them).
_WHOLE = slice(None)


def _steps(spec: TensorSpec, chunks: tuple[SavedChunk, ...], targets: list[Box]) -> list[_Step]:
    """The read plan of one target (:func:`~shardpoint.plan.read.plan_reads`), checked."""
    boxes = [c.box for c in chunks]
    if spec.listed:
        why = tiling_problem(boxes, spec.shape)
        if why is not None:
            raise CorruptCheckpointError(f"key {spec.key!r}: {why} in the manifest; the checkpoint is damaged")
    try:
        ops = plan_reads(boxes, targets)
    except ValueError:
        raise CorruptCheckpointError(f"key {spec.key!r}: the checkpoint's chunks do not cover the tensor") from None
    size = spec.itemsize
    steps = []
    for op in ops:
        tbox, chunk = targets[op.target], chunks[op.source]
        narrows = () if op.region == tbox else tuple(
            (d, r - o, n) for d, (r, o, n, m) in enumerate(zip(op.region.offsets, tbox.offsets, op.region.sizes,
                                                               tbox.sizes)) if n != m)
        tfirst, _tlast, _run, truns = box_runs(op.region, tbox)
        lo, hi, numel = op.first * size, op.last * size, chunk.box.numel
        into = None
        if op.runs == 1 and truns == 1:
            start = tfirst * size
            into = _WHOLE if start == 0 and hi - lo == tbox.numel * size else slice(start, start + hi - lo)
        steps.append((op.target, op.region, lo, hi, op.runs == 1, narrows, into, chunk.box, numel * size, numel,
                      chunk.rank, box_at(chunk.box.offsets), chunk.loc, lo == 0 and 0 < hi == numel * size))
    return steps


def plan_jobs(targets: Sequence[Target], locator: Locator) -> list[ReadJob]:
    """The read plan of every target (:func:`~shardpoint.plan.read.plan_reads`), each
    operation located in its rank's index and made a job. Targets of one layout (its
    key names the shape and the saved boxes), the same local boxes (a parameter and
    its optimizer moments) and one item size are planned once, in bytes: what is left
    per chunk is its name, one look-up and its job."""
    jobs: list[ReadJob] = []
    add = jobs.append
    known: dict[bytes, list[tuple[list[Box], int, list[_Step]]]] = {}  # by layout: local boxes, item size, steps
    find, indexes = locator.find, locator.indexes
    for t in targets:
        spec = t.spec
        # a layout (a text naming the shape and the saved boxes; None for listed chunks), local boxes and
        # item size seen before: the same chunks and the same steps (the boxes compared, not hashed: a
        # walk's DTensors of one layout share their box objects)
        layout, boxes, size = spec.layout, t.boxes, spec.itemsize
        steps = None
        if layout is not None:
            seen = known.get(layout)
            if seen is None:
                seen = known[layout] = []
            for seen_boxes, seen_size, seen_steps in seen:
                if seen_size == size and seen_boxes == boxes:
                    steps = seen_steps
                    break
            else:
                steps = _steps(spec, spec.chunks(), boxes)
                seen.append((boxes, size, steps))
        else:
            steps = _steps(spec, spec.chunks(), boxes)
        key, views = spec.key, t.views
        dtype = spec.torch_dtype
        if dtype is None:
            dtype = spec.dtype  # raises, naming the key: this torch lacks the saved dtype
        prefix = "/per_rank/" + key if t.per_rank else key
        # each view's bytes where the reads can go straight into them: a view of a direct target (a CPU
        # tensor of the saved dtype) that is contiguous and neither negative nor conjugate (such a view
        # holds other values than its bytes: copied into; only a complex tensor can be conjugate)
        bases: list[memoryview | None] = []
        for v in views:
            direct = t.direct and v.is_contiguous() and not v.is_neg() and not (dtype in COMPLEX and v.is_conj())
            bases.append(_bytes_of(v) if direct else None)
        for target, region, lo, hi, contiguous, narrows, into, box, nbytes, numel, rank, at, loc, whole in steps:
            if loc is None:
                name = prefix + at
                idx = indexes.get(rank)
                loc = idx.locate(name) if idx is not None else None
                if loc is None:
                    loc = find(key, rank, name)  # reads the rank's index, or raises naming the chunk
            if loc.length != nbytes:
                raise locator.wrong_length(spec, loc, numel)
            out = bases[target]
            if out is not None and into is not None:  # straight into the target's bytes (``dst`` keeps them)
                add(ReadJob(key, loc, box, region, lo, hi, True, dtype, views[target], out if into is _WHOLE else out[into],
                            whole))
                continue
            view = views[target]
            if view.requires_grad:  # a parameter: write its data
                view = view.detach()
            for d, start, n in narrows:
                view = view.narrow(d, start, n)
            add(ReadJob(key, loc, box, region, lo, hi, contiguous, dtype, view))
    return jobs


#: Chunks one scattered read takes at most.
_RUN_MAX = 512
_OFFSET = attrgetter("loc.offset")


@dataclass(slots=True)
class Reader:
    """Runs read jobs in parallel, verifying block checksums (unless ``verify`` is False)."""

    storage: Storage
    block: int
    verify: bool = True
    bytes_read: int = 0
    _devices: set[torch.device] = field(default_factory=set)  # CUDA devices with copies in flight
    threads: int = field(init=False)
    """Reads at a time (:func:`io_threads`)."""
    piece: int | None = field(init=False)
    """Bytes a verified read asks for at a time, and the most a run of small chunks
    reads: the storage's :attr:`~Storage.read_piece`; with several read threads, a
    piece smaller than a checksum block (one sized for the CPU's cache) doubled, up to
    the block. Each piece's read and CRC hand the GIL over, and a thread back from one
    waits for it while another holds it: with 2 threads, 1 rank on 2 cores loaded
    1.29 GB in 0.97x the floor with 512 KiB pieces and 1.05x with 256 KiB; with one
    thread a rank, 256 KiB stays best (2 ranks: 1.31x, against 1.37x)."""

    def __post_init__(self) -> None:
        self.threads = io_threads(self.storage)
        piece = self.storage.read_piece
        if piece is not None and self.threads > 1 and piece < self.block:
            piece = min(2 * piece, self.block)
        self.piece = piece

    def run(self, jobs: Sequence[ReadJob]) -> None:
        """Read and place every job; raises :class:`CorruptCheckpointError` naming the
        key and file of the first one whose bytes are missing or damaged."""
        threads = self.threads
        tasks = self._tasks(jobs)
        if not tasks:
            return
        try:
            with self.storage.keep_open():
                if len(tasks) == 1 or threads <= 1:
                    self.bytes_read += sum(t() for t in tasks)
                    return
                with ThreadPoolExecutor(max_workers=min(threads, len(tasks))) as ex:
                    self.bytes_read += sum(ex.map(lambda t: t(), tasks))
        finally:
            for d in self._devices:  # the targets hold their bytes when the load returns
                torch.cuda.synchronize(d)
            self._devices.clear()

    def _tasks(self, jobs: Sequence[ReadJob]) -> list[Callable[[], int]]:
        """Whole chunks that lie one after another in a file and go straight into
        their targets, one task per run of them (one scattered read); other large
        jobs, one task each (cut into blocks read in parallel when :attr:`threads` > 1);
        other small jobs next to each other in a file, one task per batch."""
        threads = self.threads
        tasks: list[Callable[[], int]] = []
        small: list[tuple[str, int, int, int, ReadJob]] = []  # file, first byte, end, chunk-relative first byte, job
        whole: dict[str, list[ReadJob]] = {}  # by file
        batch = self.storage.read_batch
        small_max = batch // 8
        piece = self.piece
        most = -1 if piece is None else max(piece, small_max)  # larger whole chunks: a run of their own
        for j in jobs:
            if j.whole and j.hi <= most:
                fname = j.loc.file
                got = whole.get(fname)
                if got is None:
                    whole[fname] = [j]
                else:
                    got.append(j)
                continue
            a, b = self._span(j.loc, j.lo, j.hi)
            if b - a <= small_max:
                small.append((j.loc.file, j.loc.offset + a, j.loc.offset + b, a, j))
            else:
                tasks += [partial(self._one, p) for p in (self._pieces(j) if threads > 1 else (j,))]
        if piece is not None:
            tasks += self._runs(whole, piece)
        small.sort(key=lambda s: (s[0], s[1]))
        i = 0
        while i < len(small):
            fname, start, end = small[i][0], small[i][1], small[i][2]
            k = i + 1
            while k < len(small) and small[k][0] == fname and small[k][1] <= end and small[k][2] - start <= batch:
                end = max(end, small[k][2])
                k += 1
            members = small[i:k]
            tasks.append(partial(self._batch, fname, start, end, members))
            i = k
        return tasks

    def _runs(self, by_file: dict[str, list[ReadJob]], piece: int) -> list[Callable[[], int]]:
        """Whole chunks back to back in one file (``by_file``: the jobs of each file),
        about ``piece`` bytes a run at most (their CRCs are computed while the bytes
        are still in the CPU's cache)."""
        tasks: list[Callable[[], int]] = []
        for fname in sorted(by_file):
            group = by_file[fname]
            group.sort(key=_OFFSET)  # an int each: a file's chunks come mostly in order
            locs = [j.loc for j in group]
            i, n = 0, len(group)
            while i < n:
                first = locs[i]
                start = first.offset
                end, limit, stop = start + first.length, start + piece, min(n, i + _RUN_MAX)
                k = i + 1
                while k < stop:
                    loc = locs[k]
                    if loc.offset != end or end + loc.length > limit:
                        break
                    end += loc.length
                    k += 1
                tasks.append(partial(self._run_of, group[i:k]))
                i = k
        return tasks

    def _run_of(self, members: list[ReadJob]) -> int:
        """Read whole chunks that lie back to back in a file straight into their
        targets with one scattered read, then check each."""
        if len(members) == 1:
            return self._read_into(members[0])
        views = [j.out for j in members if j.out is not None]  # every member has its target's bytes
        first, last = members[0], members[-1]
        end = last.loc.offset + last.loc.length
        try:
            self.storage.readv_into(first.loc.file, first.loc.offset, views)
        except (CorruptCheckpointError, OSError):  # one at a time, to name the key whose bytes are missing
            return sum(self._read_into(j) for j in members)
        if self.verify:
            block = self.block
            for j, v in zip(members, views):
                if len(v) > block or crc32(v) != j.loc.crc32[0]:  # one block (most, in a run): checked here
                    self._check_whole(j, v)
        return end - first.loc.offset

    def _pieces(self, j: ReadJob) -> list[ReadJob]:
        """A large job straight into a contiguous CPU target, cut at checksum block
        boundaries into jobs of at least :attr:`piece` bytes (a block each locally),
        read in parallel; each reads its blocks :attr:`piece` bytes at a time
        (:meth:`_read_blocks`). Whole on a storage that takes a range in one call
        (an object store: a request each)."""
        piece, out = self.piece, j.out
        if piece is None or out is None:
            return [j]
        step = max(1, piece // self.block) * self.block
        if j.hi - j.lo <= step:
            return [j]
        cuts = [j.lo, *range((j.lo // step + 1) * step, j.hi, step), j.hi]
        return [msgspec.structs.replace(j, lo=lo, hi=hi, out=out[lo - j.lo : hi - j.lo], whole=False)
                for lo, hi in zip(cuts[:-1], cuts[1:])]

    def _batch(self, fname: str, start: int, end: int, members: list[tuple[str, int, int, int, ReadJob]]) -> int:
        """Read bytes ``[start, end)`` of ``fname`` once; check and place every member from them."""
        data = memoryview(self._read(members[0][4], fname, start, end - start))
        for _f, s, e, a, j in members:
            piece = data[s - start : e - start]
            if self.verify:
                self._check(j, a, a + len(piece), a, a + len(piece), b"", piece, b"")
            self._place(j, piece, a)
        return end - start

    def _one(self, j: ReadJob) -> int:
        """One large job: straight into the target when it is one byte range of a
        contiguous CPU (or CUDA, through pinned memory) tensor of the saved dtype."""
        if j.out is not None:
            return self._read_into(j)
        dst = j.dst
        assert dst is not None
        if j.contiguous and dst.dtype == j.dtype and dst.device.type == "cuda" and dst.is_contiguous():
            host = torch.empty(dst.shape, dtype=j.dtype, pin_memory=True)  # then to the device while the next reads run
            n = self._read_into(j, _bytes_of(host))
            self._to_device(dst, host)
            return n
        a, b = self._span(j.loc, j.lo, j.hi)
        data = memoryview(self._read(j, j.loc.file, j.loc.offset + a, b - a))
        if self.verify:
            self._check(j, a, b, a, b, b"", data, b"")
        self._place(j, data, a)
        return b - a

    def _place(self, j: ReadJob, data: memoryview, a: int) -> None:
        """Copy the job's region from ``data``, the chunk's bytes from byte ``a`` on."""
        if j.region.numel == 0:
            return
        if j.out is not None:
            j.out[:] = data[j.lo - a : j.hi - a]
            return
        dst, dtype = j.dst, j.dtype
        assert dst is not None
        src = torch.frombuffer(data, dtype=torch.uint8).view(dtype)
        # the region inside the saved chunk, as a strided view of the bytes read
        sizes = j.chunk.sizes
        strides = [1] * len(sizes)
        for d in range(len(sizes) - 2, -1, -1):
            strides[d] = strides[d + 1] * sizes[d + 1]
        base = j.lo // src.element_size() - a // src.element_size()
        region = src.as_strided(j.region.sizes, strides, base) if sizes else src[base : base + 1].reshape(())
        if dst.device.type == "cuda":  # one host copy of the region, pinned, then asynchronously to the device
            host = torch.empty(region.shape, dtype=dtype, pin_memory=True)
            host.copy_(region)
            self._to_device(dst, host)
        else:
            dst.copy_(region)

    def _to_device(self, dst: torch.Tensor, host: torch.Tensor) -> None:
        """An asynchronous copy from pinned ``host`` (kept by torch's caching host
        allocator until the copy ran); :meth:`run` waits for the device at its end."""
        self._devices.add(dst.device)
        dst.copy_(host, non_blocking=True)

    def _read_into(self, j: ReadJob, view: memoryview | None = None) -> int:
        """Bytes ``[lo, hi)`` of a chunk straight into ``view`` (the job's own bytes,
        ``out``, by default), with no staging copy; returns the bytes read. To verify,
        the whole checksum blocks inside the range are read a piece at a time, each
        piece's CRC computed while it is in cache (:meth:`_read_blocks`), and a partial
        block at either end is completed with a small read of its outer bytes."""
        if view is None:
            assert j.out is not None
            view = j.out
        lo, hi = j.lo, j.hi
        piece = self.piece
        if self.verify and piece is not None and hi - lo > piece:
            blk = self.block
            mid_lo = min(-(-lo // blk) * blk, hi)  # the whole blocks inside [lo, hi)
            mid_hi = hi if hi == j.loc.length else max(hi // blk * blk, mid_lo)
            if mid_hi - mid_lo > piece:
                n = self._read_span(j, view[: mid_lo - lo], lo, mid_lo) if mid_lo > lo else 0
                self._read_blocks(j, view[mid_lo - lo : mid_hi - lo], mid_lo, piece)
                if hi > mid_hi:
                    n += self._read_span(j, view[mid_hi - lo :], mid_hi, hi)
                return n + mid_hi - mid_lo
        return self._read_span(j, view, lo, hi)

    def _read_span(self, j: ReadJob, view: memoryview, lo: int, hi: int) -> int:
        """Bytes ``[lo, hi)`` of the job's chunk into ``view`` with one read; to verify,
        the partial CRC blocks at the two ends are completed with small reads of their
        outer bytes (CRC-32 chains). Returns the bytes read."""
        loc = j.loc
        try:
            self.storage.read_into(loc.file, loc.offset + lo, view)
        except (CorruptCheckpointError, OSError) as e:  # missing, truncated, unreadable: name the key too
            raise CorruptCheckpointError(f"key {j.key!r}: {e}") from None
        if not self.verify:
            return len(view)
        if lo == 0 and hi == loc.length:  # a whole chunk: its blocks, no partial ones at the ends
            self._check_whole(j, view)
            return len(view)
        a, b = self._span(loc, lo, hi)
        head = self._read(j, loc.file, loc.offset + a, lo - a) if lo > a else b""
        tail = self._read(j, loc.file, loc.offset + hi, b - hi) if b > hi else b""
        self._check(j, a, b, lo, hi, head, view, tail)
        return len(view) + len(head) + len(tail)

    def _read_blocks(self, j: ReadJob, view: memoryview, lo: int, piece: int) -> None:
        """Bytes ``[lo, lo + len(view))`` of the job's chunk, whole checksum blocks, into
        ``view``, read ``piece`` bytes at a time with each CRC-32 computed right after
        its read while the bytes are still in the CPU's cache
        (:meth:`Storage.read_into_crcs`), then each block checked."""
        blk, loc = self.block, j.loc
        try:
            got = self.storage.read_into_crcs(loc.file, loc.offset + lo, view, blk, piece)
        except (CorruptCheckpointError, OSError) as err:  # missing, truncated, unreadable: name the key too
            raise CorruptCheckpointError(f"key {j.key!r}: {err}") from None
        k = lo // blk
        want = loc.crc32[k : k + len(got)]
        if got != want:  # lists, as the index decodes them (another sequence: compared one by one)
            bad = next((i for i, (c, w) in enumerate(zip(got, want)) if c != w), None)
            if bad is not None:
                self._mismatch(j, lo + bad * blk, min(lo + (bad + 1) * blk, lo + len(view)))

    def _span(self, loc: ChunkLoc, lo: int, hi: int) -> tuple[int, int]:
        """``[lo, hi)`` rounded out to whole checksum blocks (when verifying)."""
        return _span(loc, lo, hi, self.block, self.verify)

    def _read(self, j: ReadJob, fname: str, at: int, n: int) -> bytearray:
        try:
            data = self.storage.read(fname, at, n)
        except (CorruptCheckpointError, OSError) as e:  # missing, truncated, unreadable: name the key too
            raise CorruptCheckpointError(f"key {j.key!r}: {e}") from None
        if len(data) != n:
            raise CorruptCheckpointError(f"key {j.key!r}: short read from {fname}; the file is truncated")
        return data if isinstance(data, bytearray) else bytearray(data)  # torch.frombuffer wants it writable

    def _check_whole(self, j: ReadJob, data: _Bytes) -> None:
        """Check every block of a whole chunk whose bytes are ``data`` (what :meth:`_check`
        does for ``[0, length)``, without its partial-block arithmetic)."""
        k = first_bad_block(data, j.loc.crc32, self.block)
        if k is not None:
            self._mismatch(j, k * self.block, min((k + 1) * self.block, len(data)))

    def _mismatch(self, j: ReadJob, s: int, e: int) -> NoReturn:
        loc = j.loc
        raise CorruptCheckpointError(
            f"checksum mismatch in {loc.file} (bytes {loc.offset + s}..{loc.offset + e}) for key "
            f"{j.key!r}: the file is damaged. Restore it from a copy, or load another checkpoint"
        )

    def _check(self, j: ReadJob, a: int, b: int, lo: int, hi: int, head: _Bytes, mid: _Bytes, tail: _Bytes) -> None:
        """Check blocks ``[a, b)`` of a chunk whose bytes are ``head`` (``[a, lo)``),
        ``mid`` (``[lo, hi)``) and ``tail`` (``[hi, b)``), chaining CRC-32 across them."""
        blk, loc = self.block, j.loc
        for k in range(a // blk, max(-(-b // blk), a // blk + 1)):
            s, e = k * blk, min((k + 1) * blk, loc.length)
            crc = crc32(head[s - a :]) if s < lo else 0
            crc = crc32(mid[max(s, lo) - lo : max(min(e, hi) - lo, 0)], crc)
            if e > hi:
                crc = crc32(tail[max(s, hi) - hi : e - hi], crc)
            if crc != loc.crc32[k]:
                self._mismatch(j, s, e)


def _span(loc: ChunkLoc, lo: int, hi: int, block: int, verify: bool) -> tuple[int, int]:
    """Bytes ``[lo, hi)`` of a chunk as a :class:`Reader` reads them: rounded out to
    whole checksum blocks of the chunk when it verifies."""
    if not verify:
        return lo, hi
    return (lo // block) * block, min(-(-hi // block) * block, loc.length)


class FileRange(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """Bytes ``[start, stop)`` of data file ``file`` (absolute offsets)."""

    file: str
    start: int
    stop: int


def _merged(ranges: list[tuple[str, int, int]]) -> list[FileRange]:
    """Ranges by file and offset, those that overlap or touch made one."""
    out: list[FileRange] = []
    ranges.sort()
    for f, a, b in ranges:
        if out and out[-1].file == f and a <= out[-1].stop:
            if b > out[-1].stop:
                out[-1] = FileRange(f, out[-1].start, b)
            continue
        out.append(FileRange(f, a, b))
    return out


def read_ranges(jobs: Sequence[ReadJob], block: int, verify: bool) -> tuple[list[FileRange], list[FileRange]]:
    """What a :class:`Reader` reads for ``jobs``: the bytes the jobs need (exact), and
    the bytes it reads to get and verify them (each job's range rounded out to whole
    checksum blocks of its chunk when ``verify``); each merged by file. Every read the
    reader makes lies inside one range of the second list (it reads each job's
    rounded range, or runs of them that overlap or touch)."""
    exact = [(j.loc.file, j.loc.offset + j.lo, j.loc.offset + j.hi) for j in jobs if j.hi > j.lo]
    read = []
    for j in jobs:
        a, b = _span(j.loc, j.lo, j.hi, block, verify)
        if b > a:
            read.append((j.loc.file, j.loc.offset + a, j.loc.offset + b))
    return _merged(exact), _merged(read)


def read_verified(storage: Storage, loc: ChunkLoc, block: int, on_bad: Callable[[int], None] | None = None,
                  ) -> Iterator[bytes | bytearray]:
    """A whole chunk's bytes in pieces of at most 8 MiB (on an object store its
    ``read_batch``, a request each; memory stays bounded whatever a damaged manifest
    claims), each checksum block checked once it is complete. A block that does not
    match calls ``on_bad(block number)``, or raises :class:`CorruptCheckpointError`
    without it. A short file raises it too."""
    n = loc.length
    piece = _PIECE if storage.read_piece is not None else max(_PIECE, storage.read_batch)  # a request per piece
    if n == 0 and loc.crc32[0] != 0:
        _bad(on_bad, loc, 0, 0, 0)
    for k, start in enumerate(range(0, n, block)):
        end = min(start + block, n)
        crc = 0
        for p in range(start, end, piece):
            q = min(p + piece, end)
            data = storage.read(loc.file, loc.offset + p, q - p)
            if len(data) != q - p:
                raise CorruptCheckpointError(f"short read at byte {loc.offset + p} of {loc.file}: the file is truncated")
            crc = crc32(data, crc)
            yield data
        if crc != loc.crc32[k]:
            _bad(on_bad, loc, k, start, end)


def _bad(on_bad: Callable[[int], None] | None, loc: ChunkLoc, k: int, start: int, end: int) -> None:
    if on_bad is None:
        raise CorruptCheckpointError(
            f"checksum mismatch in {loc.file} (bytes {loc.offset + start}..{loc.offset + end}): the file is damaged"
        )
    on_bad(k)
