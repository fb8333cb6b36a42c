"""Bounded retries for object-store requests: which failures are transient, how
long to wait between attempts, and the error that names the object when the
attempts run out.

One layer retries, not three: the storage turns off botocore's own retries and
s3fs's (``retries=1``), so ``attempts`` is the number of requests an operation
makes, and the worst-case time of one operation is bounded by
``attempts * timeout`` plus the backoff (at most ``attempts * max_delay``).
"""

from __future__ import annotations

import asyncio
import os
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from ..errors import ObjectStoreError, ShardpointError, UsageError

T = TypeVar("T")

#: Error codes of an S3 response that a later attempt may not get.
TRANSIENT_CODES = frozenset({
    "InternalError", "ServiceUnavailable", "SlowDown", "RequestTimeout", "Throttling",
    "ThrottlingException", "RequestLimitExceeded", "TooManyRequestsException", "RequestThrottled",
    "500", "502", "503", "504",
})
_TRANSIENT_STATUS = frozenset({500, 502, 503, 504})


@dataclass(frozen=True, slots=True, kw_only=True)
class Retry:
    """How hard one object-store operation tries. Pass it (or a dict of its fields)
    as ``storage_options={"shardpoint_retry": ...}``; fields not given come from the
    environment, then from the defaults below."""

    attempts: int = 5
    """Requests per operation (the first one included); env ``SHARDPOINT_S3_RETRIES``."""
    base_delay: float = 0.2
    """Seconds: the backoff before attempt ``n`` is uniform in ``[0, min(max_delay,
    base_delay * 2**(n-1))]`` (full jitter); env ``SHARDPOINT_S3_RETRY_BASE``."""
    max_delay: float = 8.0
    """Seconds: the cap of one backoff; env ``SHARDPOINT_S3_RETRY_MAX``."""
    timeout: float = 30.0
    """Seconds a request may wait to connect or for the next bytes of an answer
    (botocore's connect and read timeouts); env ``SHARDPOINT_S3_TIMEOUT``."""

    def __post_init__(self) -> None:
        if not isinstance(self.attempts, int) or self.attempts < 1:
            raise RetryOptionError(f"shardpoint_retry attempts={self.attempts!r}: give a whole number >= 1")
        for field in ("base_delay", "max_delay", "timeout"):
            value = getattr(self, field)
            if not isinstance(value, (int, float)) or value < 0 or (field == "timeout" and value == 0):
                raise RetryOptionError(
                    f"shardpoint_retry {field}={value!r}: give a number of seconds"
                    + (" > 0" if field == "timeout" else " >= 0")
                )

    def delay(self, attempt: int) -> float:
        """The (jittered) wait after failed attempt ``attempt`` (1-based)."""
        return random.uniform(0.0, min(self.max_delay, self.base_delay * 2 ** (attempt - 1)))

    @classmethod
    def resolve(cls, given: Retry | dict[str, Any] | None) -> Retry:
        """The policy for a storage: ``given`` fields, then environment variables,
        then the defaults."""
        if isinstance(given, Retry):
            return given
        if given is not None and not isinstance(given, dict):
            raise RetryOptionError(
                f"storage_options['shardpoint_retry'] is a {type(given).__name__}; give a "
                "shardpoint.storage.retry.Retry or a dict with attempts, base_delay, max_delay, timeout"
            )
        fields: dict[str, Any] = {}
        for field, var, kind in _ENV:
            raw = os.environ.get(var, "").strip()
            if raw:
                try:
                    fields[field] = kind(raw)
                except ValueError:
                    raise RetryOptionError(f"{var}={raw!r} is not a {kind.__name__}") from None
        unknown = set(given or {}) - {f for f, _, _ in _ENV}
        if unknown:
            raise RetryOptionError(
                f"storage_options['shardpoint_retry'] has unknown fields {sorted(unknown)}; "
                "known: attempts, base_delay, max_delay, timeout"
            )
        return replace(cls(**fields), **(given or {}))


class RetryOptionError(UsageError):
    """A retry option (storage option or environment variable) is not valid."""


_ENV: tuple[tuple[str, str, type], ...] = (
    ("attempts", "SHARDPOINT_S3_RETRIES", int),
    ("base_delay", "SHARDPOINT_S3_RETRY_BASE", float),
    ("max_delay", "SHARDPOINT_S3_RETRY_MAX", float),
    ("timeout", "SHARDPOINT_S3_TIMEOUT", float),
)


