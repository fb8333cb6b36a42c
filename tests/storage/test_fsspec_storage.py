"""FsspecStorage on S3: multipart uploads, visibility of writes, aborted uploads,
configuration. Every test talks HTTP to a real moto server on loopback."""

from __future__ import annotations

import gc
import os
import threading
import time
from collections.abc import Iterator

import pytest
import torch

import shardpoint.storage.fsspec as fsspec_storage
from shardpoint.errors import CorruptCheckpointError
from shardpoint.storage import storage_for
from shardpoint.storage.fsspec import FsspecStorage
from tests.s3server import S3Server

pytestmark = pytest.mark.s3
MiB = 1 << 20


@pytest.fixture
def store(s3_endpoint: S3Server, s3_bucket: str) -> FsspecStorage:
    return FsspecStorage(f"s3://{s3_bucket}/run/step-5", storage_options=s3_endpoint.storage_options)


@pytest.fixture
def small_blocks(monkeypatch: pytest.MonkeyPatch) -> int:
    monkeypatch.setattr(fsspec_storage, "BLOCK_SIZE", 5 * MiB)  # S3's smallest part
    return 5 * MiB


def test_storage_for_picks_fsspec_and_keeps_the_url(s3_endpoint: S3Server, s3_bucket: str) -> None:
    url = f"s3://{s3_bucket}/run/step-5"
    st = storage_for(url, s3_endpoint.storage_options)
    assert isinstance(st, FsspecStorage)
    assert st.url == url
    assert st.child("sub").url == url + "/sub"
    with pytest.raises(CorruptCheckpointError) as info:
        st.read("rank-3.safetensors", 0, 8)
    assert f"{url}/rank-3.safetensors" in str(info.value)


def test_large_object_is_a_multipart_upload(
    store: FsspecStorage, s3_endpoint: S3Server, s3_bucket: str, small_blocks: int
) -> None:
    data = os.urandom(3 * small_blocks + 12_345)
    view = memoryview(data)
    # parts that straddle block boundaries, one bigger than a block
    cuts = [0, 1000, 7 * MiB, 7 * MiB + 1, 10 * MiB - 3, len(data)]
    parts = [view[a:b] for a, b in zip(cuts, cuts[1:], strict=False)]

    assert store.write_file("rank-0.safetensors", iter(parts)) == len(data)

    head = s3_endpoint.client().head_object(Bucket=s3_bucket, Key="run/step-5/rank-0.safetensors")
    assert head["ContentLength"] == len(data)
    assert head["ETag"].strip('"').endswith("-4")  # 3 full blocks + the tail, one part each
    assert s3_endpoint.open_uploads(s3_bucket) == []
    for offset, length in [
        (0, 16),
        (small_blocks - 8, 16),
        (2 * small_blocks - 1, small_blocks + 2),
        (len(data) - 5, 5),
    ]:
        assert store.read("rank-0.safetensors", offset, length) == data[offset : offset + length]
    assert store.read("rank-0.safetensors") == data


def test_write_file_is_invisible_until_it_returns(
    store: FsspecStorage, s3_endpoint: S3Server, s3_bucket: str, small_blocks: int
) -> None:
    seen: list[tuple[bool, list[str]]] = []
    other = FsspecStorage(store.url, storage_options=s3_endpoint.storage_options)

    def parts() -> Iterator[bytes]:
        for _ in range(3):
            yield b"\1" * small_blocks  # each completes a block: a part goes up
            seen.append((other.exists("rank-0.bin"), s3_endpoint.keys(s3_bucket)))

    store.write_file("rank-0.bin", parts())
    assert seen == [(False, [])] * 3
    assert len(s3_endpoint.open_uploads(s3_bucket)) == 0
    assert other.exists("rank-0.bin") and other.size("rank-0.bin") == 3 * small_blocks


def _versions(s3: S3Server, bucket: str) -> list[tuple[str, int]]:
    """Every object version ever completed in ``bucket`` (the bucket is versioned),
    so a partial object that was published and then deleted still shows."""
    got = s3.client().list_object_versions(Bucket=bucket)
    return sorted((v["Key"], v["Size"]) for v in got.get("Versions", []))


