"""Partial reads: a target that needs part of a saved chunk reads that byte range
straight into its memory, and the CRC blocks at both ends are still verified."""

from __future__ import annotations

import pytest
import torch

import shardpoint
from shardpoint.format import datafile
from shardpoint.layout import FlatShard
from shardpoint.saving import coordinator as _coordinator

BLOCK = 256  # bytes per CRC block in these tests


@pytest.fixture()
def ckpt(tmp_path, monkeypatch):  # type: ignore[no-untyped-def]
    monkeypatch.setattr(datafile, "CRC_BLOCK", BLOCK)
    monkeypatch.setattr(_coordinator, "CRC_BLOCK", BLOCK)
    w = torch.arange(1000, dtype=torch.float32)  # 4000 bytes: blocks of 64 elements
    shardpoint.save({"w": w}, tmp_path / "c")
    meta = shardpoint.metadata(tmp_path / "c")
    assert meta.tensors["w"].nbytes == 4000
    return tmp_path / "c", w


def _data_file(path):  # type: ignore[no-untyped-def]
    return next(p for p in path.iterdir() if p.suffix == ".safetensors")


def _chunk_offset(path) -> int:  # type: ignore[no-untyped-def]
    import json

    (index,) = path.glob("*.index.json")  # the data file's index: where each chunk lies
    return json.loads(index.read_text())["chunks"]["w@0"][0]


def test_partial_read_is_exact_and_reads_only_the_touched_blocks(ckpt) -> None:  # type: ignore[no-untyped-def]
    path, w = ckpt
    target = torch.zeros(300)
    r = shardpoint.load({"w": FlatShard(target, (1000,), 100)}, path)  # elements 100..399: bytes 400..1600
    assert torch.equal(target, w[100:400])
    # blocks 1..6 (bytes 256..1792) are read, not the whole 4000-byte chunk
    assert r.bytes_read == 1792 - 256
    r = shardpoint.load({"w": FlatShard(torch.zeros(300), (1000,), 100)}, path, verify=False)
    assert r.bytes_read == 1200


@pytest.mark.parametrize("byte", [300, 1000, 1700])  # in the head block, the middle, the tail block
def test_corruption_in_a_partially_read_block_is_caught(ckpt, byte: int) -> None:  # type: ignore[no-untyped-def]
    path, _ = ckpt
    f = _data_file(path)
    data = bytearray(f.read_bytes())
    data[_chunk_offset(path) + byte] ^= 0x10
    f.write_bytes(bytes(data))
    with pytest.raises(shardpoint.CorruptCheckpointError, match="checksum mismatch.*'w'"):
        shardpoint.load({"w": FlatShard(torch.zeros(300), (1000,), 100)}, path)


def test_corruption_outside_the_touched_blocks_does_not_fail_a_partial_read(ckpt) -> None:  # type: ignore[no-untyped-def]
    path, w = ckpt
    f = _data_file(path)
    data = bytearray(f.read_bytes())
    data[_chunk_offset(path) + 3000] ^= 0x10
    f.write_bytes(bytes(data))
    target = torch.zeros(300)
    shardpoint.load({"w": FlatShard(target, (1000,), 100)}, path)
    assert torch.equal(target, w[100:400])
    with pytest.raises(shardpoint.CorruptCheckpointError):
        shardpoint.load_full(path)  # a full read does meet it


@pytest.mark.parametrize("threads", ["1", "2"])
@pytest.mark.parametrize("batch", [8 << 20, 512], ids=["a small chunk", "a large chunk"])
def test_a_chunk_read_in_pieces_smaller_than_its_blocks_is_checked_block_by_block(  # type: ignore[no-untyped-def]
        ckpt, monkeypatch, batch: int, threads: str) -> None:
    """A verified read of whole blocks asks for ``read_piece`` bytes at a time and
    chains each piece's CRC into its block's (here 64-byte pieces of 256-byte blocks, 128
    with two read threads): the values are exact, and a flipped byte in a block's
    later piece fails that block, named by key and byte range. A large chunk is cut
    into a task per block when the rank reads with more than one thread."""
    from shardpoint.storage.local import LocalStorage

    path, w = ckpt
    monkeypatch.setattr(LocalStorage, "read_piece", 64)
    monkeypatch.setattr(LocalStorage, "read_batch", batch)  # 512: "large" is above 64 bytes
    monkeypatch.setenv("SHARDPOINT_IO_THREADS", threads)
    target = torch.zeros(1000)
    r = shardpoint.load({"w": target}, path)
    assert torch.equal(target, w) and r.bytes_read == 4000
    f, at = _data_file(path), _chunk_offset(path)
    intact = f.read_bytes()
    data = bytearray(intact)
    data[at + 2 * BLOCK + 150] ^= 0x10  # block 2, its third 64-byte piece (its second of 128)
    f.write_bytes(bytes(data))
    with pytest.raises(shardpoint.CorruptCheckpointError,
                       match=rf"checksum mismatch in .* \(bytes {at + 2 * BLOCK}\.\.{at + 3 * BLOCK}\) for key 'w'"):
        shardpoint.load({"w": torch.zeros(1000)}, path)
    f.write_bytes(intact[: at + 3 * BLOCK + 10])  # ends in block 3's first piece
    with pytest.raises(shardpoint.CorruptCheckpointError, match="key 'w'.*truncated"):
        shardpoint.load({"w": torch.zeros(1000)}, path)


