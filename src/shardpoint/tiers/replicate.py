"""File transfers between hosts over the checkpoint channel's side lane: replication
of a snapshot's files (in a background thread), and what a restore fetches (the
manifest and indexes whole, byte ranges of data files).

A :class:`Move` carries bytes ``[offset, offset + size)`` of a file in the sender's
step folder to a file of its own in the receiver's, each path relative to the step
folder of its end's host. Every rank runs :func:`transfer` on the moves it takes part
in (or on the same list as every other rank: tags are then numbered alike on every
rank). Files travel between memory maps of the step folders (no copy into the
process's heap), in blocks; each move first says whether its sender could read the
file. A receiver writes under a hidden temporary name (space reserved up front: a
full tmpfs is an error, never a SIGBUS) and renames the file into place only once
every byte arrived: a half-written replica is never counted.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Sequence

import msgspec
import torch

from ..collective import Comm
from ..errors import MemoryTierError, ShardpointError

#: Bytes per point-to-point message.
BLOCK = 64 << 20


def _blocks(size: int) -> list[tuple[int, int]]:
    return [(off, min(BLOCK, size - off)) for off in range(0, size, BLOCK)]


class Move(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """Bytes ``[offset, offset + size)`` of ``src_rel`` on rank ``src``'s host to a file of
    ``size`` bytes at ``dst_rel`` on rank ``dst``'s host: a whole file (``offset`` 0,
    ``size`` its size) or a byte range. ``name``: the checkpoint file the bytes are of.
    ``src_size``: the size the source file must have (-1: ``size``). ``tag``: the
    move's first tag on the side lane (its header; then one per block); 0 numbers
    the moves of one list in order (:func:`tagged`)."""

    src_rel: str
    name: str
    size: int
    src: int
    dst: int
    dst_rel: str
    offset: int = 0
    src_size: int = -1
    tag: int = 0


def span(size: int) -> int:
    """The tags one move of ``size`` bytes takes."""
    return 1 + len(_blocks(size))


def tagged(moves: Sequence[Move], first: int = 1) -> list[Move]:
    """``moves`` with their tags numbered in order from ``first`` (the same on every rank)."""
    out, tag = [], first
    for m in moves:
        out.append(msgspec.structs.replace(m, tag=tag))
        tag += span(m.size)
    return out


def _unmap(m: mmap.mmap | None) -> None:
    """Unmap now, or (a tensor over it still referenced by a finished transfer) when
    the last reference goes."""
    if m is not None:
        try:
            m.close()
        except BufferError:
            pass


class _Out:
    """Bytes ``[offset, offset + size)`` of a file to send, mapped read-only-private
    (or a zero block when the file cannot be read, or has not ``whole`` bytes)."""

    def __init__(self, path: str, size: int, offset: int = 0, whole: int = -1) -> None:
        self.ok, self.map, self.why = False, None, ""
        self.data = torch.zeros(min(BLOCK, size), dtype=torch.uint8)
        whole = size if whole < 0 else whole
        try:
            with open(path, "rb") as f:
                actual = os.fstat(f.fileno()).st_size
                if actual != whole or offset + size > whole:
                    self.why = f"{path} has {actual} bytes, {whole} expected"
                    return
                if size:
                    self.map = mmap.mmap(f.fileno(), whole, access=mmap.ACCESS_COPY)
                    self.data = torch.frombuffer(self.map, dtype=torch.uint8)[offset: offset + size]
            self.ok = True
        except OSError as e:
            self.why = f"{path}: {e.strerror or e}"

    def block(self, off: int, n: int) -> torch.Tensor:
        return self.data[off: off + n] if self.ok else self.data[:n]

    def close(self) -> None:
        self.data = torch.empty(0, dtype=torch.uint8)
        _unmap(self.map)
        self.map = None


class _In:
    """A file to receive: a hidden temporary file beside its final name, its space
    reserved, mapped; or a scratch block whose bytes are thrown away when the space
    cannot be had (the sender's bytes must still be taken)."""

    def __init__(self, folder: str, rel: str, size: int) -> None:
        self.final = os.path.join(folder, rel)
        self.tmp = ""
        self.map: mmap.mmap | None = None
        self.error = ""
        self.data = torch.empty(min(BLOCK, size), dtype=torch.uint8)
        self.ok = False
        d = os.path.dirname(self.final)
        try:
            os.makedirs(d, mode=0o700, exist_ok=True)
            self.tmp = os.path.join(d, f".{os.path.basename(self.final)}.part-{os.getpid()}-{os.urandom(4).hex()}")
            fd = os.open(self.tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                if size:
                    os.posix_fallocate(fd, 0, size)
                    self.map = mmap.mmap(fd, size, access=mmap.ACCESS_WRITE)
                    self.data = torch.frombuffer(self.map, dtype=torch.uint8)
            finally:
                os.close(fd)
            self.ok = True
        except OSError as e:
            self.error = f"cannot write {self.final} ({e.strerror or e})"
            self._drop()
            self.data = torch.empty(min(BLOCK, size), dtype=torch.uint8)

    def block(self, off: int, n: int) -> torch.Tensor:
        return self.data[off: off + n] if self.ok else self.data[:n]

    def _drop(self) -> None:
        self.data = torch.empty(0, dtype=torch.uint8)
        _unmap(self.map)
        self.map = None
        if self.tmp:
            try:
                os.unlink(self.tmp)
            except OSError:
                pass
            self.tmp = ""

    def finish(self, sender_ok: bool) -> None:
        """Rename into place when every byte arrived from a sender that read the file
        whole; else remove the temporary file."""
        if not (self.ok and sender_ok):
            self._drop()
            return
        self.data = torch.empty(0, dtype=torch.uint8)
        _unmap(self.map)
        self.map = None
        os.replace(self.tmp, self.final)
        self.tmp = ""


def transfer(comm: Comm, folder: str, moves: Sequence[Move], *, background: bool = False,
             progress: float | None = None) -> list[str]:
    """Run this rank's part of ``moves`` (every rank calls it, with the same list or
    with the moves it takes part in, tagged: :class:`Move`); ``folder`` is this host's
    step folder. Returns what went wrong with the moves this rank took part in (a
    file its sender could not read, no space to receive one), as messages naming the
    file; a move that went wrong leaves nothing behind. Raises
    :class:`ShardpointError` when a peer is gone (every temporary file removed).
    ``background``: called from a thread of :meth:`Comm.start_side`. ``progress``: as
    :meth:`Comm.exchange` (a restore's fetch: a vanished peer fails it in bounded time)."""
    me = comm.rank
    if any(m.tag == 0 for m in moves):
        moves = tagged(moves)
    outs: list[_Out] = []
    ins: list[tuple[_In, torch.Tensor, str]] = []
    sends: list[tuple[int, int, torch.Tensor]] = []
    recvs: list[tuple[int, int, torch.Tensor]] = []
    problems: list[str] = []
    try:
        for m in moves:
            size, src, dst, tag = m.size, m.src, m.dst, m.tag
            what = m.name if m.offset == 0 and m.src_size in (-1, size) else \
                f"bytes {m.offset}..{m.offset + size} of {m.name}"
            if src == dst:
                continue
            if src == me:
                out = _Out(os.path.join(folder, m.src_rel), size, m.offset, m.src_size)
                outs.append(out)
                if not out.ok:
                    problems.append(f"rank {me} could not send {what} to rank {dst}: {out.why}")
                sends.append((dst, tag, torch.tensor([1 if out.ok else 0], dtype=torch.uint8)))
                sends.extend((dst, tag + 1 + i, out.block(off, n)) for i, (off, n) in enumerate(_blocks(size)))
            elif dst == me:
                got = _In(folder, m.dst_rel, size)
                head = torch.zeros(1, dtype=torch.uint8)
                ins.append((got, head, f"{what} from rank {src}"))
                recvs.append((src, tag, head))
                recvs.extend((src, tag + 1 + i, got.block(off, n)) for i, (off, n) in enumerate(_blocks(size)))
        comm.exchange(sends, recvs, background=background, progress=progress)
        sends.clear()
        recvs.clear()
        for got, head, what in ins:
            if got.error:
                problems.append(f"rank {me} could not receive {what}: {got.error}")
            elif not head[0]:
                problems.append(f"rank {me} did not receive {what}: its sender could not read it")
            got.finish(bool(head[0]))
        ins.clear()
    except ShardpointError:
        raise
    except OSError as e:
        raise MemoryTierError(f"rank {me}: a transfer of snapshot files in {folder} failed ({e}); what it "
                              "carried is not counted") from e
    finally:
        sends.clear()
        recvs.clear()
        for got, _, _ in ins:
            got.finish(False)
        for out in outs:
            out.close()
    return problems
