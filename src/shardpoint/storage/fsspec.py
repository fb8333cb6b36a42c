"""Object stores and other fsspec filesystems: ``s3://``, ``gs://``, ``memory://``...

The commit rule of the local storage holds unchanged on an object store, because
each of its two write paths maps to one S3 operation with all-or-nothing
visibility:

- :meth:`FsspecStorage.write_file` streams the parts through fsspec's buffered
  file. On S3 that is a multipart upload in parts of :data:`BLOCK_SIZE` bytes; the
  object appears only when ``CompleteMultipartUpload`` returns, so a killed writer
  leaves no object (only an unfinished upload, which a bucket lifecycle rule
  should expire). A write that fails in Python aborts the upload.
- :meth:`FsspecStorage.write_atomic` sends the manifest in one ``PUT``.

Threads: the core reads and writes from a thread pool, all through one
filesystem object. That is safe with s3fs: its blocking methods hand each
request to fsspec's single event-loop thread and wait for the answer, so
requests from many threads run concurrently on that loop. Each write opens its
own file object (file objects are not shared between threads), and the client
session is created once, under a lock, before the first request. Listings are
never cached (``use_listings_cache=False``), so a manifest another process
committed is seen at once. After ``fork`` fsspec starts a fresh loop in the
child; ranks started with ``spawn`` (torchrun, ``torch.multiprocessing``) are
unaffected.
"""

from __future__ import annotations

import builtins
import os
import threading
from collections.abc import Iterable
from typing import Any, NoReturn

from ..errors import CorruptCheckpointError
from .base import Storage, check_name


def _env_size(var: str, default: int) -> int:
    raw = os.environ.get(var)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{var}={raw!r} is not a whole number of bytes (e.g. {default})") from None
    if value <= 0:
        raise ValueError(f"{var}={raw!r} must be a positive number of bytes")
    return value


#: Part size of a multipart upload, in bytes (environment: ``SHARDPOINT_S3_BLOCK_SIZE``).
#: S3 needs at least 5 MiB and allows at most 10,000 parts, so the default of
#: 64 MiB gives objects of up to 625 GiB; raise it for larger data files. One
#: writer holds about two blocks in memory.
BLOCK_SIZE = _env_size("SHARDPOINT_S3_BLOCK_SIZE", 64 << 20)

#: Filesystems whose "directories" are key prefixes that vanish with their last object.
_BUCKETED = ("s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl", "oss", "r2")

_CONNECT_LOCK = threading.Lock()