def error_code(exc: BaseException) -> str | None:
    """The S3 error code of ``exc`` or of the botocore error it wraps (s3fs turns
    them into ``OSError`` with the original as the cause)."""
    for e in _chain(exc):
        response = getattr(e, "response", None)
        if isinstance(response, dict):
            code = response.get("Error", {}).get("Code")
            if code:
                return str(code)
            status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if status:
                return str(status)
    return None


def transient(exc: BaseException) -> bool:
    """Whether another attempt may succeed: a 5xx or throttling answer, a refused,
    reset or timed-out connection, an answer cut short."""
    for e in _chain(exc):
        response = getattr(e, "response", None)
        if isinstance(response, dict) and "Error" in response:
            code = response["Error"].get("Code")
            status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            return code in TRANSIENT_CODES or status in _TRANSIENT_STATUS
        if isinstance(e, (ConnectionError, TimeoutError, asyncio.TimeoutError)):
            return True
        if _is_transient_type(e):
            return True
    return False


def _is_transient_type(e: BaseException) -> bool:
    names = {c.__name__ for c in type(e).__mro__}
    # botocore: HTTPClientError (connection closed, read/connect timeouts, endpoint
    # unreachable), IncompleteReadError, ResponseStreamingError, ResponseParserError
    # (a cut-short XML answer); aiohttp: ClientConnectionError, ClientPayloadError;
    # http.client: IncompleteRead; fsspec: FSTimeoutError
    return bool(names & {
        "HTTPClientError", "IncompleteReadError", "ResponseStreamingError", "ResponseParserError",
        "ClientConnectionError", "ClientPayloadError", "IncompleteRead", "FSTimeoutError",
    })


def _chain(exc: BaseException) -> list[BaseException]:
    out: list[BaseException] = []
    e: BaseException | None = exc
    while e is not None and e not in out and len(out) < 8:
        out.append(e)
        e = e.__cause__ or e.__context__
    return out


def exhausted(policy: Retry, what: str, url: str, exc: BaseException, attempts: int) -> ObjectStoreError:
    """The error for an operation that failed ``attempts`` times (or once, with an
    error that is not transient and not a plain missing object)."""
    tries = f"after {attempts} attempts" if attempts > 1 else "on its only attempt"
    return ObjectStoreError(
        f"{what} {url} failed {tries}: {type(exc).__name__}: {exc}. The object store did not answer "
        f"or kept answering with errors; check the endpoint and the network, or allow more with "
        f"storage_options={{'shardpoint_retry': {{'attempts': {policy.attempts * 2}, 'timeout': {policy.timeout:g}}}}} "
        f"(or SHARDPOINT_S3_RETRIES / SHARDPOINT_S3_TIMEOUT)"
    )


def _named(what: str, url: str, exc: Exception) -> Exception:
    """A failure that is not transient: shardpoint's own errors and a missing
    object stay as they are; anything else (access denied, a bucket that does not
    exist) becomes an :class:`ObjectStoreError` that names the object."""
    if isinstance(exc, (ShardpointError, FileNotFoundError)):
        return exc
    return ObjectStoreError(f"{what} {url} failed: {type(exc).__name__}: {exc}; not retried (not a transient error)")


def _verdict(policy: Retry, what: str, url: str, e: Exception, attempt: int) -> Exception | None:
    """What to raise for ``e`` on attempt ``attempt`` (``e`` itself, or an error naming
    the object), or None to try again."""
    if not transient(e):
        return _named(what, url, e)
    if attempt >= policy.attempts:
        return exhausted(policy, what, url, e, attempt)
    return None


async def retry_async(policy: Retry, what: str, url: str, call: Callable[[int], Awaitable[T]]) -> T:
    """Await ``call(attempt)`` (attempt = 1, 2, ...) until it returns or fails with an
    error that is not transient (raised as is), at most ``policy.attempts`` times;
    then raise :class:`ObjectStoreError` naming ``url``."""
    attempt = 1
    while True:
        try:
            return await call(attempt)
        except Exception as e:  # noqa: BLE001 - classified right here
            verdict = _verdict(policy, what, url, e, attempt)
            if verdict is e:
                raise
            if verdict is not None:
                raise verdict from e
        await asyncio.sleep(policy.delay(attempt))
        attempt += 1


def retry_sync(policy: Retry, what: str, url: str, call: Callable[[], T]) -> T:
    """:func:`retry_async` for a blocking call (an s3fs method)."""
    attempt = 1
    while True:
        try:
            return call()
        except Exception as e:  # noqa: BLE001 - classified right here
            verdict = _verdict(policy, what, url, e, attempt)
            if verdict is e:
                raise
            if verdict is not None:
                raise verdict from e
        time.sleep(policy.delay(attempt))
        attempt += 1
