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