class FsspecStorage(Storage):
    """A prefix of any fsspec filesystem; ``s3://bucket/prefix`` needs
    ``pip install shardpoint[s3]``.

    Args:
        url: ``protocol://location``, e.g. ``s3://bucket/run1/step-100``.
        storage_options: passed to the filesystem (for s3fs: ``key``, ``secret``,
            ``client_kwargs={"endpoint_url": ...}``, ``profile``...). Without them,
            s3fs finds credentials and endpoint the usual way (``AWS_*``
            environment variables, ``~/.aws``, instance roles).
    """

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None, *, _fs: Any = None) -> None:
        self.url = url.rstrip("/") if not url.endswith("://") else url
        if _fs is None:
            try:
                from fsspec.core import url_to_fs  # type: ignore[import-untyped]
            except ImportError:
                raise ImportError(
                    f"saving to {url} needs fsspec (and s3fs for s3://): pip install 'shardpoint[s3]'"
                ) from None
            options = dict(storage_options or {})
            options.setdefault("use_listings_cache", False)
            try:
                fs, root = url_to_fs(url, **options)
            except TypeError:
                if (storage_options or {}).get("use_listings_cache") is not None:
                    raise
                options.pop("use_listings_cache")  # a filesystem without a listings cache
                fs, root = url_to_fs(url, **options)
        else:
            fs, root = _fs, _fs._strip_protocol(url)
        self.fs = fs
        self.root: str = root.rstrip("/") or root

    def __repr__(self) -> str:
        return f"FsspecStorage({self.url!r})"

    # -- helpers ------------------------------------------------------------

    def _path(self, name: str) -> str:
        return f"{self.root.rstrip('/')}/{check_name(name)}"

    def _where(self, name: str) -> str:
        return f"{self.url}/{name}"

    def _fs(self) -> Any:
        """The filesystem, with its client session created once (an async
        filesystem creates it lazily on first use, and two threads racing on that
        would each make one)."""
        fs = self.fs
        if not getattr(fs, "_shardpoint_connected", False):
            with _CONNECT_LOCK:
                if not getattr(fs, "_shardpoint_connected", False):
                    connect = getattr(fs, "set_session", None)
                    if connect is not None and getattr(fs, "async_impl", False):
                        from fsspec.asyn import sync  # type: ignore[import-untyped]

                        sync(fs.loop, connect)
                    fs._shardpoint_connected = True
        return fs

    # -- writes -------------------------------------------------------------

    def write_file(self, name: str, parts: Iterable[bytes | memoryview]) -> int:
        path = self._path(name)
        fs = self._fs()
        block = BLOCK_SIZE
        if not self._bucketed():
            fs.makedirs(fs._parent(path), exist_ok=True)
        f = fs.open(path, "wb", block_size=block)
        total = 0
        try:
            for part in parts:
                view = memoryview(part)
                if view.ndim != 1 or view.format != "B":
                    view = view.cast("B")
                # Feed the buffered file up to each block boundary, so each part it
                # uploads is one block and it never holds more than one block plus
                # the slice being written (a multi-GiB tensor is not copied whole).
                while view:
                    room = block - total % block
                    piece = view[:room]
                    f.write(piece)
                    total += len(piece)
                    view = view[room:]
            f.close()  # S3: uploads the last part and completes the upload; the object exists from here
        except BaseException:
            _abandon(f)
            try:
                fs.rm_file(path)  # filesystems that wrote in place (local) keep a partial file
            except Exception:  # noqa: BLE001 - best effort; a data file without a manifest is inert
                pass
            raise
        return total

    def write_atomic(self, name: str, data: bytes) -> None:
        path = self._path(name)
        fs = self._fs()
        if not self._bucketed():
            fs.makedirs(fs._parent(path), exist_ok=True)
        fs.pipe_file(path, bytes(data))  # S3: one PutObject, visible all at once

    def _bucketed(self) -> bool:
        protocol = self.fs.protocol
        protocols = (protocol,) if isinstance(protocol, str) else tuple(protocol)
        return any(p in _BUCKETED for p in protocols)

    # -- reads --------------------------------------------------------------

    def read(self, name: str, offset: int = 0, length: int | None = None) -> bytes:
        path = self._path(name)
        fs = self._fs()
        if offset < 0 or (length is not None and length < 0):
            raise CorruptCheckpointError(
                f"negative range (offset {offset}, length {length}) asked of {self._where(name)}; "
                "the manifest is damaged"
            )
        try:
            if length == 0:
                # an empty byte range cannot be expressed as an HTTP Range; ask for the size
                size = fs.size(path)
                data = b""
                if offset > size:
                    self._short(name, offset, 0, size)
                return data
            end = None if length is None else offset + length
            data = fs.cat_file(path, start=offset, end=end)
        except FileNotFoundError:
            raise CorruptCheckpointError(
                f"data file {self._where(name)} is missing; the checkpoint is incomplete "
                "(restore the object or use another checkpoint)"
            ) from None
        except OSError as e:
            # S3 answers a range that starts at or past the end with 416 InvalidRange
            if "range" not in str(e).lower():
                raise
            size = fs.size(path)
            if length is None and offset == size:
                return b""
            self._short(name, offset, length or 0, size)
        if length is not None and len(data) != length:
            self._short(name, offset, length, None if len(data) == 0 else offset + len(data))
        if length is None and not data and offset > 0 and offset > fs.size(path):
            self._short(name, offset, 0, None)
        return data

    def _short(self, name: str, offset: int, length: int, size: int | None) -> NoReturn:
        if size is None:
            try:
                size = self.fs.size(self._path(name))
            except Exception:  # noqa: BLE001 - the message is the point
                size = None
        has = f"the object has {size}" if size is not None else "the object is shorter"
        raise CorruptCheckpointError(
            f"data file {self._where(name)} is truncated: wanted bytes {offset}..{offset + length}, {has}; "
            "the checkpoint is damaged (restore the object or use another checkpoint)"
        )

    def exists(self, name: str) -> bool:
        path = self._path(name)
        return bool(self._fs().isfile(path))

    def size(self, name: str) -> int:
        path = self._path(name)
        try:
            return int(self._fs().size(path))
        except FileNotFoundError:
            raise FileNotFoundError(f"{self._where(name)} does not exist") from None

    def list(self) -> list[str]:
        fs = self._fs()
        try:
            found = fs.find(self.root)
        except FileNotFoundError:
            return []
        prefix = self.root.rstrip("/") + "/"
        out = []
        for p in found:
            p = fs._strip_protocol(p)
            if p.startswith(prefix):
                rel = p[len(prefix) :]
                if rel and not rel.endswith("/"):
                    out.append(rel)
        return sorted(out)

    def list_dirs(self) -> builtins.list[str]:
        fs = self._fs()
        try:
            entries = fs.ls(self.root, detail=True)
        except (FileNotFoundError, NotADirectoryError):
            return []
        prefix = self.root.rstrip("/") + "/"
        out = []
        for e in entries:
            if e.get("type") != "directory":
                continue
            p = fs._strip_protocol(e["name"]).rstrip("/")
            if p.startswith(prefix) and "/" not in p[len(prefix) :]:
                out.append(p[len(prefix) :])
        return sorted(set(out))

    # -- removal ------------------------------------------------------------

    def remove(self, name: str) -> None:
        path = self._path(name)
        try:
            self._fs().rm_file(path)
        except FileNotFoundError:
            pass

    def remove_all(self) -> None:
        """Delete every object under the prefix (S3: batched ``DeleteObjects``).
        The bucket itself is never deleted, even when the storage is its root."""
        fs = self._fs()
        prefix = self.root.rstrip("/") + "/"
        files = [p for p in self._find_full() if p.startswith(prefix)]
        if files:
            fs.rm(files)
        if self._bucketed():
            return  # prefixes vanish with their last object
        try:
            if fs.exists(self.root):
                fs.rm(self.root, recursive=True)
        except FileNotFoundError:
            pass

    def _find_full(self) -> builtins.list[str]:
        try:
            return [self.fs._strip_protocol(p) for p in self._fs().find(self.root)]
        except FileNotFoundError:
            return []

    def child(self, name: str) -> FsspecStorage:
        check_name(name)
        return FsspecStorage(f"{self.url}/{name}", _fs=self.fs)

    def parent(self) -> FsspecStorage:
        head, _, _ = self.url.rpartition("/")
        if not head or head.endswith(":/"):
            raise CorruptCheckpointError(f"{self.url} is the top of its store: it has no parent location")
        return FsspecStorage(head, _fs=self.fs)


def _abandon(f: Any) -> None:
    """Drop a half-written file without publishing it: abort the multipart upload
    (S3) and mark the file closed, so neither ``close()`` nor the garbage
    collector completes the upload with the part written so far."""
    from fsspec.spec import AbstractBufferedFile  # type: ignore[import-untyped]

    try:
        if isinstance(f, AbstractBufferedFile):
            f.discard()
            f.closed = True
        elif not f.closed:
            f.close()
    except Exception:  # noqa: BLE001 - the original error matters more
        try:
            f.closed = True
        except Exception:  # noqa: BLE001
            pass
