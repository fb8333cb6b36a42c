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
from collections.abc import Callable, Iterable
from typing import Any, NoReturn, TypeVar

from ..errors import CorruptCheckpointError, MissingDependencyError, UsageError
from ..format.names import check_name
from .base import Storage, byte_view
from .retry import Retry, retry_sync
from .s3 import S3Objects

T = TypeVar("T")


def _env_size(var: str, default: int) -> int:
    raw = os.environ.get(var)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise UsageError(f"{var}={raw!r} is not a whole number of bytes (e.g. {default})") from None
    if value <= 0:
        raise UsageError(f"{var}={raw!r} must be a positive number of bytes")
    return value


#: Part size of a multipart upload, in bytes (environment: ``SHARDPOINT_S3_BLOCK_SIZE``).
#: S3 needs at least 5 MiB and allows at most 10,000 parts, so the default of
#: 64 MiB gives objects of up to 625 GiB; raise it for larger data files. One
#: writer holds about two blocks in memory.
BLOCK_SIZE = _env_size("SHARDPOINT_S3_BLOCK_SIZE", 64 << 20)

#: Parts of one upload in flight at a time, and concurrent ranged GETs of one large
#: read, on S3 (environment: ``SHARDPOINT_S3_CONCURRENCY``). A writer holds about
#: ``concurrency + 1`` blocks in memory.
CONCURRENCY = _env_size("SHARDPOINT_S3_CONCURRENCY", 4)

#: Filesystems whose "directories" are key prefixes that vanish with their last object.
_BUCKETED = ("s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl", "oss", "r2")

_S3 = ("s3", "s3a")

_CONNECT_LOCK = threading.Lock()


def _client_options(options: dict[str, Any], retry: Retry) -> None:
    """Point s3fs and botocore at shardpoint's retry layer: no retries of their own
    (so ``retry.attempts`` is the real number of requests, not attempts squared),
    and ``retry.timeout`` as the connect and read timeouts. Whatever the caller set
    explicitly stays."""
    config = dict(options.get("config_kwargs") or {})
    config.setdefault("retries", {"total_max_attempts": 1, "mode": "standard"})
    config.setdefault("connect_timeout", retry.timeout)
    config.setdefault("read_timeout", retry.timeout)
    config.setdefault("max_pool_connections", 64)
    # shardpoint checksums every block itself (CRC-32 in the index, verified on load):
    # botocore's own CRC of each part would only cost CPU
    config.setdefault("request_checksum_calculation", "when_required")
    config.setdefault("response_checksum_validation", "when_required")
    options["config_kwargs"] = config


