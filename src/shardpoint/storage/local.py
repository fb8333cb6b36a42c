"""Local filesystem storage: real files, fsync before a write returns, atomic
rename for the manifest and a directory fsync after it."""

from __future__ import annotations

import builtins
import errno
import os
import shutil
import stat
import threading
import uuid
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager

from ..errors import CorruptCheckpointError, StorageError, UsageError
from ..format.datafile import crc32
from ..format.names import check_name
from .base import Storage, byte_view

#: Buffers one preadv takes at most (Linux's IOV_MAX).
_IOV_MAX = 1024
#: Descriptors kept open inside keep_open() at most (a load from a thousand ranks' files
#: must not run into the process's limit of open files); others are opened per read.
_KEEP_OPEN = 64
#: Parts of a written file smaller than this are gathered, this many bytes a write.
_GATHER = 256 << 10


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_all(fd: int, view: memoryview) -> int:
    """Write all of ``view`` at ``fd``'s position; its length."""
    n = len(view)
    while view:
        view = view[os.write(fd, view) :]
    return n


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _named(e: BaseException, path: str) -> BaseException:
    """``e`` with the file it concerns: ``os.write`` reports ENOSPC without a name."""
    if isinstance(e, OSError) and e.errno is not None and e.filename is None:
        return type(e)(e.errno, e.strerror, path)
    return e


def _open_regular(path: str) -> int:
    """Open ``path`` for reading, refusing anything but a regular file: a FIFO (or
    a symlink to one) would block the open forever, a device would be read."""
    try:
        # O_NONBLOCK: opening a FIFO with no writer returns at once instead of blocking
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise CorruptCheckpointError(
            f"data file {path} is missing; the checkpoint is incomplete (restore the file or use another checkpoint)"
        ) from None
    except OSError as e:
        raise CorruptCheckpointError(f"data file {path} cannot be opened ({e.strerror}); the checkpoint is damaged") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise CorruptCheckpointError(
            f"{path} is not a regular file (a FIFO, device or directory); refusing to read it as checkpoint data"
        )
    return fd


