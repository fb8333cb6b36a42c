"""The loopback S3 fixture itself: it cleans up after itself, and when the server
cannot start it skips with the reason, except under CI=true where it fails."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.s3server import S3Server, S3ServerUnavailable, s3_server

pytestmark = pytest.mark.s3
REPO = Path(__file__).resolve().parents[2]


def test_server_answers_and_stops() -> None:
    with s3_server() as s3:
        bucket = s3.new_bucket()
        s3.client().put_object(Bucket=bucket, Key="k", Body=b"v")
        assert s3.keys(bucket) == ["k"]
        proc = s3.process
        assert s3.endpoint_url.startswith("http://127.0.0.1:")
    assert proc.poll() is not None  # stopped on exit


def test_two_servers_side_by_side(s3_endpoint: S3Server) -> None:
    with s3_server() as other:
        assert other.endpoint_url != s3_endpoint.endpoint_url
        b = other.new_bucket()
        assert b not in [x["Name"] for x in s3_endpoint.client().list_buckets()["Buckets"]]


def test_start_failure_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    import tests.s3server as mod

    monkeypatch.setattr(mod, "START_TIMEOUT", 0.0)
    with pytest.raises(S3ServerUnavailable, match="did not answer"):
        with s3_server():
            pass


@pytest.mark.parametrize(("ci", "outcome"), [("", "1 skipped"), ("true", "1 error")])
def test_unavailable_server_skips_except_in_ci(tmp_path: Path, ci: str, outcome: str) -> None:
    (tmp_path / "test_uses_s3.py").write_text(
        textwrap.dedent("""
        from tests.s3server import s3_bucket, s3_endpoint  # noqa: F401

        def test_needs_s3(s3_bucket):
            pass
    """)
    )
    env = dict(os.environ, SHARDPOINT_S3_START_TIMEOUT="0", CI=ci, PYTHONPATH=str(REPO))
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rsf", "-p", "no:cacheprovider", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=tmp_path,
    )
    assert outcome in out.stdout, out.stdout[-3000:]
    assert "did not answer" in out.stdout
