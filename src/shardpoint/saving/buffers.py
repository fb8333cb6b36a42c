"""Buffers: how the bytes a rank writes get from its tensors to the writer.

Only what this rank writes (and its replica rows to checksum) is ever touched;
a replica another rank writes is never copied whole to the host. Three ways:

- **Blocking, CPU tensor**: no copy; the writer streams the tensor's own memory
  (a non-contiguous view is made contiguous when its turn comes, one at a time).
- **Blocking, device tensor**: through a :class:`Pool` of a few fixed host slots
  (pinned with CUDA), reused for every piece: piece k+1 is copied (``non_blocking``,
  on a copy stream of its own) while the writer writes piece k. Host memory is the
  pool, whatever the size of the local state.
- **Asynchronous**: :class:`StagingBuffer` copies the rows this rank writes into one host
  buffer reused across saves (pinned with CUDA): before ``save`` returns
  (``blocking=False``), or in a background thread while the caller's next forward
  and backward run (``overlap=True``; see docs/async.md). The version guard
  (:func:`versions`, :func:`check_versions`) makes a save whose source changed
  during its copy fail instead of committing a mixed state.
"""

from __future__ import annotations

import collections
import os
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from .._memory import COMPLEX, bytes_of
from ..errors import SaveAbortedError
from ..format import datafile
from ..runtime import PROCESS

#: Bytes of one slot of the blocking save's staging pool (``SHARDPOINT_STAGING_SLOT_MB``).
SLOT_BYTES = int(float(os.environ.get("SHARDPOINT_STAGING_SLOT_MB", 64)) * (1 << 20))
#: Slots in the pool: up to ``SLOTS - 1`` pieces are copied ahead of the one being written.
SLOTS = int(os.environ.get("SHARDPOINT_STAGING_SLOTS", 4))
_ALIGN = 64


def needs_pool(v: torch.Tensor) -> bool:
    """Whether the blocking save copies ``v`` through the pool (device memory)."""
    return not v.is_cpu or PROCESS.seams.force_pool


def byte_view(v: torch.Tensor) -> torch.Tensor:
    """``v``'s bytes as a flat uint8 tensor on its device (contiguous first if it is not)."""
    v = v.detach()
    if not v.is_contiguous():
        v = v.contiguous()
    flat = v.reshape(-1)
    return flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)


def _cuda_stream(device: torch.device) -> Any:
    """This thread's copy stream for ``device`` (one per device and thread)."""
    cache = PROCESS.cuda_streams.__dict__.setdefault("by_device", {})
    s = cache.get(device)
    if s is None:
        s = cache[device] = torch.cuda.Stream(device=device)
    return s


def _host(nbytes: int, pinned: bool) -> torch.Tensor:
    PROCESS.seams.counters.host_allocated += nbytes
    return torch.empty(max(nbytes, 1), dtype=torch.uint8, pin_memory=pinned)