def test_failed_write_aborts_the_upload(
    store: FsspecStorage, s3_endpoint: S3Server, s3_bucket: str, small_blocks: int
) -> None:
    s3_endpoint.client().put_bucket_versioning(
        Bucket=s3_bucket, VersioningConfiguration={"Status": "Enabled"}
    )

    def parts() -> Iterator[bytes]:
        yield b"\2" * (2 * small_blocks + 10)  # two parts uploaded
        assert s3_endpoint.open_uploads(s3_bucket) == ["run/step-5/rank-0.bin"]
        raise RuntimeError("rank died while serialising")

    with pytest.raises(RuntimeError, match="rank died"):
        store.write_file("rank-0.bin", parts())
    gc.collect()  # a dropped file object must not complete the upload either
    assert _versions(s3_endpoint, s3_bucket) == []  # never published, not even for a moment
    assert s3_endpoint.open_uploads(s3_bucket) == []
    assert not store.exists("rank-0.bin")


def test_failed_small_write_publishes_nothing(
    store: FsspecStorage, s3_endpoint: S3Server, s3_bucket: str
) -> None:
    s3_endpoint.client().put_bucket_versioning(
        Bucket=s3_bucket, VersioningConfiguration={"Status": "Enabled"}
    )
    store.write_file("rank-0.bin", [b"old"])

    def parts() -> Iterator[bytes]:
        yield b"new, but never finished"
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        store.write_file("rank-0.bin", parts())
    gc.collect()
    assert _versions(s3_endpoint, s3_bucket) == [("run/step-5/rank-0.bin", 3)]  # only the old one
    assert not store.exists("rank-0.bin")  # like a local file, a failed write leaves no file


def test_write_atomic_readers_see_all_or_nothing(store: FsspecStorage, s3_endpoint: S3Server) -> None:
    payloads = [bytes([i]) * (2 * MiB + 17 * i) for i in range(4)]
    store.write_atomic("manifest.json", payloads[0])
    reader = FsspecStorage(store.url, storage_options=s3_endpoint.storage_options)
    stop = threading.Event()
    bad: list[str] = []
    reads = [0]

    def watch() -> None:
        while not stop.is_set():
            got = reader.read("manifest.json")
            reads[0] += 1
            if got not in payloads:
                bad.append(f"torn read: {len(got)} bytes starting {got[:1]!r}")

    t = threading.Thread(target=watch)
    t.start()
    try:
        deadline = time.monotonic() + 2
        i = 0
        while time.monotonic() < deadline:
            i += 1
            store.write_atomic("manifest.json", payloads[i % len(payloads)])
    finally:
        stop.set()
        t.join(timeout=30)
    assert not bad
    assert reads[0] > 3 and i > 3


def test_a_manifest_written_elsewhere_is_seen_at_once(
    store: FsspecStorage, s3_endpoint: S3Server, s3_bucket: str
) -> None:
    """No stale listings: another process commits, this one sees it."""
    root = FsspecStorage(f"s3://{s3_bucket}/run", storage_options=s3_endpoint.storage_options)
    assert root.list_dirs() == [] and not store.exists("manifest.json")
    s3_endpoint.client().put_object(Bucket=s3_bucket, Key="run/step-5/manifest.json", Body=b"{}")
    assert store.exists("manifest.json")
    assert root.list_dirs() == ["step-5"]
    assert root.list() == ["step-5/manifest.json"]
    s3_endpoint.client().delete_object(Bucket=s3_bucket, Key="run/step-5/manifest.json")
    assert not store.exists("manifest.json")
    assert root.list_dirs() == []


def test_remove_all_at_the_bucket_root_keeps_the_bucket(s3_endpoint: S3Server, s3_bucket: str) -> None:
    st = FsspecStorage(f"s3://{s3_bucket}", storage_options=s3_endpoint.storage_options)
    for i in range(5):
        st.write_file(f"step-{i}/rank-0.bin", [b"x"])
    assert st.list_dirs() == [f"step-{i}" for i in range(5)]
    st.remove_all()
    assert s3_endpoint.keys(s3_bucket) == []
    assert s3_bucket in [b["Name"] for b in s3_endpoint.client().list_buckets()["Buckets"]]


