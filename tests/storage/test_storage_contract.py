"""The Storage contract, run against every storage: the local disk, fsspec's
memory filesystem and S3 (a real moto server on loopback). What the core relies
on must hold the same way everywhere."""

from __future__ import annotations

import array
import contextlib
import os
from concurrent.futures import ThreadPoolExecutor

import pytest

from shardpoint.errors import CorruptCheckpointError
from shardpoint.storage import Storage

DATA = bytes(range(256)) * 40 + b"tail"  # 10,244 bytes


def test_write_file_then_ranged_reads(storage: Storage) -> None:
    ints = array.array("i", range(100))  # a memoryview whose items are not bytes
    parts = [DATA[:1000], memoryview(DATA)[1000:5000], b"", memoryview(DATA[5000:]), memoryview(ints)]
    want = DATA + ints.tobytes()

    assert storage.write_file("data/rank-0.safetensors", iter(parts)) == len(want)

    assert storage.exists("data/rank-0.safetensors")
    assert storage.size("data/rank-0.safetensors") == len(want)
    assert bytes(storage.read("data/rank-0.safetensors")) == want
    for offset, length in [
        (0, 1),
        (3, 997),
        (999, 2),
        (4096, 4096),
        (len(want) - 7, 7),
        (123, 0),
        (len(want), 0),
    ]:
        got = storage.read("data/rank-0.safetensors", offset, length)
        assert bytes(got) == want[offset : offset + length], (offset, length)
    assert bytes(storage.read("data/rank-0.safetensors", 10_000)) == want[10_000:]
    assert bytes(storage.read("data/rank-0.safetensors", len(want))) == b""


def test_empty_file(storage: Storage) -> None:
    assert storage.write_file("empty", iter([])) == 0
    assert storage.exists("empty")
    assert storage.size("empty") == 0
    assert bytes(storage.read("empty")) == b""


def test_write_file_replaces(storage: Storage) -> None:
    storage.write_file("f", [b"x" * 100])
    storage.write_file("f", [b"y" * 10])
    assert bytes(storage.read("f")) == b"y" * 10


def test_missing_file_is_named(storage: Storage) -> None:
    with pytest.raises(CorruptCheckpointError, match=r"rank-7\.safetensors.*missing"):
        storage.read("rank-7.safetensors", 0, 10)
    with pytest.raises(CorruptCheckpointError, match=r"rank-7\.safetensors.*missing"):
        storage.read("rank-7.safetensors")
    assert not storage.exists("rank-7.safetensors")


@pytest.mark.parametrize(("offset", "length"), [(90, 20), (100, 1), (500, 10), (101, None)])
def test_short_file_is_named(storage: Storage, offset: int, length: int | None) -> None:
    storage.write_file("rank-0.safetensors", [b"z" * 100])
    with pytest.raises(CorruptCheckpointError, match=r"rank-0\.safetensors.*truncated") as info:
        storage.read("rank-0.safetensors", offset, length)
    assert storage.url in str(info.value)


def test_readv_into_scatters_one_range(storage: Storage) -> None:
    """One range of a file into several buffers in order (empty ones included), the
    same inside keep_open(), where a local disk reuses its descriptors."""
    storage.write_file("rank-0.safetensors", [DATA])
    sizes = [0, 1, 4095, 0, 3000, 3000]
    for keep in (False, True):
        bufs = [bytearray(n) for n in sizes]
        if keep:
            with storage.keep_open():
                storage.readv_into("rank-0.safetensors", 100, [memoryview(b) for b in bufs])
                storage.readv_into("rank-0.safetensors", 100, [memoryview(b) for b in bufs])  # the kept descriptor
        else:
            storage.readv_into("rank-0.safetensors", 100, [memoryview(b) for b in bufs])
        assert b"".join(bufs) == DATA[100 : 100 + sum(sizes)]
    one = bytearray(7)
    storage.readv_into("rank-0.safetensors", len(DATA) - 7, [memoryview(one)])
    assert bytes(one) == DATA[-7:]


def test_readv_into_past_the_end_is_named(storage: Storage) -> None:
    storage.write_file("rank-0.safetensors", [b"z" * 100])
    for keep in (False, True):
        with storage.keep_open() if keep else contextlib.nullcontext():
            with pytest.raises(CorruptCheckpointError, match=r"rank-0\.safetensors.*truncated") as info:
                storage.readv_into("rank-0.safetensors", 50, [memoryview(bytearray(30)), memoryview(bytearray(30))])
        assert storage.url in str(info.value)
    with pytest.raises(CorruptCheckpointError, match=r"rank-7\.safetensors.*missing"):
        storage.readv_into("rank-7.safetensors", 0, [memoryview(bytearray(1)), memoryview(bytearray(1))])


def test_keep_open_reads_what_is_written_after_it_ends(storage: Storage) -> None:
    """Descriptors kept for a load are closed when it ends: a file written again later
    is read anew."""
    storage.write_file("f", [b"x" * 10])
    with storage.keep_open():
        assert bytes(storage.read("f")) == b"x" * 10
    storage.write_file("f", [b"y" * 10])
    with storage.keep_open():
        assert bytes(storage.read("f")) == b"y" * 10