class Pool:
    """A few fixed host slots, reused for every piece the blocking save copies: at
    most ``slots`` x ``slot_bytes`` of host memory (less while no tensor needs a
    whole slot)."""

    def __init__(self, slot_bytes: int = SLOT_BYTES, slots: int = SLOTS) -> None:
        self.slot_bytes, self.n = max(slot_bytes, _ALIGN), max(slots, 2)
        self.slots: list[torch.Tensor] = []
        self.pinned = False

    @property
    def nbytes(self) -> int:
        return sum(s.numel() for s in self.slots)

    @property
    def piece(self) -> int:
        """Bytes of one piece: the size of a slot as allocated."""
        return self.slots[0].numel() if self.slots else self.slot_bytes

    def ready(self, pinned: bool, need: int) -> None:
        """Have slots of at least ``min(need, slot_bytes)`` bytes (allocated again,
        pinned, if they are pageable and pinned is wanted)."""
        size = -(-min(max(need, 1), self.slot_bytes) // _ALIGN) * _ALIGN
        if self.slots and (self.pinned or not pinned) and self.slots[0].numel() >= size:
            return
        self.slots = []
        self.pinned = pinned
        self.slots = [_host(size, pinned) for _ in range(self.n)]


class Copier:
    """Streams the bytes of ``tensors`` through ``pool``, piece by piece, keeping up to
    ``slots - 1`` pieces copied ahead of the one the consumer holds: on CUDA the copy
    of the next pieces (on a copy stream) overlaps the writing of this one.

    Consume with :meth:`pieces` tensor by tensor, in order. A piece is valid until
    the next one is asked for (the storages write a part before taking the next)."""

    def __init__(self, pool: Pool, tensors: Sequence[torch.Tensor]) -> None:
        self.pool, self.tensors = pool, list(tensors)
        cuda = any(t.device.type == "cuda" for t in self.tensors)
        pool.ready(cuda and torch.cuda.is_available(), max((t.numel() * t.element_size() for t in self.tensors), default=1))
        self._jobs = self._all_jobs()
        self._ahead: collections.deque[tuple[int, torch.Tensor, Any]] = collections.deque()
        self._slot = 0
        self._started: set[torch.device] = set()

    def _all_jobs(self) -> Iterator[tuple[int, torch.Tensor]]:
        step = self.pool.piece
        for i, t in enumerate(self.tensors):
            flat = byte_view(t)
            for off in range(0, flat.numel(), step):
                yield i, flat[off : off + step]

    def _enqueue(self) -> bool:
        job = next(self._jobs, None)
        if job is None:
            return False
        i, src = job
        slot = self.pool.slots[self._slot % len(self.pool.slots)]
        self._slot += 1
        dst = slot[: src.numel()]
        event = None
        if src.device.type == "cuda":
            stream = _cuda_stream(src.device)
            if src.device not in self._started:  # read the values the caller's queued kernels leave
                stream.wait_stream(torch.cuda.current_stream(src.device))
                self._started.add(src.device)
            with torch.cuda.stream(stream):
                dst.copy_(src, non_blocking=True)
                event = torch.cuda.Event()
                event.record(stream)
        else:
            dst.copy_(src)
        PROCESS.seams.counters.pooled += src.numel()
        self._ahead.append((i, dst, event))
        return True

    def pieces(self, i: int) -> Iterator[memoryview]:
        """The bytes of tensor ``i``, as views of pool slots."""
        while True:
            while len(self._ahead) < len(self.pool.slots) - 1 and self._enqueue():
                pass
            if not self._ahead or self._ahead[0][0] != i:
                return
            _, dst, event = self._ahead.popleft()
            if event is not None:
                event.synchronize()
            self._enqueue()  # one more piece copied while this one is written (slots: ahead + this one)
            yield dst.numpy().data.cast("B")


class Source:
    """A tensor the writer streams: dtype and shape for the header, bytes on demand."""

    __slots__ = ("tensor", "copier", "index")

    def __init__(self, tensor: torch.Tensor, copier: Copier | None = None, index: int = 0) -> None:
        self.tensor, self.copier, self.index = tensor, copier, index

    @property
    def dtype(self) -> torch.dtype:
        return self.tensor.dtype

    @property
    def shape(self) -> torch.Size:
        return self.tensor.shape

    def numel(self) -> int:
        return self.tensor.numel()

    def element_size(self) -> int:
        return self.tensor.element_size()

    def pieces(self) -> Iterator[memoryview]:
        if self.copier is not None:
            yield from self.copier.pieces(self.index)
            return
        t = self.tensor
        if t.numel():
            yield cpu_bytes(t)


def cpu_bytes(t: torch.Tensor, n: int | None = None, dtype: torch.dtype | None = None) -> memoryview:
    """The bytes of CPU tensor ``t`` (not empty), in place: a contiguous tensor
    without a conjugate or negative bit (any dtype, one that requires grad too) as a
    slice of the process's memory (:func:`shardpoint._memory.bytes_of`: half the
    instructions of ``t.numpy().data``); any other (a view that needs a copy, a
    conjugate or negative view) through :func:`byte_view`. ``n`` and ``dtype``:
    ``t.nbytes`` and ``t.dtype``, where the caller has them (only a complex tensor
    can be conjugate)."""
    if t.is_contiguous() and not t.is_neg() and not ((dtype is None or dtype in COMPLEX) and t.is_conj()):
        return bytes_of(t, n)
    return byte_view(t).numpy().data.cast("B")


def sources(views: Sequence[torch.Tensor], pool: Pool) -> list[Source]:
    """One :class:`Source` per view, in the order the writer consumes them: CPU views
    stream in place, device views (all of them through one :class:`Copier`) through
    ``pool``."""
    pooled = [needs_pool(v) for v in views]
    if not any(pooled):  # the common case on a CPU: every view streams in place
        return [Source(v) for v in views]
    dev = [v for v, p in zip(views, pooled) if p]
    copier = Copier(pool, dev) if dev else None
    out, j = [], 0
    for v, p in zip(views, pooled):
        if p:
            out.append(Source(v, copier, j))
            j += 1
        else:
            out.append(Source(v))
    return out


def block_crcs_of(views: Sequence[torch.Tensor], pool: Pool) -> list[list[int]]:
    """The block CRCs of each view's bytes (what the writer would record), without a
    host copy of a whole view: CPU views in place, device views through ``pool``."""
    block = datafile.CRC_BLOCK
    out = []
    for src in sources(views, pool):
        crcs: list[int] = []
        crc, filled = 0, 0
        for view in src.pieces():
            i = 0
            while i < len(view):
                piece = view[i : i + block - filled]
                crc = datafile.crc32(piece, crc)
                filled += len(piece)
                i += len(piece)
                if filled == block:
                    crcs.append(crc)
                    crc, filled = 0, 0
        if filled or not crcs:
            crcs.append(crc)
        out.append(crcs)
    return out


def pool() -> Pool:
    """The process's blocking-save pool (made on first use, then reused)."""
    p = PROCESS.pool
    if not isinstance(p, Pool):
        p = PROCESS.pool = Pool()
    return p


def staging() -> StagingBuffer:
    """The process's asynchronous staging buffer (made on first use, then reused)."""
    s = PROCESS.staging
    if not isinstance(s, StagingBuffer):
        s = PROCESS.staging = StagingBuffer()
    return s


# -- asynchronous staging ------------------------------------------------------------------


class StagingBuffer:
    """One host buffer reused across saves that holds a copy of the rows this rank
    writes (pinned when any of them is on a GPU; a pageable buffer is replaced by a
    pinned one the first time GPU tensors come)."""

    def __init__(self) -> None:
        self.buf: torch.Tensor | None = None
        self.pinned = False

    @property
    def nbytes(self) -> int:
        return 0 if self.buf is None else self.buf.numel()

    def allocate(self, views: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Host tensors shaped like ``views`` in the buffer (grown when too small)."""
        offs, total = [], 0
        for v in views:
            offs.append(total)
            total += -(-v.numel() * v.element_size() // _ALIGN) * _ALIGN
        pinned = any(v.device.type == "cuda" for v in views) and torch.cuda.is_available()
        if self.buf is None or self.buf.numel() < total or (pinned and not self.pinned):
            self.buf = None  # free the old one before allocating the new
            self.buf = _host(total, pinned)
            self.pinned = pinned
        out = []
        for v, off in zip(views, offs):
            n = v.numel() * v.element_size()
            if n == 0:
                out.append(torch.empty(v.shape, dtype=v.dtype))
                continue
            out.append(self.buf[off : off + n].view(v.dtype).view(v.shape))
        return out


def mark(views: Sequence[torch.Tensor]) -> dict[torch.device, Any]:
    """A CUDA event on the caller's current stream of each device in ``views``: the
    copy waits for what the caller queued before the save, and no more."""
    events = {}
    for v in views:
        if v.device.type == "cuda" and v.device not in events:
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(v.device))
            events[v.device] = ev
    return events


def copy_into(dsts: Sequence[torch.Tensor], views: Sequence[torch.Tensor], after: dict[torch.device, Any]) -> None:
    """Copy ``views`` into the host tensors ``dsts``: device tensors on a copy stream
    per device (after the events ``after``), waiting for exactly those copies."""
    PROCESS.seams.fire_copy("start")
    pending = []
    for d, v in zip(dsts, views):
        if v.numel() == 0:
            continue
        if v.device.type == "cuda":
            stream = _cuda_stream(v.device)
            with torch.cuda.stream(stream):
                if v.device in after:
                    stream.wait_event(after.pop(v.device))
                d.copy_(v.detach(), non_blocking=True)
            pending.append(stream)
        else:
            d.copy_(v.detach())
    done = []
    for s in dict.fromkeys(pending):  # each copy stream once, whatever its device
        ev = torch.cuda.Event()
        ev.record(s)
        done.append(ev)
    for ev in done:
        ev.synchronize()
    PROCESS.seams.fire_copy("done")


# -- the version guard -----------------------------------------------------------------------


def versions(views: Sequence[torch.Tensor]) -> list[int | None]:
    """Each tensor's version counter (bumped by every in-place change); None where a
    tensor has none (inference tensors)."""
    out: list[int | None] = []
    for v in views:
        try:
            out.append(v._version)
        except RuntimeError:  # inference-mode tensors keep no version counter
            out.append(None)
    return out


def check_versions(keys: Sequence[str], views: Sequence[torch.Tensor], before: Sequence[int | None]) -> None:
    """Raise naming the first key whose tensor changed since ``before`` was taken."""
    for key, v, b in zip(keys, views, before):
        if b is None:
            continue
        try:
            now = v._version
        except RuntimeError:  # pragma: no cover - a tensor does not lose its counter
            continue
        if now != b:
            changed = [k for k, w, c in zip(keys, views, before) if c is not None and w._version != c]
            raise SaveAbortedError(
                f"key {key!r} was modified while the overlapped save was copying it (its version counter went "
                f"from {b} to {now}; {len(changed)} key(s) changed: {changed[:5]}); the save is abandoned and "
                "nothing was committed. Do not change saved tensors before handle.wait_staged() returns (an "
                "optimizer in the state waits by itself); see docs/async.md"
            )