class FsspecStorage(Storage):
    """A prefix of any fsspec filesystem; ``s3://bucket/prefix`` needs
    ``pip install shardpoint[s3]``.

    Args:
        url: ``protocol://location``, e.g. ``s3://bucket/run1/step-100``.
        storage_options: passed to the filesystem (for s3fs: ``key``, ``secret``,
            ``client_kwargs={"endpoint_url": ...}``, ``profile``...). Without them,
            s3fs finds credentials and endpoint the usual way (``AWS_*``
            environment variables, ``~/.aws``, instance roles). One key is
            shardpoint's own and is not passed on: ``shardpoint_retry``, a
            :class:`~shardpoint.storage.retry.Retry` or a dict of its fields
            (attempts, base_delay, max_delay, timeout).
    """

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None, *, _fs: Any = None,
                 _retry: Retry | None = None) -> None:
        self.url = url.rstrip("/") if not url.endswith("://") else url
        storage_options = dict(storage_options or {})
        self.retry = _retry or Retry.resolve(storage_options.pop("shardpoint_retry", None))
        if _fs is None:
            try:
                from fsspec.core import url_to_fs
            except ImportError:
                raise MissingDependencyError(
                    f"saving to {url} needs fsspec (and s3fs for s3://): pip install 'shardpoint[s3]'"
                ) from None
            options = dict(storage_options)
            options.setdefault("use_listings_cache", False)
            if url.split("://", 1)[0] in _S3:
                _client_options(options, self.retry)
            try:
                fs, root = url_to_fs(url, **options)
            except ImportError as e:  # the filesystem's own package (gcsfs, adlfs, ...)
                raise UsageError(f"{url} needs a package that is not installed: {e}") from None
            except TypeError:
                if storage_options.get("use_listings_cache") is not None:
                    raise
                options.pop("use_listings_cache")  # a filesystem without a listings cache
                fs, root = url_to_fs(url, **options)
            if url.split("://", 1)[0] in _S3:
                # s3fs's own retry loop (a class attribute, 5 tries) around the listing and
                # removal calls made through it: off, shardpoint's retries those calls. The
                # instance is cached under options that carry shardpoint's client settings,
                # so only shardpoint's storages share it.
                fs.retries = 1
        else:
            fs, root = _fs, _fs._strip_protocol(url)
        self.fs = fs
        self.root: str = root.rstrip("/") or root
        # S3 splits a large range into concurrent ranged GETs itself; another filesystem
        # reads a range through memory, a block at a time. A request costs a round trip:
        # neighbouring chunks of up to 1/8 of a block are fetched together, a block per request
        self.read_piece = None if self._s3() is not None else BLOCK_SIZE
        self.read_batch = BLOCK_SIZE

    def __repr__(self) -> str:
        return f"FsspecStorage({self.url!r})"

    # -- helpers ------------------------------------------------------------

    def _path(self, name: str) -> str:
        return f"{self.root.rstrip('/')}/{check_name(name)}"

    def _where(self, name: str) -> str:
        return f"{self.url}/{name}"

    def _s3(self) -> S3Objects | None:
        """The S3 requests with shardpoint's retries, on an S3 filesystem."""
        protocol = self.fs.protocol
        protocols = (protocol,) if isinstance(protocol, str) else tuple(protocol)
        if not any(p in _S3 for p in protocols):
            return None
        return S3Objects(self._fs(), self.retry, CONCURRENCY, BLOCK_SIZE)

    def _key(self, path: str) -> tuple[str, str]:
        bucket, key, _ = self.fs.split_path(path)
        return bucket, key

    def _retried(self, what: str, where: str, call: Callable[[], T]) -> T:
        return retry_sync(self.retry, what, where, call)

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
                        from fsspec.asyn import sync

                        try:
                            sync(fs.loop, connect)
                        except Exception as e:  # noqa: BLE001 - the client's configuration, named below
                            named = _configuration_error(self.url, e)
                            if named is e:
                                raise
                            raise named from e
                    fs._shardpoint_connected = True
        return fs

    # -- writes -------------------------------------------------------------

    def write_file(self, name: str, parts: Iterable[bytes | memoryview]) -> int:
        path = self._path(name)
        fs = self._fs()
        s3 = self._s3()
        if s3 is not None:
            return s3.write(*self._key(path), self._where(name), parts)
        block = BLOCK_SIZE
        if not self._bucketed():
            fs.makedirs(fs._parent(path), exist_ok=True)
        f = fs.open(path, "wb", block_size=block)
        total = 0
        try:
            for part in parts:
                view = byte_view(part)
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
        s3 = self._s3()
        if s3 is not None:  # one PutObject, visible all at once; a retry sends the same bytes
            s3.put(*self._key(path), self._where(name), bytes(data))
            return
        if not self._bucketed():
            fs.makedirs(fs._parent(path), exist_ok=True)
        self._retried("writing", self._where(name), lambda: fs.pipe_file(path, bytes(data)))

    def create_new(self, name: str, data: bytes) -> bool:
        s3 = self._s3()
        if s3 is None:  # another filesystem: the weaker form (a look-up, then the write)
            return super().create_new(name, data)
        self._fs()
        return s3.put_new(*self._key(self._path(name)), self._where(name), bytes(data))

    def sizes(self) -> dict[str, int]:
        fs = self._fs()
        try:
            found = self._retried("listing", self.url, lambda: fs.find(self.root, detail=True))
        except FileNotFoundError:
            return {}
        prefix = self.root.rstrip("/") + "/"
        out: dict[str, int] = {}
        for p, info in found.items():
            p = fs._strip_protocol(p)
            if p.startswith(prefix) and info.get("type", "file") != "directory":
                rel = p[len(prefix) :]
                if rel and not rel.endswith("/"):
                    out[rel] = int(info.get("size") or 0)
        return out

    def _bucketed(self) -> bool:
        protocol = self.fs.protocol
        protocols = (protocol,) if isinstance(protocol, str) else tuple(protocol)
        return any(p in _BUCKETED for p in protocols)

    # -- reads --------------------------------------------------------------

    def read(self, name: str, offset: int = 0, length: int | None = None) -> bytes | bytearray:
        path = self._path(name)
        fs = self._fs()
        if offset < 0 or (length is not None and length < 0):
            raise CorruptCheckpointError(
                f"negative range (offset {offset}, length {length}) asked of {self._where(name)}; "
                "the manifest is damaged"
            )
        s3 = self._s3()
        if s3 is not None:
            return self._read_s3(s3, name, offset, length)
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

    def _read_s3(self, s3: S3Objects, name: str, offset: int, length: int | None) -> bytearray:
        bucket, key = self._key(self._path(name))
        where = self._where(name)
        try:
            if length is None:
                return s3.read_rest(bucket, key, where, offset)
            if length == 0:  # an empty byte range cannot be expressed as an HTTP Range
                size = s3.size(bucket, key, where)
                if offset > size:
                    self._short(name, offset, 0, size)
                return bytearray()
            out = bytearray(length)
            s3.read_into(bucket, key, where, offset, memoryview(out))
            return out
        except FileNotFoundError:
            raise CorruptCheckpointError(
                f"data file {where} is missing; the checkpoint is incomplete "
                "(restore the object or use another checkpoint)"
            ) from None

    def read_into(self, name: str, offset: int, buf: memoryview) -> None:
        s3 = self._s3()
        if s3 is None:
            super().read_into(name, offset, buf)
            return
        if offset < 0:
            raise CorruptCheckpointError(
                f"negative offset {offset} asked of {self._where(name)}; the manifest is damaged"
            )
        view = byte_view(buf)
        s3.read_into(*self._key(self._path(name)), self._where(name), offset, view)

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
        s3 = self._s3()
        if s3 is not None:
            return s3.head(*self._key(path), self._where(name)) is not None
        return bool(self._retried("looking up", self._where(name), lambda: self._fs().isfile(path)))

    def size(self, name: str) -> int:
        path = self._path(name)
        s3 = self._s3()
        if s3 is not None:
            return s3.size(*self._key(path), self._where(name))
        try:
            return int(self._retried("looking up", self._where(name), lambda: self._fs().size(path)))
        except FileNotFoundError:
            raise FileNotFoundError(f"{self._where(name)} does not exist") from None

    def list(self) -> list[str]:
        fs = self._fs()
        try:
            found = self._retried("listing", self.url, lambda: fs.find(self.root))
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
            entries = self._retried("listing", self.url, lambda: fs.ls(self.root, detail=True))
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
            self._retried("removing", self._where(name), lambda: self._fs().rm_file(path))
        except FileNotFoundError:
            pass

    def remove_all(self) -> None:
        """Delete every object under the prefix (S3: batched ``DeleteObjects``).
        The bucket itself is never deleted, even when the storage is its root."""
        fs = self._fs()
        prefix = self.root.rstrip("/") + "/"
        files = [p for p in self._find_full() if p.startswith(prefix)]
        if files:
            self._retried("removing the objects under", self.url, lambda: fs.rm(files))
        if self._bucketed():
            return  # prefixes vanish with their last object
        try:
            if fs.exists(self.root):
                fs.rm(self.root, recursive=True)
        except FileNotFoundError:
            pass

    def _find_full(self) -> builtins.list[str]:
        try:
            found = self._retried("listing", self.url, lambda: self._fs().find(self.root))
            return [self.fs._strip_protocol(p) for p in found]
        except FileNotFoundError:
            return []

    def child(self, name: str) -> FsspecStorage:
        check_name(name)
        return FsspecStorage(f"{self.url}/{name}", _fs=self.fs, _retry=self.retry)

    def parent(self) -> FsspecStorage:
        head, _, _ = self.url.rpartition("/")
        if not head or head.endswith(":/"):
            raise CorruptCheckpointError(f"{self.url} is the top of its store: it has no parent location")
        return FsspecStorage(head, _fs=self.fs, _retry=self.retry)


def _configuration_error(url: str, e: Exception) -> Exception:
    """A client that cannot be made from the given options (botocore's ProfileNotFound,
    NoRegionError, PartialCredentialsError...) as a :class:`UsageError` naming them;
    anything else as it is."""
    kind = type(e).__name__
    if type(e).__module__.startswith("botocore") and kind in (
            "ProfileNotFound", "NoRegionError", "PartialCredentialsError", "InvalidConfigError", "UnknownCredentialError",
            "ConfigNotFound", "InvalidRegionError"):
        return UsageError(f"the object-store client for {url} cannot be made from its options: {kind}: {e}. Fix "
                          "storage_options (profile=, client_kwargs={'region_name': ...}, key=/secret=) or the AWS_* "
                          "environment variables")
    return e


def _abandon(f: Any) -> None:
    """Drop a half-written file without publishing it: abort the multipart upload
    (S3) and mark the file closed, so neither ``close()`` nor the garbage
    collector completes the upload with the part written so far."""
    from fsspec.spec import AbstractBufferedFile

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
