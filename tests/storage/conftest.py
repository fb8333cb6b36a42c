"""Storage test fixtures: the loopback S3 server and one storage of each kind."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from shardpoint.storage import LocalStorage, Storage
from tests.s3proxy import FaultProxy
from tests.s3server import S3Server, s3_bucket, s3_endpoint  # noqa: F401 - fixtures

KINDS = ["local", "memory", "s3"]


def make_storage(kind: str, request: pytest.FixtureRequest, tmp_path) -> Storage:  # type: ignore[no-untyped-def]
    if kind == "local":
        return LocalStorage(tmp_path / "ckpt")
    from shardpoint.storage.fsspec import FsspecStorage

    if kind == "memory":
        return FsspecStorage(f"memory://shardpoint-test-{uuid.uuid4().hex}/ckpt")
    server: S3Server = request.getfixturevalue("s3_endpoint")
    bucket = request.getfixturevalue("s3_bucket")
    return FsspecStorage(f"s3://{bucket}/ckpt", storage_options=server.storage_options)


@pytest.fixture(params=KINDS)
def storage(request: pytest.FixtureRequest, tmp_path) -> Iterator[Storage]:  # type: ignore[no-untyped-def]
    """The same checkpoint location on the local disk, in fsspec memory and on S3."""
    st = make_storage(request.param, request, tmp_path)
    yield st
    if request.param == "memory":
        st.remove_all()


@pytest.fixture(scope="module")
def fault_proxy(s3_endpoint: S3Server) -> Iterator[FaultProxy]:  # noqa: F811 - the fixture
    """A fault-injecting proxy (tests/s3proxy.py) in front of the session's server,
    unarmed: it forwards everything until a test arms it."""
    with FaultProxy(s3_endpoint.endpoint_url, stall_s=120) as p:
        yield p
