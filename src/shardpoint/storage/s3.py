"""S3 requests of :class:`~shardpoint.storage.fsspec.FsspecStorage`, made on s3fs's
client and event loop but with shardpoint's own bounded retries (:mod:`.retry`),
because what a checkpoint needs is not what a generic retry gives:

- A data file is a multipart upload whose parts go up ``concurrency`` at a time.
  Each request is retried on its own (an ``UploadPart`` or a ``PutObject`` sent
  twice with the same bytes is harmless).
- ``CompleteMultipartUpload`` whose answer was lost may, on its retry, get
  ``NoSuchUpload``: the first one did complete. The object is then checked (its
  size, and its ETag against the one the parts give) instead of failing the save.
- ``CreateMultipartUpload`` whose answer was lost leaves an upload nobody knows
  the id of; when it had to be retried, the uploads left under the key are listed
  and aborted (a data file's key belongs to one save of one rank).
- A write that fails aborts its upload (retried as well); if even that fails, the
  error still names the object and the upload left behind.
- A read is ranged ``GET``s straight into the caller's buffer, in pieces fetched
  concurrently; a piece cut short (a reset connection, a timeout) is asked for
  again from where it stopped. Bytes are never returned short: the caller gets
  all of them or an error.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import hashlib
import warnings
from collections.abc import Awaitable, Iterable, Mapping
from typing import Any, NoReturn, Protocol, TypeVar

from ..errors import CorruptCheckpointError
from .base import byte_view
from .retry import ObjectStoreError, Retry, error_code, retry_async, transient

#: S3's smallest part (all but the last).
MIN_PART = 5 << 20

T = TypeVar("T")


class _S3FileSystem(Protocol):
    """What these operations use of s3fs's ``S3FileSystem``."""

    loop: asyncio.AbstractEventLoop

    async def get_s3(self, bucket: object = None) -> object: ...

    def _get_s3_method_kwargs(self, method: object, **kwargs: object) -> dict[str, object]: ...