class LocalStorage(Storage):
    """A directory on a local (or network-mounted POSIX) filesystem."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.root = os.path.abspath(os.fspath(path))
        self.url = self.root
        self.read_threads = local_read_threads()
        self._paths: dict[str, str] = {}
        self._open: dict[str, int] | None = None  # path -> descriptor, inside keep_open()
        self._open_depth = 0
        self._open_lock = threading.Lock()

    def _path(self, name: str) -> str:
        path = self._paths.get(name)
        if path is None:
            path = os.path.join(self.root, check_name(name))
            if len(self._paths) < 1 << 16:
                self._paths[name] = path
        return path

    @contextmanager
    def keep_open(self) -> Iterator[None]:
        """Reads inside it open each file once and keep the descriptor until it ends
        (a file replaced meanwhile is still read as it was when first opened)."""
        with self._open_lock:
            self._open_depth += 1
            if self._open is None:
                self._open = {}
        try:
            yield
        finally:
            with self._open_lock:
                self._open_depth -= 1
                if self._open_depth == 0:
                    fds, self._open = self._open or {}, None
                    for fd in fds.values():
                        os.close(fd)

    def _acquire(self, path: str) -> tuple[int, bool]:
        """A descriptor for reading ``path``, and whether the caller closes it (not
        one kept open inside :meth:`keep_open`)."""
        kept = self._open
        if kept is None:
            return _open_regular(path), True
        fd = kept.get(path)
        if fd is not None:
            return fd, False
        fd = _open_regular(path)
        with self._open_lock:
            if self._open is kept and path not in kept and len(kept) < _KEEP_OPEN:
                kept[path] = fd
                return fd, False
        return fd, True

    def _ensure_dir(self, path: str) -> None:
        if os.path.isdir(path):
            return
        parent = os.path.dirname(path)
        self._ensure_dir(parent)
        try:
            os.mkdir(path)
        except FileExistsError:
            if os.path.isdir(path):  # another rank or thread made it first
                return
            raise UsageError(
                f"{path} exists and is not a directory; a checkpoint is a directory of files. "
                "Save to another path, or move that file away"
            ) from None
        except OSError as e:
            raise StorageError(
                f"cannot create the checkpoint directory {path} ({e.strerror}); save to a path you can write to"
            ) from e
        _fsync_dir(parent)  # make the new directory entry durable

    def write_file(self, name: str, parts: Iterable[bytes | memoryview]) -> int:
        path = self._path(name)
        self._ensure_dir(os.path.dirname(path))
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        total = 0
        gathered = bytearray()  # small parts, written together: one system call for hundreds of small chunks
        try:
            for part in parts:
                view = byte_view(part)
                if len(view) < _GATHER:
                    gathered += view
                    if len(gathered) < _GATHER:
                        continue
                    view = memoryview(gathered)
                    gathered = bytearray()  # a new one: the old one stays exported to ``view``
                elif gathered:
                    total += _write_all(fd, memoryview(gathered))
                    gathered = bytearray()
                total += _write_all(fd, view)
            if gathered:
                total += _write_all(fd, memoryview(gathered))
            os.fsync(fd)
        except BaseException as e:
            os.close(fd)
            _unlink_quietly(path)  # a partial file only takes space (a full disk stays full)
            raise _named(e, path) from None
        os.close(fd)
        _fsync_dir(os.path.dirname(path))
        return total

    def _durable_tmp(self, name: str, data: bytes) -> tuple[str, str, str]:
        """``name``'s path, its directory (made if missing) and a temporary file beside
        it holding ``data``, fsynced: what an atomic write renames or links into place."""
        path = self._path(name)
        directory = os.path.dirname(path)
        self._ensure_dir(directory)
        tmp = os.path.join(directory, f".{os.path.basename(path)}.tmp-{uuid.uuid4().hex[:12]}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        except BaseException as e:
            os.close(fd)
            _unlink_quietly(tmp)
            raise _named(e, path) from None
        os.close(fd)
        return path, directory, tmp

    def write_atomic(self, name: str, data: bytes) -> None:
        path, directory, tmp = self._durable_tmp(name, data)
        try:
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
        _fsync_dir(directory)

    def create_new(self, name: str, data: bytes) -> bool:
        """As :meth:`write_atomic`, but the temporary file is hard-linked to ``name``
        instead of renamed over it: ``link`` fails on an existing name, so of two
        writers exactly one creates it. Where the filesystem has no hard links, the
        store's weaker form (a look-up, then the rename)."""
        path, directory, tmp = self._durable_tmp(name, data)
        try:
            os.link(tmp, path)
        except FileExistsError:
            return False
        except OSError as e:
            if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK):
                raise _named(e, path) from None
            if os.path.exists(path):  # no hard links here (some FUSE filesystems)
                return False
            os.replace(tmp, path)
            _fsync_dir(directory)
            return True
        finally:
            _unlink_quietly(tmp)
        _fsync_dir(directory)
        return True

    def sizes(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for dirpath, _dirs, files in os.walk(self.root):
            rel = os.path.relpath(dirpath, self.root)
            for f in files:
                try:
                    size = os.stat(os.path.join(dirpath, f)).st_size
                except FileNotFoundError:  # removed since the listing
                    continue
                out[f if rel == "." else f"{rel}/{f}"] = size
        return out

    def read(self, name: str, offset: int = 0, length: int | None = None) -> bytes | bytearray:
        """A whole file (``length`` None: a manifest, an index, a pointer) as ``bytes``,
        read into a new bytes object without zeroing it first; a range as a writable
        ``bytearray``."""
        path = self._path(name)
        fd, owned = self._acquire(path)
        try:
            size = os.fstat(fd).st_size
            whole = length is None
            if length is None:
                length = max(size - offset, 0)
            if offset + length > size:
                raise CorruptCheckpointError(
                    f"data file {path} is truncated: wanted bytes {offset}..{offset + length}, the file has {size}; "
                    "the checkpoint is damaged (restore the file or use another checkpoint)"
                )
            if whole:
                data = os.pread(fd, length, offset)
                if len(data) == length:
                    return data
            buf = bytearray(length)
            view = memoryview(buf)
            got = 0
            while got < length:
                n = os.preadv(fd, [view[got:]], offset + got)
                if n == 0:
                    raise CorruptCheckpointError(f"data file {path} ended early at byte {offset + got}; the checkpoint is damaged")
                got += n
            return buf
        finally:
            if owned:
                os.close(fd)

    def read_into(self, name: str, offset: int, buf: memoryview) -> None:
        path = self._path(name)
        fd, owned = self._acquire(path)
        try:
            got, length = 0, len(buf)
            while got < length:
                n = os.preadv(fd, [buf[got:]], offset + got)
                if n == 0:
                    raise CorruptCheckpointError(
                        f"data file {path} is truncated: wanted bytes {offset}..{offset + length}, it ends at "
                        f"{offset + got}; the checkpoint is damaged (restore the file or use another checkpoint)"
                    )
                got += n
        finally:
            if owned:
                os.close(fd)

    def read_into_crcs(self, name: str, offset: int, buf: memoryview, block: int, piece: int) -> list[int]:
        path = self._path(name)
        fd, owned = self._acquire(path)
        try:
            crcs, n = [], len(buf)
            for s in range(0, n, block):
                e = min(s + block, n)
                crc, p = 0, s
                while p < e:
                    v = buf[p : min(p + piece, e)]
                    got = os.preadv(fd, [v], offset + p)
                    if got < len(v):
                        if got == 0:
                            raise CorruptCheckpointError(
                                f"data file {path} is truncated: wanted bytes {offset}..{offset + n}, it ends at "
                                f"{offset + p}; the checkpoint is damaged (restore the file or use another checkpoint)"
                            )
                        v = v[:got]
                    crc = crc32(v, crc)
                    p += got
                crcs.append(crc)
            return crcs
        finally:
            if owned:
                os.close(fd)

    def readv_into(self, name: str, offset: int, bufs: Sequence[memoryview]) -> None:
        path = self._path(name)
        fd, owned = self._acquire(path)
        try:
            pending, at = [b for b in bufs if len(b)], offset
            while pending:
                n = os.preadv(fd, pending[:_IOV_MAX], at)
                if n == 0:
                    raise CorruptCheckpointError(
                        f"data file {path} is truncated: it ends at byte {at}, before the "
                        f"{sum(len(b) for b in pending)} bytes wanted from there; the checkpoint is damaged "
                        "(restore the file or use another checkpoint)"
                    )
                at += n
                done = 0
                while done < len(pending) and n >= len(pending[done]):
                    n -= len(pending[done])
                    done += 1
                pending = pending[done:]
                if n:
                    pending[0] = pending[0][n:]
        finally:
            if owned:
                os.close(fd)

    def exists(self, name: str) -> bool:
        return os.path.exists(self._path(name))

    def size(self, name: str) -> int:
        return os.path.getsize(self._path(name))

    def list(self) -> builtins.list[str]:
        out = []
        for dirpath, _dirs, files in os.walk(self.root):
            rel = os.path.relpath(dirpath, self.root)
            for f in files:
                out.append(f if rel == "." else f"{rel}/{f}")
        return sorted(out)

    def remove(self, name: str) -> None:
        try:
            os.unlink(self._path(name))
        except (FileNotFoundError, NotADirectoryError):
            pass

    def remove_all(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)
        parent = os.path.dirname(self.root)
        if os.path.isdir(parent):
            _fsync_dir(parent)

    def child(self, name: str) -> LocalStorage:
        return LocalStorage(self._path(name))

    def parent(self) -> LocalStorage:
        return LocalStorage(os.path.dirname(self.root))

    def list_dirs(self) -> builtins.list[str]:
        try:
            return sorted(e.name for e in os.scandir(self.root) if e.is_dir())
        except (FileNotFoundError, NotADirectoryError):
            return []


def local_read_threads() -> int:
    """Parallel reads per rank on a local disk: this rank's share of the cores it may
    run on (the ranks on this host: ``LOCAL_WORLD_SIZE``, which torchrun sets), at
    least 1 and at most 4. A read from the page cache is a copy by the CPU, so reads
    beyond the cores only wait for each other (on 2 cores, 2 ranks with 4 threads
    each load 1.2x slower than with 1)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        cores = os.cpu_count() or 1
    try:
        local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        local = 1
    return max(1, min(4, cores // local))