@pytest.mark.parametrize(("threads", "piece"), [("1", 256 << 10), ("2", 512 << 10), ("4", 512 << 10)])
def test_a_reader_with_several_threads_reads_twice_the_storages_piece(tmp_path, monkeypatch, threads: str,  # type: ignore[no-untyped-def]
                                                                      piece: int) -> None:
    """Each piece's read and CRC hand the GIL over: a rank that reads with several
    threads asks for twice the storage's piece at a time (a piece sized for the CPU's
    cache, below a checksum block, and never past the block), one thread for the
    piece itself; a piece of a block or more, or none (a range in one call), stays."""
    from shardpoint.load.read import Reader
    from shardpoint.storage.local import LocalStorage

    block = 1 << 20  # the format's checksum block
    monkeypatch.setenv("SHARDPOINT_IO_THREADS", threads)
    local = LocalStorage(tmp_path)
    assert local.read_piece == 256 << 10
    r = Reader(local, block)
    assert (r.threads, r.piece) == (int(threads), piece)
    assert Reader(local, 384 << 10).piece == (384 << 10 if threads != "1" else 256 << 10)  # up to the block
    monkeypatch.setattr(LocalStorage, "read_piece", 4 << 20)  # a request's size, not the cache's
    assert Reader(LocalStorage(tmp_path), block).piece == 4 << 20
    monkeypatch.setattr(LocalStorage, "read_piece", None)
    assert Reader(LocalStorage(tmp_path), block).piece is None


def test_read_into_crcs_gives_each_blocks_crc_on_a_local_disk_and_through_the_generic_reads(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The local disk's one loop over its descriptor and the base class's piece by
    piece :meth:`read_into` agree with CRCs computed over the whole file, for blocks
    that pieces divide and blocks they do not; a short file raises naming it."""
    from shardpoint.storage.base import Storage
    from shardpoint.storage.local import LocalStorage

    data = bytes(range(256)) * 41 + b"tail"  # 10,500 bytes
    (tmp_path / "f.bin").write_bytes(data)
    store = LocalStorage(str(tmp_path))
    for block, piece in [(1024, 256), (1000, 300), (4096, 4096), (512, 1 << 20)]:
        want = [datafile.crc32(data[s : s + block]) for s in range(100, len(data), block)]
        for read in (LocalStorage.read_into_crcs, Storage.read_into_crcs):
            buf = memoryview(bytearray(len(data) - 100))
            assert read(store, "f.bin", 100, buf, block, piece) == want
            assert bytes(buf) == data[100:]
    for read in (LocalStorage.read_into_crcs, Storage.read_into_crcs):
        with pytest.raises(shardpoint.CorruptCheckpointError, match="f.bin.*truncated"):
            read(store, "f.bin", 100, memoryview(bytearray(len(data))), 1024, 256)


@pytest.mark.parametrize("threads", ["1", "2"])
@pytest.mark.parametrize("byte", [300, 1000, 3700])  # in the head block, a middle block, the tail block
def test_a_partial_read_reads_its_whole_blocks_in_pieces_and_completes_the_blocks_at_its_ends(  # type: ignore[no-untyped-def]
        ckpt, monkeypatch, byte: int, threads: str) -> None:
    """Elements 100..900 (bytes 400..3600): the whole blocks inside (bytes 512..3584)
    are read in 64-byte pieces with their CRCs, the partial blocks at the two ends are
    completed with reads of their outer bytes; the values are exact, the bytes read are
    the touched blocks', and a flipped byte anywhere in them fails its block by name."""
    from shardpoint.storage.local import LocalStorage

    path, w = ckpt
    monkeypatch.setattr(LocalStorage, "read_piece", 64)
    monkeypatch.setattr(LocalStorage, "read_batch", 512)
    monkeypatch.setenv("SHARDPOINT_IO_THREADS", threads)
    target = torch.zeros(800)
    r = shardpoint.load({"w": FlatShard(target, (1000,), 100)}, path)
    assert torch.equal(target, w[100:900]) and r.bytes_read == 3840 - 256  # blocks 1..14
    f, at = _data_file(path), _chunk_offset(path)
    data = bytearray(f.read_bytes())
    data[at + byte] ^= 0x10
    f.write_bytes(bytes(data))
    first = byte // BLOCK * BLOCK
    with pytest.raises(shardpoint.CorruptCheckpointError,
                       match=rf"checksum mismatch in .* \(bytes {at + first}\.\.{at + first + BLOCK}\) for key 'w'"):
        shardpoint.load({"w": FlatShard(torch.zeros(800), (1000,), 100)}, path)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.complex64])
def test_a_targets_bytes_are_its_own_memory_writable_and_exactly_as_long(dtype: torch.dtype) -> None:
    """The view a read writes a contiguous CPU target through (a slice of one view over
    the process's memory) covers exactly the target's bytes: writing it changes the
    tensor, and its neighbours in the same storage are untouched."""
    from shardpoint.load.read import _bytes_of

    whole = torch.zeros(64, dtype=dtype)
    part = whole[8:24]  # contiguous, inside a larger storage
    view = _bytes_of(part)
    assert len(view) == part.nbytes and view.format == "B" and not view.readonly
    src = torch.ones(16, dtype=dtype)
    view[:] = src.view(torch.uint8).numpy().tobytes()
    assert torch.equal(whole[8:24], src) and not whole[:8].any() and not whole[24:].any()
    p = torch.nn.Parameter(torch.zeros(5))  # requires grad: its memory all the same
    _bytes_of(p)[:4] = torch.tensor([2.0]).view(torch.uint8).numpy().tobytes()
    assert p[0].item() == 2.0 and p.requires_grad and p.grad is None
    assert len(_bytes_of(torch.zeros(0, dtype=dtype))) == 0
