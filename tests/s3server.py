"""A real S3 protocol server on loopback for the object-storage tests: moto's
server mode in a subprocess on a free 127.0.0.1 port. No client is mocked; s3fs
talks HTTP to it exactly as it would to S3.

Use the context manager anywhere::

    with s3_server() as s3:
        bucket = s3.new_bucket()
        FsspecStorage(f"s3://{bucket}/ckpt", storage_options=s3.storage_options)

or the pytest fixtures (import them into a test module or a conftest.py):
``s3_endpoint`` (one server per test session) and ``s3_bucket`` (a fresh, empty
bucket per test, so tests never see each other's objects).

When moto is missing or its server cannot start, the tests are skipped with the
reason; with ``CI=true`` in the environment that is a failure instead, so CI can
never go green by skipping the object-storage tests.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

KEY = "shardpoint-test"
SECRET = "shardpoint-test-secret"
REGION = "us-east-1"
START_TIMEOUT = float(os.environ.get("SHARDPOINT_S3_START_TIMEOUT", 60))


class S3ServerUnavailable(RuntimeError):
    """moto's server could not be started here."""


@dataclass
class S3Server:
    """A running loopback server; ``storage_options`` and ``env`` both point s3fs at it."""

    endpoint_url: str
    process: subprocess.Popen[bytes]
    buckets: list[str] = field(default_factory=list)

    @property
    def storage_options(self) -> dict[str, Any]:
        """Options for ``FsspecStorage`` / ``shardpoint.save(..., storage_options=)``."""
        return {
            "key": KEY,
            "secret": SECRET,
            "client_kwargs": {"endpoint_url": self.endpoint_url, "region_name": REGION},
        }

    @property
    def env(self) -> dict[str, str]:
        """The same as environment variables (for child processes that use no options)."""
        return {
            "AWS_ACCESS_KEY_ID": KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET,
            "AWS_DEFAULT_REGION": REGION,
            "AWS_ENDPOINT_URL": self.endpoint_url,
            "AWS_EC2_METADATA_DISABLED": "true",
        }

    def client(self) -> Any:
        """A plain boto3 client, to look at the server without going through s3fs."""
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint_url,
            region_name=REGION,
            aws_access_key_id=KEY,
            aws_secret_access_key=SECRET,
        )

    def new_bucket(self, prefix: str = "sp") -> str:
        """Create a new empty bucket and return its name."""
        name = f"{prefix}-{uuid.uuid4().hex[:16]}"
        self.client().create_bucket(Bucket=name)
        self.buckets.append(name)
        return name

    def keys(self, bucket: str, prefix: str = "") -> list[str]:
        """Every object key in ``bucket`` under ``prefix``, straight from the server."""
        out: list[str] = []
        for page in self.client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
            out += [o["Key"] for o in page.get("Contents", [])]
        return sorted(out)

    def open_uploads(self, bucket: str) -> list[str]:
        """Keys of multipart uploads that were started and neither completed nor aborted."""
        got = self.client().list_multipart_uploads(Bucket=bucket)
        return sorted(u["Key"] for u in got.get("Uploads", []))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _answers(url: str) -> bool:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: never via a proxy
    try:
        with opener.open(url + "/moto-api/data.json", timeout=2) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def _start(log: Any) -> tuple[subprocess.Popen[bytes], str]:
    try:
        import moto.server  # noqa: F401 - only to fail early with a clear reason
    except ImportError as e:
        raise S3ServerUnavailable(
            f"moto[server] is not installed ({e}); pip install 'moto[server]>=5'"
        ) from None
    env = dict(os.environ)
    env.pop("AWS_ENDPOINT_URL", None)
    last = ""
    for _attempt in range(3):  # the free port can be taken between probing and binding
        port = _free_port()
        url = f"http://127.0.0.1:{port}"
        proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
        )
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline and proc.poll() is None:
            if _answers(url):
                return proc, url
            time.sleep(0.1)
        _stop(proc)
        log.flush()
        log.seek(0)
        last = log.read().decode(errors="replace")[-2000:]
        if proc.returncode is not None and "address already in use" not in last.lower():
            break
    raise S3ServerUnavailable(
        f"moto's S3 server did not answer on 127.0.0.1 within {START_TIMEOUT:.0f}s; its output:\n{last}"
    )


@contextlib.contextmanager
def s3_server() -> Iterator[S3Server]:
    """Start moto's S3 server on a free loopback port, wait until it answers, and
    stop it (terminate, then kill) on exit. Raises :class:`S3ServerUnavailable`."""
    with tempfile.TemporaryFile() as log:
        proc, url = _start(log)
        saved = {k: os.environ.get(k) for k in ("NO_PROXY", "no_proxy")}
        try:
            for k in saved:  # botocore honours *_PROXY; loopback must go direct
                os.environ[k] = ",".join(filter(None, [saved[k], "127.0.0.1", "localhost"]))
            yield S3Server(endpoint_url=url, process=proc)
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
            _stop(proc)


def _unavailable(reason: str) -> None:
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"the loopback S3 server is required in CI (CI=true): {reason}", pytrace=False)
    pytest.skip(f"loopback S3 server unavailable: {reason}")


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[S3Server]:
    """One moto S3 server for the whole test session."""
    cm = s3_server()
    reason = None
    try:
        server = cm.__enter__()
    except S3ServerUnavailable as e:
        reason = str(e)
    if reason is not None:
        _unavailable(reason)
        return
    try:
        yield server
    finally:
        cm.__exit__(None, None, None)


@pytest.fixture
def s3_bucket(s3_endpoint: S3Server) -> str:
    """A fresh empty bucket on the session's server."""
    if s3_endpoint.process.poll() is not None:
        pytest.fail(f"the loopback S3 server exited with code {s3_endpoint.process.returncode}")
    return s3_endpoint.new_bucket()
