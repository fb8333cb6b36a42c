"""The storage interface: one checkpoint directory (or object-store prefix).

Everything above this layer speaks in file *names* relative to the checkpoint
root; a storage resolves them. Names never contain ``..``, never start with
``/`` and are checked by :func:`check_name` before any I/O, so a hostile
manifest cannot make a reader touch a file outside the checkpoint.
"""

from __future__ import annotations

import builtins
import re
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from contextlib import AbstractContextManager, nullcontext

from ..errors import CorruptCheckpointError
from ..format.datafile import crc32

_NAME = re.compile(r"^[A-Za-z0-9_.\-]+(/[A-Za-z0-9_.\-]+)*$")


def byte_view(data: bytes | bytearray | memoryview) -> memoryview:
    """``data`` as a flat view of unsigned bytes (a tensor's buffer may come as a
    typed or shaped view), without a copy."""
    view = memoryview(data)
    return view if view.ndim == 1 and view.format == "B" else view.cast("B")


class Storage(ABC):
    """A checkpoint location. Implementations: :class:`LocalStorage` (default)
    and :class:`FsspecStorage` (any fsspec URL, e.g. ``s3://``)."""

    #: The location as the user gave it (a path or URL), for messages.
    url: str

    #: The most bytes a verified load asks for in one :meth:`read_into` of a large
    #: tensor (and one scattered read of small whole chunks covers): it is read in
    #: pieces of this size, each checksummed right after its read while its bytes are
    #: still in the CPU's cache (``benchmarks/crc_piece_bench.py`` on this project's
    #: Intel machine: a CRC after 256 KiB reads adds 12-17% to a plain read, after 1 MiB
    #: 39-51%, after 4 MiB 57-63%; a kernel copy that large leaves less of its
    #: destination in cache). None: the whole range in one call (an object store, which
    #: splits a large range into concurrent requests itself and pays a round trip per
    #: call).
    read_piece: int | None = 256 << 10

    #: The most bytes one read of neighbouring small chunks covers: a load reads chunks
    #: of at most ``read_batch // 8`` bytes that lie next to each other in a file with
    #: one call (a few microseconds a chunk locally; one request instead of many on an
    #: object store) and places them from that buffer.
    read_batch: int = 8 << 20

    #: Reads a load runs at once on each rank (``SHARDPOINT_IO_THREADS`` overrides it):
    #: enough to hide an object store's round trips.
    read_threads: int = 4

    @abstractmethod
    def write_file(self, name: str, parts: Iterable[bytes | memoryview]) -> int:
        """Write ``parts`` in order to ``name`` and make it durable before returning
        (fsync on a local disk; a completed upload on an object store). Returns the
        number of bytes written."""

    @abstractmethod
    def write_atomic(self, name: str, data: bytes) -> None:
        """Make ``name`` hold ``data`` all at once: readers see the old content or the
        new, never a part (temp file + fsync + rename + directory fsync locally; one
        PUT on an object store)."""

    @abstractmethod
    def read(self, name: str, offset: int = 0, length: int | None = None) -> bytes | bytearray:
        """Read ``length`` bytes (all when None) from ``offset`` (a ``bytearray`` where
        the storage can fill one without a copy). Raises
        :class:`CorruptCheckpointError` naming the file when it is missing or shorter."""

    def read_into(self, name: str, offset: int, buf: memoryview) -> None:
        """Fill ``buf`` with ``len(buf)`` bytes of ``name`` from ``offset``. Storages that
        can read without an intermediate copy override this."""
        data = self.read(name, offset, len(buf))
        if len(data) != len(buf):
            raise CorruptCheckpointError(f"{name}: short read at byte {offset}; the file is truncated")
        buf[:] = data

    def read_into_crcs(self, name: str, offset: int, buf: memoryview, block: int, piece: int) -> list[int]:
        """Fill ``buf`` as :meth:`read_into` does, ``piece`` bytes at a time, and return
        the CRC-32 of each ``block`` bytes of it (the last one may be short): each
        piece's CRC is computed right after its read, while its bytes are still in the
        CPU's cache, and chained into its block's. A local disk does the same in one
        loop over its file descriptor."""
        crcs = []
        for s in range(0, len(buf), block):
            e = min(s + block, len(buf))
            crc = 0
            for p in range(s, e, piece):
                v = buf[p : min(p + piece, e)]
                self.read_into(name, offset + p, v)
                crc = crc32(v, crc)
            crcs.append(crc)
        return crcs

    def keep_open(self) -> AbstractContextManager[None]:
        """Within it, reads may keep each file open between calls (a load's many reads
        of one data file open it once). Nothing here; a local disk keeps descriptors."""
        return nullcontext()

    def readv_into(self, name: str, offset: int, bufs: Sequence[memoryview]) -> None:
        """Fill ``bufs`` in order with the bytes of ``name`` from ``offset`` on (one range,
        scattered). Here one :meth:`read` of the range and a copy into each buffer;
        a local disk reads straight into them with one system call."""
        if len(bufs) == 1:
            self.read_into(name, offset, bufs[0])
            return
        total = sum(len(b) for b in bufs)
        data = memoryview(self.read(name, offset, total))
        if len(data) != total:
            raise CorruptCheckpointError(f"{name}: short read at byte {offset}; the file is truncated")
        at = 0
        for b in bufs:
            b[:] = data[at : at + len(b)]
            at += len(b)

    def create_new(self, name: str, data: bytes) -> bool:
        """Make ``name`` hold ``data`` all at once, only if ``name`` does not exist yet;
        False (nothing written) when it does. Durable on return, like :meth:`write_atomic`.

        The two-attempt race is decided by the store where it can: a hard link locally
        (``link`` fails on an existing name), ``If-None-Match: *`` on S3. Here, for
        stores with neither, the weaker form: a look-up, then the write, then a read
        back (two writers racing within that window may both see their own bytes)."""
        if self.exists(name):
            return False
        self.write_atomic(name, data)
        return bytes(self.read(name)) == bytes(data)

    def sizes(self) -> dict[str, int]:
        """Every file under this location (as :meth:`list` names them) with its size in
        bytes: one listing where the store gives sizes with it (S3), else a look-up per file."""
        return {name: self.size(name) for name in self.list()}

    @abstractmethod
    def exists(self, name: str) -> bool:
        """Whether ``name`` exists."""

    @abstractmethod
    def size(self, name: str) -> int:
        """Size of ``name`` in bytes."""

    @abstractmethod
    def list(self) -> builtins.list[str]:
        """Names of the files under this location (recursively, relative)."""

    @abstractmethod
    def remove(self, name: str) -> None:
        """Remove ``name`` if it exists."""

    @abstractmethod
    def remove_all(self) -> None:
        """Remove this location and everything under it (used for leftovers of
        failed saves and by retention)."""

    @abstractmethod
    def child(self, name: str) -> Storage:
        """The storage for a sub-location (``root.child("step-00000100")``)."""

    @abstractmethod
    def list_dirs(self) -> builtins.list[str]:
        """Names of the immediate sub-locations."""

    def parent(self) -> Storage:
        """The location that holds this one (a manager's root holds its step
        folders): incremental references (``../<folder>/<file>``) resolve through it.
        Storages that carry a connection override this to keep it."""
        from . import storage_for

        head = self.url.rstrip("/").rsplit("/", 1)[0]
        return storage_for(head or "/")