def test_credentials_and_endpoint_from_the_environment(
    s3_endpoint: S3Server, s3_bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    for k, v in s3_endpoint.env.items():
        monkeypatch.setenv(k, v)
    st = storage_for(f"s3://{s3_bucket}/env")
    st.write_atomic("manifest.json", b"{}")
    assert s3_endpoint.keys(s3_bucket) == ["env/manifest.json"]


def test_unsafe_names_refused_before_any_request() -> None:
    """The endpoint is a closed loopback port: any request would fail with a
    connection error, so the CorruptCheckpointError proves none was made."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    st = FsspecStorage(
        "s3://nowhere/ckpt",
        storage_options={
            "key": "k",
            "secret": "s",
            "client_kwargs": {"endpoint_url": dead, "region_name": "us-east-1"},
            "config_kwargs": {"retries": {"max_attempts": 1}, "connect_timeout": 1},
        },
    )
    for bad in ["../x", "/etc/passwd", "a/../../b"]:
        calls = [
            lambda b: st.read(b, 0, 4),
            lambda b: st.write_file(b, [b"x"]),
            lambda b: st.write_atomic(b, b"x"),
            lambda b: st.exists(b),
            lambda b: st.child(b),
        ]
        for call in calls:
            with pytest.raises(CorruptCheckpointError, match="not a plain relative name"):
                call(bad)


def test_block_size_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHARDPOINT_S3_BLOCK_SIZE", str(8 * MiB))
    assert fsspec_storage._env_size("SHARDPOINT_S3_BLOCK_SIZE", 64 * MiB) == 8 * MiB
    monkeypatch.delenv("SHARDPOINT_S3_BLOCK_SIZE")
    assert fsspec_storage._env_size("SHARDPOINT_S3_BLOCK_SIZE", 64 * MiB) == 64 * MiB
    monkeypatch.setenv("SHARDPOINT_S3_BLOCK_SIZE", "64MB")
    with pytest.raises(ValueError, match="SHARDPOINT_S3_BLOCK_SIZE='64MB' is not a whole number of bytes"):
        fsspec_storage._env_size("SHARDPOINT_S3_BLOCK_SIZE", 64 * MiB)


_KILLED_WRITER = """
import json, os, signal, sys
import shardpoint.storage.fsspec as m
m.BLOCK_SIZE = 5 << 20
st = m.FsspecStorage(sys.argv[1], storage_options=json.loads(sys.argv[2]))
def parts():
    yield b"\\3" * (2 * m.BLOCK_SIZE + 10)  # two parts uploaded
    os.kill(os.getpid(), signal.SIGKILL)
st.write_file("rank-0.bin", parts())
"""


def test_killed_writer_publishes_nothing(store: FsspecStorage, s3_endpoint: S3Server, s3_bucket: str) -> None:
    """SIGKILL in the middle of a multipart upload: no object, ever. The unfinished
    upload stays on the server (a bucket lifecycle rule expires those)."""
    import json
    import subprocess
    import sys

    s3_endpoint.client().put_bucket_versioning(
        Bucket=s3_bucket, VersioningConfiguration={"Status": "Enabled"}
    )
    proc = subprocess.run(
        [sys.executable, "-c", _KILLED_WRITER, store.url, json.dumps(s3_endpoint.storage_options)],
        capture_output=True,
        timeout=120,
    )
    assert proc.returncode == -9, proc.stderr.decode()[-2000:]
    assert _versions(s3_endpoint, s3_bucket) == []
    assert not store.exists("rank-0.bin")
    assert s3_endpoint.open_uploads(s3_bucket) == ["run/step-5/rank-0.bin"]


def test_a_client_that_cannot_be_made_is_a_usage_error_naming_the_option(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """storage_options that name a profile that does not exist: a UsageError that says
    which option, not botocore's ProfileNotFound."""
    import shardpoint
    from shardpoint.errors import UsageError

    pytest.importorskip("s3fs")
    with pytest.raises(UsageError, match=r"s3://bucket/x cannot be made from its options: ProfileNotFound.*profile="):
        shardpoint.save({"w": torch.ones(2)}, "s3://bucket/x", storage_options={"profile": "no-such-profile-here"})