def test_write_atomic(storage: Storage) -> None:
    storage.write_atomic("manifest.json", b'{"step": 1}')
    storage.write_atomic("manifest.json", b'{"step": 2}')
    assert bytes(storage.read("manifest.json")) == b'{"step": 2}'
    assert storage.list() == ["manifest.json"]  # no temporary left behind


def test_create_new_creates_once(storage: Storage) -> None:
    assert storage.create_new("owners/00000001", b"first")
    assert not storage.create_new("owners/00000001", b"second")  # there already: nothing written
    assert bytes(storage.read("owners/00000001")) == b"first"
    assert storage.list() == ["owners/00000001"]  # no temporary left behind


def test_create_new_races_have_one_winner(storage: Storage) -> None:
    """Threads creating one name at once: exactly one wins, and its bytes are there
    (the store decides: a hard link locally, If-None-Match on S3). fsspec's memory
    filesystem has neither: the documented weaker form (a look-up, the write, a read
    back) lets a writer whose read-back came before the next write think it won too."""
    bodies = [f"writer {i}".encode() for i in range(8)]
    with ThreadPoolExecutor(8) as pool:
        won = list(pool.map(lambda b: storage.create_new("claim", b), bodies))
    there = bytes(storage.read("claim"))
    assert there in [b for b, w in zip(bodies, won) if w], (won, there)
    if not storage.url.startswith("memory://"):
        assert won.count(True) == 1, won


def test_sizes_lists_every_file_with_its_size(storage: Storage) -> None:
    assert storage.sizes() == {}
    storage.write_file("a.bin", [DATA])
    storage.write_file("sub/b.bin", [b"xyz"])
    storage.write_atomic("manifest.json", b"{}")
    assert storage.sizes() == {"a.bin": len(DATA), "sub/b.bin": 3, "manifest.json": 2}
    assert storage.child("sub").sizes() == {"b.bin": 3}


def test_list_and_list_dirs(storage: Storage) -> None:
    assert storage.list() == []
    assert storage.list_dirs() == []
    for name in ["manifest.json", "data/b.bin", "data/a.bin", "step-1/x/y.bin", "step-10/z.bin"]:
        storage.write_file(name, [name.encode()])
    assert storage.list() == ["data/a.bin", "data/b.bin", "manifest.json", "step-1/x/y.bin", "step-10/z.bin"]
    assert storage.list_dirs() == ["data", "step-1", "step-10"]
    assert storage.child("step-1").list() == ["x/y.bin"]
    assert storage.child("step-1").list_dirs() == ["x"]
    assert storage.child("nothing-here").list() == []
    assert storage.child("nothing-here").list_dirs() == []


def test_child_reads_what_parent_wrote(storage: Storage) -> None:
    storage.write_file("step-00000100/rank-0.bin", [b"abc"])
    child = storage.child("step-00000100")
    assert bytes(child.read("rank-0.bin", 1, 2)) == b"bc"
    assert child.url.rstrip("/").endswith("step-00000100")
    child.write_atomic("manifest.json", b"{}")
    assert storage.exists("step-00000100/manifest.json")


def test_remove_and_remove_all(storage: Storage) -> None:
    for name in ["step-1/a", "step-1/sub/b", "step-10/a", "step-2/a"]:
        storage.write_file(name, [b"1"])
    storage.remove("step-2/a")
    storage.remove("step-2/a")  # missing: no error
    assert not storage.exists("step-2/a")

    storage.child("step-1").remove_all()
    assert storage.list() == ["step-10/a"]  # a sibling whose name starts the same is untouched
    assert "step-1" not in storage.list_dirs()
    storage.child("step-1").remove_all()  # already gone: no error

    storage.remove_all()
    assert storage.list() == []
    assert storage.list_dirs() == []


@pytest.mark.parametrize("bad", ["../x", "/abs", "a/../b", "a//b", "", ".", "x/..", "a\\b", "~/x"])
def test_unsafe_names_refused(storage: Storage, bad: str) -> None:
    calls = [
        lambda: storage.write_file(bad, [b"evil"]),
        lambda: storage.write_atomic(bad, b"evil"),
        lambda: storage.read(bad, 0, 1),
        lambda: storage.exists(bad),
        lambda: storage.size(bad),
        lambda: storage.remove(bad),
        lambda: storage.child(bad),
    ]
    for call in calls:
        with pytest.raises(CorruptCheckpointError, match="not a plain relative name"):
            call()
    assert storage.list() == []


def test_parallel_writes_and_reads(storage: Storage) -> None:
    """The core writes and reads from a thread pool through one storage."""
    blobs = {f"rank-{i}.bin": os.urandom(50_000 + i) for i in range(8)}

    def write(name: str) -> int:
        return storage.write_file(name, [memoryview(blobs[name])[:7], memoryview(blobs[name])[7:]])

    with ThreadPoolExecutor(8) as ex:
        assert list(ex.map(write, blobs)) == [len(b) for b in blobs.values()]

    def read(job: tuple[str, int]) -> bool:
        name, offset = job
        return bytes(storage.read(name, offset, 1000)) == blobs[name][offset : offset + 1000]

    jobs = [(name, off) for name in blobs for off in range(0, 48_000, 4_000)]
    with ThreadPoolExecutor(8) as ex:
        assert all(ex.map(read, jobs))
    assert storage.list() == sorted(blobs)
