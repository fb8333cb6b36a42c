"""The local disk's read settings: the descriptors a load keeps open and the
parallel reads per rank."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from shardpoint.errors import UsageError
from shardpoint.load.read import io_threads
from shardpoint.storage import LocalStorage
from shardpoint.storage.local import local_read_threads


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc")
def test_keep_open_keeps_a_bounded_number_of_descriptors(tmp_path: Path) -> None:
    s = LocalStorage(tmp_path)
    for i in range(200):
        s.write_file(f"r{i:05d}.safetensors", [bytes([i]) * 10])
    before = _open_fds()
    with s.keep_open():
        for _ in range(2):
            for i in range(200):
                assert bytes(s.read(f"r{i:05d}.safetensors", 3, 2)) == bytes([i]) * 2
        during = _open_fds()
    assert during - before <= 64, f"{during - before} descriptors kept open for 200 files"
    assert _open_fds() == before, "keep_open() left descriptors open"


def test_read_threads_follow_the_cores_of_each_local_rank(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert local_read_threads() == max(1, min(4, cores))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(cores * 8))
    assert local_read_threads() == 1
    monkeypatch.delenv("SHARDPOINT_IO_THREADS", raising=False)
    assert io_threads(LocalStorage(tmp_path)) == 1
    monkeypatch.setenv("SHARDPOINT_IO_THREADS", "3")
    assert io_threads(LocalStorage(tmp_path)) == 3
    monkeypatch.setenv("SHARDPOINT_IO_THREADS", "many")
    with pytest.raises(UsageError, match="SHARDPOINT_IO_THREADS"):
        io_threads(LocalStorage(tmp_path))
