"""Checkpoints on S3 (a real moto server on loopback) from real gloo ranks: save on
2 ranks, load resharded on 3, byte-exact; a save killed before its manifest leaves
no visible checkpoint; retention deletes on S3."""

from __future__ import annotations

import os
import signal
from typing import Any

import pytest
import torch

import shardpoint
from shardpoint.layout import FlatShard
from tests._dist import RankFailed, run_ranks
from tests.s3server import S3Server

pytestmark = [pytest.mark.distributed, pytest.mark.s3, pytest.mark.timeout(600)]
BLOCK = 5 << 20  # S3's smallest part: a rank's 6 MiB data file goes up as a 2-part multipart upload
ENV = {"SHARDPOINT_S3_BLOCK_SIZE": str(BLOCK)}
BIG = (3 * 2**20 // 16 + 5, 16)  # 12 MiB of float32, odd row count: uneven shards on 3 ranks
FLAT = (7, 9)


def _global(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g)


def _flat_range(numel: int, rank: int, world: int) -> tuple[int, int]:
    per = -(-numel // world)
    return min(rank * per, numel), min((rank + 1) * per, numel)


def _state(rank: int, world: int, seed: int, zeros: bool) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    make = (lambda shape, s: torch.zeros(shape)) if zeros else _global
    lo, hi = _flat_range(FLAT[0] * FLAT[1], rank, world)
    flat = make(FLAT, seed + 3).flatten()[lo:hi].clone()
    # the loader gets the other sharding of "cols" and "rows": Shard(0) <-> Shard(1)
    return {
        "rows": distribute_tensor(make(BIG, seed), mesh, [Shard(1) if zeros else Shard(0)]),
        "cols": distribute_tensor(make((5, 11), seed + 1), mesh, [Shard(0) if zeros else Shard(1)]),
        "rep": distribute_tensor(make((3, 4), seed + 2), mesh, [Replicate()]),
        "zero": FlatShard(flat, FLAT, lo),
        "step": -1 if zeros else seed,
    }


def _save_ranks(rank: int, world: int, url: str, options: dict[str, Any]) -> None:
    shardpoint.save(_state(rank, world, 100, zeros=False), url, storage_options=options)


def _load_ranks(rank: int, world: int, url: str, options: dict[str, Any]) -> dict[str, Any]:
    state = _state(rank, world, 100, zeros=True)
    flat = state["zero"].local
    report = shardpoint.load(state, url, storage_options=options)
    return {
        "full": {k: state[k].full_tensor() for k in ("rows", "cols", "rep")},
        "flat": flat.clone(),
        "flat_same_object": state["zero"].local is flat,
        "step": state["step"],
        "loaded": report.loaded,
    }


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def test_save_on_2_ranks_load_resharded_on_3(s3_endpoint: S3Server, s3_bucket: str) -> None:
    url = f"s3://{s3_bucket}/run/ckpt"
    opts = s3_endpoint.storage_options
    run_ranks(_save_ranks, 2, url, opts, env=ENV, timeout=240)

    keys = s3_endpoint.keys(s3_bucket)
    assert "run/ckpt/manifest.json" in keys and len(keys) == 5  # the manifest; a data file and its index per rank
    assert s3_endpoint.open_uploads(s3_bucket) == []
    etags = [
        s3_endpoint.client().head_object(Bucket=s3_bucket, Key=k)["ETag"]
        for k in keys
        if k.endswith(".safetensors")
    ]
    assert all(e.strip('"').endswith("-2") for e in etags), etags  # multipart, 2 parts each

    results = run_ranks(_load_ranks, 3, url, opts, env=ENV, timeout=240)

    want = {"rows": _global(BIG, 100), "cols": _global((5, 11), 101), "rep": _global((3, 4), 102)}
    flat = _global(FLAT, 103).flatten()
    for rank, got in enumerate(results):
        for k, t in want.items():
            assert _bytes(got["full"][k]) == _bytes(t), (rank, k)
        lo, hi = _flat_range(flat.numel(), rank, 3)
        assert _bytes(got["flat"]) == _bytes(flat[lo:hi]), rank
        assert got["flat_same_object"]
        assert got["step"] == 100
        assert got["loaded"] == ["cols", "rep", "rows", "step", "zero"]
    full = shardpoint.load_full(url, storage_options=opts)  # one process, no group
    assert _bytes(full["rows"]) == _bytes(want["rows"])
    assert _bytes(full["zero"]) == _bytes(flat.reshape(FLAT))


def _manager_ranks(
    rank: int, world: int, root: str, options: dict[str, Any], steps: list[int], kill_at: int | None
) -> None:
    from shardpoint.runtime import PROCESS

    mgr = shardpoint.CheckpointManager(root, keep_last=2, storage_options=options)
    for step in steps:
        if step == kill_at and rank == 0:
            # every rank's data is uploaded; rank 0 dies just before writing the manifest
            PROCESS.seams.phase = lambda phase: (
                os.kill(os.getpid(), signal.SIGKILL) if phase == "before_commit" else None
            )
        mgr.save(_state(rank, world, step, zeros=False), step)


def _dirs(keys: list[str]) -> list[str]:
    """The step folders under the root (its ``owners/`` records are not checkpoints)."""
    return sorted({k.split("/")[1] for k in keys if k.count("/") >= 2 and k.split("/")[1] != "owners"})


def test_killed_save_is_invisible_and_retention_deletes(s3_endpoint: S3Server, s3_bucket: str) -> None:
    root = f"s3://{s3_bucket}/run"
    opts = s3_endpoint.storage_options
    run_ranks(_manager_ranks, 2, root, opts, [1, 2], None, env=ENV, timeout=240)
    assert _dirs(s3_endpoint.keys(s3_bucket)) == ["step-00000001", "step-00000002"]

    with pytest.raises(RankFailed, match=r"ranks \[0\] died"):
        run_ranks(_manager_ranks, 2, root, opts, [3], 3, env=ENV, timeout=240)

    keys = s3_endpoint.keys(s3_bucket)
    step3 = [k for k in keys if k.startswith("run/step-00000003/")]
    assert step3 and all(k.endswith((".safetensors", ".index.json")) for k in step3)  # data went up, no manifest
    with pytest.raises(shardpoint.CheckpointNotFoundError):
        shardpoint.load_full(f"{root}/step-00000003", storage_options=opts)
    with pytest.raises(shardpoint.CheckpointNotFoundError):
        shardpoint.load({"step": 0}, f"{root}/step-00000003", storage_options=opts)
    mgr = shardpoint.CheckpointManager(root, storage_options=opts)
    assert [i.step for i in mgr.list()] == [1, 2]
    latest = mgr.latest()
    assert latest is not None and latest.step == 2
    assert shardpoint.load_full(latest.path, keys="step", storage_options=opts) == {"step": 2}

    run_ranks(_manager_ranks, 2, root, opts, [4], None, env=ENV, timeout=240)

    # keep_last=2 of the committed {1, 2, 4}: step 1 and the leftovers of step 3 are gone from S3
    keys = s3_endpoint.keys(s3_bucket)
    assert _dirs(keys) == ["step-00000002", "step-00000004"]
    assert "run/latest" in keys
    assert s3_endpoint.open_uploads(s3_bucket) == []
    latest = mgr.latest()
    assert latest is not None and latest.step == 4
    full = shardpoint.load_full(latest.path, storage_options=opts)
    assert _bytes(full["rows"]) == _bytes(_global(BIG, 4)) and full["step"] == 4