class S3Objects:
    """The S3 operations of one storage: ``fs`` is the connected s3fs filesystem."""

    def __init__(self, fs: _S3FileSystem, retry: Retry, concurrency: int, block: int) -> None:
        self.fs, self.retry, self.concurrency, self.block = fs, retry, concurrency, block

    # -- plumbing -------------------------------------------------------------

    def _run(self, coro: Awaitable[T]) -> T:
        from fsspec.asyn import sync

        async def wrap() -> T:
            return await coro

        return sync(self.fs.loop, wrap)

    async def _call(self, method: str, **kwargs: object) -> Any:  # Any: botocore's answer
        """One request on s3fs's client, with the caller's ``s3_additional_kwargs``
        (encryption, ACL...) merged in, and no retry of its own."""
        s3 = await self.fs.get_s3(kwargs.get("Bucket"))
        fn = getattr(s3, method)
        return await fn(**self.fs._get_s3_method_kwargs(fn, **kwargs))

    # -- writes ---------------------------------------------------------------

    def put(self, bucket: str, key: str, url: str, data: bytes | bytearray) -> None:
        """One ``PutObject`` (retried: the same bytes again). When every attempt
        failed, the object may still hold them (a request applied whose answer was
        lost each time): if it does (same size, ETag = their MD5), the write is done."""
        body = data

        async def once(_attempt: int) -> None:
            await self._call("put_object", Bucket=bucket, Key=key, Body=body)

        try:
            self._run(retry_async(self.retry, "writing", url, once))
        except ObjectStoreError as e:
            if not _lost_answers(e):
                raise
            try:
                info = self.head(bucket, key, url)
            except Exception:  # noqa: BLE001 - the write's own error is the one to raise
                info = None
            if (
                info is None
                or int(info.get("ContentLength", -1)) != len(data)
                or str(info.get("ETag", "")).strip('"') != hashlib.md5(data).hexdigest()
            ):
                raise

    def put_new(self, bucket: str, key: str, url: str, data: bytes) -> bool:
        """One ``PutObject`` with ``If-None-Match: *``: True when it created the object,
        False when the object already existed (412 ``PreconditionFailed``), decided by
        the store. A retry whose earlier attempt did create it (its answer lost) meets
        its own object: the bytes are compared, so that counts as created. A store
        that ignores the header replaces the object: the weaker form (the last writer
        wins), which callers that must know (a claim) check by reading back."""
        body = data

        async def once(attempt: int) -> bool:
            try:
                await self._call("put_object", Bucket=bucket, Key=key, Body=body, IfNoneMatch="*")
                return True
            except Exception as e:  # noqa: BLE001
                if error_code(e) not in ("PreconditionFailed", "412", "ConditionalRequestConflict", "409"):
                    raise
                if attempt == 1:
                    return False
            resp = await self._call("get_object", Bucket=bucket, Key=key)
            if int(resp["ContentLength"]) != len(data):
                resp["Body"].close()
                return False
            there = bytearray(len(data))
            await _read_body(resp["Body"], memoryview(there), [0], url)
            return bytes(there) == bytes(data)

        return self._run(retry_async(self.retry, "creating", url, once))

    def write(self, bucket: str, key: str, url: str, parts: Iterable[bytes | memoryview]) -> int:
        """Stream ``parts`` to one object: a ``PutObject`` when it all fits in one
        block, else a multipart upload with up to ``concurrency`` parts in flight.
        Returns the number of bytes; the object exists when this returns."""
        block = max(self.block, MIN_PART)
        up = _Upload(self, bucket, key, url)
        buf = bytearray()  # grows to a block (a small file never allocates one); then blocks are reused
        filled = total = 0
        try:
            for part in parts:
                view = byte_view(part)
                while view:
                    n = min(block - filled, len(view))
                    if len(buf) >= filled + n:
                        buf[filled : filled + n] = view[:n]
                    else:
                        buf += view[:n]
                    filled += n
                    total += n
                    view = view[n:]
                    if filled == block:
                        buf = up.send(buf)
                        filled = 0
            del buf[filled:]  # botocore takes bytes or a bytearray, not a memoryview
            if up.upload_id is None:
                self.put(bucket, key, url, buf)
                return total
            if filled:
                up.send(buf)
            up.complete()
        except BaseException as e:
            up.abort(e)
            self._delete_quietly(bucket, key, url)  # like a local file, a failed write leaves no file
            raise
        return total

    def _delete_quietly(self, bucket: str, key: str, url: str) -> None:
        async def once(_attempt: int) -> None:
            await self._call("delete_object", Bucket=bucket, Key=key)

        try:
            self._run(retry_async(self.retry, "removing", url, once))
        except Exception:  # noqa: BLE001 - best effort; a data file without a manifest is inert
            pass

    # -- reads ----------------------------------------------------------------

    def read_into(self, bucket: str, key: str, url: str, offset: int, buf: memoryview) -> None:
        """Fill ``buf`` from ``offset`` with ranged GETs (a range larger than a block in
        up to ``concurrency`` pieces fetched at once). Raises
        :class:`CorruptCheckpointError` when the object is missing or shorter than the
        range."""
        n = len(buf)
        if n == 0:
            return
        pieces = max(1, min(self.concurrency, -(-n // max(self.block, MIN_PART))))
        step = -(-n // pieces)

        async def all_pieces() -> None:
            # every piece ends (done or failed) before this returns: none writes into
            # the caller's buffer afterwards
            got = await asyncio.gather(*[
                self._get_range(bucket, key, url, offset + a, buf[a : min(a + step, n)])
                for a in range(0, n, step)
            ], return_exceptions=True)
            for e in got:
                if isinstance(e, BaseException):
                    raise e

        self._run(all_pieces())

    def read_rest(self, bucket: str, key: str, url: str, offset: int) -> bytearray:
        """Everything from ``offset`` to the end of the object (one ``GET`` when the
        object is small; its length comes with the answer)."""
        out: list[bytearray] = []
        got = [0]

        async def once(_attempt: int) -> None:
            start = offset + got[0]
            try:
                resp = await self._call(
                    "get_object", Bucket=bucket, Key=key, **({"Range": f"bytes={start}-"} if start else {})
                )
            except Exception as e:  # noqa: BLE001 - missing and short objects are not transient
                code = error_code(e)
                if code in ("NoSuchKey", "404"):
                    raise FileNotFoundError(f"{url} does not exist") from None
                if code == "InvalidRange" and not out:
                    out.append(bytearray())  # at or past the end: the caller checks which
                    return
                raise
            if not out:
                out.append(bytearray(int(resp["ContentLength"])))
            await _read_body(resp["Body"], memoryview(out[0]), got, url)

        self._run(retry_async(self.retry, "reading", url, once))
        if not out[0] and offset:
            size = self.size(bucket, key, url)
            if offset > size:
                _short(url, offset, 0, size)
        return out[0]

    async def _get_range(self, bucket: str, key: str, url: str, offset: int, dst: memoryview) -> None:
        got = [0]  # bytes of ``dst`` already filled: a retry asks only for the rest

        async def once(_attempt: int) -> None:
            start, end = offset + got[0], offset + len(dst) - 1
            try:
                resp = await self._call("get_object", Bucket=bucket, Key=key, Range=f"bytes={start}-{end}")
            except Exception as e:  # noqa: BLE001 - missing and short objects are not transient
                code = error_code(e)
                if code in ("NoSuchKey", "404"):
                    raise CorruptCheckpointError(
                        f"data file {url} is missing; the checkpoint is incomplete "
                        "(restore the object or use another checkpoint)"
                    ) from None
                if code == "InvalidRange":
                    _short(url, offset, len(dst), None)
                raise
            if int(resp.get("ContentLength", -1)) != end - start + 1:
                resp["Body"].close()
                _short(url, offset, len(dst), _total(resp))
            await _read_body(resp["Body"], dst, got, url)

        await retry_async(self.retry, "reading", url, once)

    # -- metadata ---------------------------------------------------------------

    def head(self, bucket: str, key: str, url: str) -> dict[str, Any] | None:
        """The object's ``HeadObject`` answer, or None when it does not exist."""

        async def once(_attempt: int) -> dict[str, Any] | None:
            try:
                return dict(await self._call("head_object", Bucket=bucket, Key=key))
            except Exception as e:  # noqa: BLE001
                if error_code(e) in ("404", "NoSuchKey", "NotFound"):
                    return None
                raise

        return self._run(retry_async(self.retry, "looking up", url, once))

    def size(self, bucket: str, key: str, url: str) -> int:
        info = self.head(bucket, key, url)
        if info is None:
            raise FileNotFoundError(f"{url} does not exist")
        return int(info["ContentLength"])


class _Upload:
    """One multipart upload, started at its first full block."""

    def __init__(self, ops: S3Objects, bucket: str, key: str, url: str) -> None:
        self.ops, self.bucket, self.key, self.url = ops, bucket, key, url
        self.upload_id: str | None = None
        self.create_tried = self.create_retried = self.checked = False
        self.sent = 0  # parts handed to the loop
        self.etags: dict[int, str] = {}
        self.inflight: list[tuple[cf.Future[None], bytearray]] = []
        self.spare: list[bytearray] = []

    def _create(self) -> None:
        async def once(attempt: int) -> str:
            self.create_tried, self.create_retried = True, attempt > 1
            resp = await self.ops._call("create_multipart_upload", Bucket=self.bucket, Key=self.key)
            return str(resp["UploadId"])

        self.upload_id = self.ops._run(retry_async(self.ops.retry, "starting the upload of", self.url, once))

    def send(self, buf: bytearray) -> bytearray:
        """Upload ``buf`` as the next part (in the background, at most
        ``concurrency`` at a time); return a buffer for the next block."""
        if self.upload_id is None:
            self._create()
        self.sent += 1
        number = self.sent
        fut = asyncio.run_coroutine_threadsafe(self._part(number, buf), self.ops.fs.loop)
        self.inflight.append((fut, buf))
        while len(self.inflight) >= self.ops.concurrency:
            done, b = self.inflight.pop(0)
            done.result()
            self.spare.append(b)
        return self.spare.pop() if self.spare else bytearray(len(buf))  # full size: slices are assigned

    async def _part(self, number: int, body: bytearray) -> None:
        async def once(_attempt: int) -> str:
            resp = await self.ops._call(
                "upload_part", Bucket=self.bucket, Key=self.key, UploadId=self.upload_id, PartNumber=number, Body=body
            )
            return str(resp["ETag"])

        self.etags[number] = await retry_async(self.ops.retry, f"uploading part {number} of", self.url, once)

    def complete(self) -> None:
        for fut, _ in self.inflight:
            fut.result()
        self.inflight.clear()
        parts = [{"PartNumber": i, "ETag": self.etags[i]} for i in sorted(self.etags)]

        async def once(attempt: int) -> None:
            try:
                await self.ops._call(
                    "complete_multipart_upload", Bucket=self.bucket, Key=self.key, UploadId=self.upload_id,
                    MultipartUpload={"Parts": parts},
                )
            except Exception as e:  # noqa: BLE001
                if attempt > 1 and error_code(e) == "NoSuchUpload":
                    return  # an earlier attempt completed it and its answer was lost: checked below
                raise
            self.checked = True

        try:
            self.ops._run(retry_async(self.ops.retry, "completing the upload of", self.url, once))
        except ObjectStoreError as e:
            if not _lost_answers(e):
                raise
            try:  # every answer was lost: one of the attempts may still have completed it
                info = self.ops.head(self.bucket, self.key, self.url)
            except Exception:  # noqa: BLE001 - the completion's own error is the one to raise
                info = None
            if not self._is_ours(info):
                raise
            self.checked = True
        if not self.checked:
            info = self.ops.head(self.bucket, self.key, self.url)
            if not self._is_ours(info):
                raise ObjectStoreError(
                    f"completing the upload of {self.url}: the store answered NoSuchUpload to a retry, and the "
                    f"object {'does not exist' if info is None else 'is not the one uploaded (ETag ' + str(info.get('ETag')) + ')'}; "
                    "the data file was not written. Save again"
                )
        self.upload_id = None
        if self.create_retried:
            self._sweep(None)

    def _is_ours(self, info: Mapping[str, object] | None) -> bool:
        """Whether ``info`` (a HeadObject answer) is the object these parts make: its
        ETag is the MD5 of the parts' MD5s with the part count, or (stores whose part
        ETags are not MD5s) at least the part count. The key belongs to this write."""
        if info is None:
            return False
        n = len(self.etags)
        etag = str(info.get("ETag", "")).strip('"')
        try:
            md5s = b"".join(bytes.fromhex(self.etags[i].strip('"')) for i in sorted(self.etags))
        except ValueError:  # part ETags that are not MD5s (some encryption modes)
            return etag.endswith(f"-{n}")
        return etag == f"{hashlib.md5(md5s).hexdigest()}-{n}"

    def abort(self, cause: BaseException) -> None:
        """Drop the upload after ``cause``: wait for the parts in flight, abort it,
        and (when a create was retried) any other upload of the key. If that fails
        too, ``cause`` gets a note naming the upload left behind."""
        for fut, _ in self.inflight:
            fut.cancel()
        cf.wait([f for f, _ in self.inflight], timeout=self.ops.retry.attempts * self.ops.retry.timeout)
        self.inflight.clear()
        if self.upload_id is None and not self.create_tried:
            return
        try:
            self._sweep(self.upload_id)
        except Exception as e:  # noqa: BLE001 - the write's own error is the one to raise
            note = (f"shardpoint: aborting the multipart upload {self.upload_id} of {self.url} failed too "
                    f"({type(e).__name__}: {e}); its parts stay on the server until a bucket lifecycle rule "
                    "(abort incomplete multipart uploads) removes them")
            if hasattr(cause, "add_note"):  # Python >= 3.11
                cause.add_note(note)
            else:  # pragma: no cover - Python 3.10
                warnings.warn(note, stacklevel=2)

    def _sweep(self, known: str | None) -> None:
        ids = [known] if known is not None else []
        if self.create_retried or known is None:
            ids += self._listed()
        for upload_id in dict.fromkeys(ids):
            async def once(_attempt: int, upload_id: str = upload_id) -> None:
                try:
                    await self.ops._call("abort_multipart_upload", Bucket=self.bucket, Key=self.key, UploadId=upload_id)
                except Exception as e:  # noqa: BLE001
                    if error_code(e) not in ("NoSuchUpload", "404"):  # a lost answer's retry: already gone
                        raise

            self.ops._run(retry_async(self.ops.retry, "aborting the upload of", self.url, once))

    def _listed(self) -> list[str]:
        async def once(_attempt: int) -> list[str]:
            resp = await self.ops._call("list_multipart_uploads", Bucket=self.bucket, Prefix=self.key)
            return [u["UploadId"] for u in resp.get("Uploads", []) if u.get("Key") == self.key]

        out: list[str] = self.ops._run(retry_async(self.ops.retry, "listing the uploads of", self.url, once))
        return out


def _lost_answers(e: ObjectStoreError) -> bool:
    """Whether the attempts ran out on transient errors (so one of them may have
    been applied), not on an error that was not retried."""
    return e.__cause__ is not None and transient(e.__cause__)


def _total(resp: Mapping[str, object]) -> int | None:
    """The object's size from a ranged answer's ``Content-Range`` (``bytes a-b/total``)."""
    rng = str(resp.get("ContentRange", ""))
    try:
        return int(rng.rsplit("/", 1)[1])
    except (IndexError, ValueError):
        return None



async def _read_body(body: Any, dst: memoryview, got: list[int], url: str) -> None:
    """Read an answer's body into ``dst`` from ``got[0]`` on, counting in ``got[0]`` (a
    retry asks only for the rest); an answer that ends early is a reset connection
    (botocore raises first where it knew the length). The body is closed either way."""
    try:
        while got[0] < len(dst):
            k = await body.readinto(dst[got[0] :])
            if k == 0:
                raise ConnectionResetError(f"the answer for {url} ended after {got[0]} of {len(dst)} bytes")
            got[0] += k
    finally:
        body.close()

def _short(url: str, offset: int, length: int, size: int | None) -> NoReturn:
    has = f"the object has {size}" if size is not None else "the object is shorter"
    raise CorruptCheckpointError(
        f"data file {url} is truncated: wanted bytes {offset}..{offset + length}, {has}; "
        "the checkpoint is damaged (restore the object or use another checkpoint)"
    )


__all__ = ["S3Objects", "transient"]
