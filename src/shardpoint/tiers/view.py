"""A memory snapshot's step folder on this host as a restore's load reads it: whole
files (the host's own, replicas linked in, the manifest and indexes fetched whole),
and byte ranges of other data files fetched by the restore
(``ranges/<name>/<start>-<stop>``). A read of a file the folder does not hold whole
is served from the ranges; a read of a file no present host holds (``rooted``) that
the ranges here do not cover falls through to the durable root's checkpoint of the
same save (``durable``), its bytes counted; bytes held nowhere raise
:class:`CorruptCheckpointError` naming the file and the bytes (the restore passes
the snapshot over)."""

from __future__ import annotations

import bisect
import os
from collections.abc import Collection, Mapping, Sequence

from ..errors import CorruptCheckpointError
from ..storage.base import Delegating, Storage
from .shm import PrivateStorage, held_ranges


class TieredView(Delegating):
    """The step folder ``inner`` with the byte ranges held under its ``ranges/``.
    ``sizes``: the data files' sizes (as the manifest records them), which a file held
    only in ranges reports. ``rooted``: the files (data files, indexes) no present
    host holds, read from ``durable`` (the root's checkpoint of the same step and save)
    where this folder does not hold the bytes asked for. ``names``: the files a load
    read (the report's pieces); ``from_root``: the bytes read from ``durable``, per file."""

    inner: PrivateStorage

    def __init__(self, inner: PrivateStorage, sizes: Mapping[str, int], *, durable: Storage | None = None,
                 rooted: Collection[str] = ()) -> None:
        super().__init__(inner)
        self.file_sizes = dict(sizes)
        self.durable = durable
        self.rooted = frozenset(rooted) if durable is not None else frozenset()
        self.from_root: dict[str, int] = {}
        self.names: set[str] = set()
        self.pieces: dict[str, list[tuple[int, int, str]]] = {}
        self._starts: dict[str, list[int]] = {}
        self._whole: dict[str, bool] = {}
        self.refresh()

    def refresh(self) -> None:
        """Look again at what the folder holds (after a fetch)."""
        self.pieces = held_ranges(self.inner.inner.root)
        self._starts = {n: [a for a, _, _ in v] for n, v in self.pieces.items()}
        self._whole = {}

    def whole(self, name: str) -> bool:
        """Whether the folder holds file ``name`` whole (at its size, for a data file)."""
        got = self._whole.get(name)
        if got is None:
            path = os.path.join(self.inner.inner.root, name)
            try:
                size = os.path.getsize(path)
                got = name not in self.file_sizes or size == self.file_sizes[name]
            except OSError:
                got = False
            self._whole[name] = got
        return got

    def holds(self, name: str, start: int, stop: int) -> bool:
        """Whether bytes ``[start, stop)`` of ``name`` are on this host (whole or in ranges)."""
        if stop <= start or self.whole(name):
            return True
        return self._cover(name, start, stop) is not None

    def _cover(self, name: str, start: int, stop: int) -> list[tuple[int, int, str, int]] | None:
        """The pieces that hold ``[start, stop)``, as ``(from, to, relpath, piece start)``; None when some byte is not held."""
        pieces, starts = self.pieces.get(name, []), self._starts.get(name, [])
        out, at = [], start
        while at < stop:
            i = bisect.bisect_right(starts, at) - 1
            best = max((p for p in pieces[: i + 1] if p[1] > at), key=lambda p: p[1], default=None)
            if best is None:
                return None
            to = min(best[1], stop)
            out.append((at, to, best[2], best[0]))
            at = to
        return out

    def _fill(self, name: str, offset: int, buf: memoryview) -> None:
        parts = self._cover(name, offset, offset + len(buf))
        if parts is None:
            raise CorruptCheckpointError(
                f"{self.url}/{name}: bytes {offset}..{offset + len(buf)} are not on this host (neither the file "
                "whole nor the ranges this restore fetched); the restore's plan missed a read")
        for a, b, rel, p0 in parts:
            fd = os.open(os.path.join(self.inner.inner.root, rel), os.O_RDONLY)
            try:
                view = buf[a - offset: b - offset]
                got = 0
                while got < len(view):
                    n = os.preadv(fd, [view[got:]], a - p0 + got)
                    if n <= 0:
                        raise CorruptCheckpointError(f"{self.url}/{rel}: short read; the fetched range is truncated")
                    got += n
            finally:
                os.close(fd)

    def _ranged(self, name: str) -> bool:
        return name in self.pieces and not self.whole(name)

    def _root(self, name: str, offset: int, length: int | None) -> Storage | None:
        """The durable checkpoint when bytes ``[offset, offset + length)`` of ``name`` are
        read from it: a file no present host holds, and not all of them here."""
        if name not in self.rooted or self.whole(name):
            return None
        if length is None:
            length = self.file_sizes[name] - offset if name in self.file_sizes else -1
        if length >= 0 and self._cover(name, offset, offset + length) is not None:
            return None
        return self.durable

    def _count(self, name: str, n: int) -> None:
        self.from_root[name] = self.from_root.get(name, 0) + n

    def read(self, name: str, offset: int = 0, length: int | None = None) -> bytes | bytearray:
        self.names.add(name)
        root = self._root(name, offset, length)
        if root is not None:
            data = root.read(name, offset, length)
            self._count(name, len(data))
            return data
        if not self._ranged(name):
            return self.inner.read(name, offset, length)
        n = self.file_sizes[name] - offset if length is None else length
        buf = bytearray(max(0, n))
        self._fill(name, offset, memoryview(buf))
        return buf

    def read_into(self, name: str, offset: int, buf: memoryview) -> None:
        self.names.add(name)
        root = self._root(name, offset, len(buf))
        if root is not None:
            root.read_into(name, offset, buf)
            self._count(name, len(buf))
            return
        if not self._ranged(name):
            self.inner.read_into(name, offset, buf)
            return
        self._fill(name, offset, buf)

    def readv_into(self, name: str, offset: int, bufs: Sequence[memoryview]) -> None:
        total = sum(len(b) for b in bufs)
        root = self._root(name, offset, total)
        if root is not None:
            self.names.add(name)
            root.readv_into(name, offset, bufs)
            self._count(name, total)
            return
        if not self._ranged(name):
            self.names.add(name)
            self.inner.inner.readv_into(name, offset, bufs)
            return
        for b in bufs:
            self.read_into(name, offset, b)
            offset += len(b)

    def exists(self, name: str) -> bool:
        return name in self.pieces or name in self.rooted or self.inner.exists(name)

    def size(self, name: str) -> int:
        if self._ranged(name) or (name in self.rooted and name in self.file_sizes):
            return self.file_sizes[name]
        if self.durable is not None and name in self.rooted and not self.whole(name):
            return self.durable.size(name)
        return self.inner.size(name)