class Delegating(Storage):
    """A storage that hands every call to ``inner``: the base of wrappers that change
    a few calls (reading through references; the failure tests' full disk and
    killed writer) and pass the rest through."""

    def __init__(self, inner: Storage) -> None:
        self.inner, self.url = inner, inner.url
        self.read_piece, self.read_batch, self.read_threads = inner.read_piece, inner.read_batch, inner.read_threads

    def write_file(self, name: str, parts: Iterable[bytes | memoryview]) -> int:
        return self.inner.write_file(name, parts)

    def write_atomic(self, name: str, data: bytes) -> None:
        self.inner.write_atomic(name, data)

    def read(self, name: str, offset: int = 0, length: int | None = None) -> bytes | bytearray:
        return self.inner.read(name, offset, length)

    def read_into(self, name: str, offset: int, buf: memoryview) -> None:
        self.inner.read_into(name, offset, buf)

    def read_into_crcs(self, name: str, offset: int, buf: memoryview, block: int, piece: int) -> list[int]:
        if type(self).read_into is not Delegating.read_into:  # a wrapper that changes reads: through it
            return super().read_into_crcs(name, offset, buf, block, piece)
        return self.inner.read_into_crcs(name, offset, buf, block, piece)

    def keep_open(self) -> AbstractContextManager[None]:
        return self.inner.keep_open()

    def create_new(self, name: str, data: bytes) -> bool:
        if type(self).write_atomic is not Delegating.write_atomic:  # a wrapper that changes writes: through it
            return super().create_new(name, data)
        return self.inner.create_new(name, data)

    def sizes(self) -> dict[str, int]:
        return self.inner.sizes()

    def exists(self, name: str) -> bool:
        return self.inner.exists(name)

    def size(self, name: str) -> int:
        return self.inner.size(name)

    def list(self) -> builtins.list[str]:
        return self.inner.list()

    def remove(self, name: str) -> None:
        self.inner.remove(name)

    def remove_all(self) -> None:
        self.inner.remove_all()

    def child(self, name: str) -> Storage:
        return self.inner.child(name)

    def list_dirs(self) -> builtins.list[str]:
        return self.inner.list_dirs()

    def parent(self) -> Storage:
        return self.inner.parent()
