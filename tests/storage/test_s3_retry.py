"""shardpoint's own retries on S3 (storage/retry.py, storage/s3.py), one process,
through the fault-injecting proxy in front of the loopback server: the options and
their bounds, errors that are not retried, and what a failed write reports when
its abort fails too."""

from __future__ import annotations

import os

import pytest

from shardpoint.errors import ShardpointError
from shardpoint.storage.fsspec import FsspecStorage
from shardpoint.storage.retry import ObjectStoreError, Retry, RetryOptionError
from tests.s3proxy import FaultProxy
from tests.s3server import S3Server

pytestmark = [pytest.mark.s3, pytest.mark.timeout(300)]
MiB = 1 << 20
ATTEMPTS = 3
FAST: dict[str, float] = {"attempts": ATTEMPTS, "base_delay": 0.01, "max_delay": 0.05, "timeout": 2.0}


def _store(proxy: FaultProxy, bucket: str, **retry: float) -> FsspecStorage:
    return FsspecStorage(f"s3://{bucket}/ckpt", storage_options=dict(proxy.storage_options, shardpoint_retry=dict(FAST, **retry)))


def test_retry_options_from_arguments_then_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    assert Retry.resolve(None) == Retry()
    monkeypatch.setenv("SHARDPOINT_S3_RETRIES", "9")
    monkeypatch.setenv("SHARDPOINT_S3_TIMEOUT", "2.5")
    assert Retry.resolve(None) == Retry(attempts=9, timeout=2.5)
    assert Retry.resolve({"attempts": 2}) == Retry(attempts=2, timeout=2.5)
    given = Retry(attempts=1)
    assert Retry.resolve(given) is given
    monkeypatch.setenv("SHARDPOINT_S3_RETRIES", "many")
    with pytest.raises(RetryOptionError, match="SHARDPOINT_S3_RETRIES='many' is not a int"):
        Retry.resolve(None)
    monkeypatch.delenv("SHARDPOINT_S3_RETRIES")
    for bad, match in [({"attempts": 0}, "attempts=0"), ({"timeout": 0}, "timeout=0"),
                       ({"retries": 3}, r"unknown fields \['retries'\]"), ([3], "is a list")]:
        with pytest.raises(RetryOptionError, match=match) as info:
            Retry.resolve(bad)  # type: ignore[arg-type]
        assert isinstance(info.value, ValueError) and isinstance(info.value, ShardpointError)


def test_a_backoff_stays_within_its_bounds() -> None:
    r = Retry(base_delay=0.2, max_delay=1.0)
    for attempt, cap in [(1, 0.2), (2, 0.4), (3, 0.8), (4, 1.0), (10, 1.0)]:
        got = [r.delay(attempt) for _ in range(200)]
        assert all(0 <= d <= cap for d in got) and max(got) > cap / 2  # jittered over the whole range


@pytest.mark.parametrize("kind", ["500", "503", "reset", "stall"])
def test_a_read_makes_exactly_attempts_requests_then_names_the_object(
    kind: str, fault_proxy: FaultProxy, s3_endpoint: S3Server, s3_bucket: str
) -> None:
    st = _store(fault_proxy, s3_bucket, timeout=0.5)
    data = os.urandom(1000)
    st.write_file("rank-0.bin", [data])
    fault_proxy.arm(kind, range(100))
    try:
        with pytest.raises(ObjectStoreError) as info:
            st.read("rank-0.bin", 10, 100)
        assert fault_proxy.seen == ATTEMPTS
    finally:
        fault_proxy.disarm()
    assert f"reading {st.url}/rank-0.bin failed after 3 attempts" in str(info.value)
    assert "shardpoint_retry" in str(info.value)  # says how to allow more
    assert st.read("rank-0.bin", 10, 100) == data[10:110]


def test_an_error_that_is_not_transient_is_not_retried(fault_proxy: FaultProxy) -> None:
    st = _store(fault_proxy, "no-such-bucket-shardpoint")
    fault_proxy.arm(None)
    with pytest.raises(ObjectStoreError, match=r"writing s3://no-such-bucket-shardpoint/ckpt/manifest.json failed: .*NoSuchBucket"):
        st.write_atomic("manifest.json", b"{}")
    assert fault_proxy.seen == 1


def test_a_failed_write_whose_abort_fails_too_names_the_upload(
    fault_proxy: FaultProxy, s3_endpoint: S3Server, s3_bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import shardpoint.storage.fsspec as fsspec_storage

    monkeypatch.setattr(fsspec_storage, "BLOCK_SIZE", 5 * MiB)
    st = _store(fault_proxy, s3_bucket)
    fault_proxy.arm("500", range(1, 1000))  # the create gets through; nothing after it does
    try:
        with pytest.raises(ObjectStoreError) as info:
            st.write_file("rank-0.bin", [b"\1" * (12 * MiB)])
    finally:
        fault_proxy.disarm()
    err = info.value
    assert f"{st.url}/rank-0.bin" in str(err)
    notes = "\n".join(getattr(err, "__notes__", []))
    left = s3_endpoint.open_uploads(s3_bucket)
    assert left == ["ckpt/rank-0.bin"]
    upload = s3_endpoint.client().list_multipart_uploads(Bucket=s3_bucket)["Uploads"][0]["UploadId"]
    assert f"aborting the multipart upload {upload} of {st.url}/rank-0.bin failed too" in notes
    assert "lifecycle rule" in notes
    s3_endpoint.client().abort_multipart_upload(Bucket=s3_bucket, Key="ckpt/rank-0.bin", UploadId=upload)
    assert not st.exists("rank-0.bin")


def test_a_lost_complete_answer_is_checked_not_failed(
    fault_proxy: FaultProxy, s3_endpoint: S3Server, s3_bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every answer to CompleteMultipartUpload lost (it was applied the first time):
    the retries get NoSuchUpload or are lost too, the object is checked, the write succeeds."""
    import shardpoint.storage.fsspec as fsspec_storage

    monkeypatch.setattr(fsspec_storage, "BLOCK_SIZE", 5 * MiB)
    st = _store(fault_proxy, s3_bucket)
    data = os.urandom(11 * MiB)
    fault_proxy.arm("drop", [1], methods=["POST"], repeat=ATTEMPTS)  # POST 0 creates, POST 1 completes
    try:
        assert st.write_file("rank-0.bin", [data]) == len(data)
        assert [f.method for f in fault_proxy.faults] == ["POST"] * 3
    finally:
        fault_proxy.disarm()
    assert st.read("rank-0.bin") == data
    assert s3_endpoint.open_uploads(s3_bucket) == []
