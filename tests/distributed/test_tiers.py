"""The memory tier on real gloo ranks with FSDP2 + AdamW: snapshots taken on 2 ranks
restore from memory on 1, 2 and 3 ranks (resharded), byte for byte; the durable
steps drained by the helper process restore the same."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

import shardpoint
from shardpoint.tiers import MemoryTier
from tests._dist import run_ranks
from tests.distributed.test_train_state import build, snapshot, step

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]


def _tier(base: str) -> MemoryTier:
    return MemoryTier(every=1, durable_every=3, keep=2, path=base)


def _train(rank: int, world: int, root: str, base: str) -> dict[int, dict[str, torch.Tensor]]:
    m, opt, sched = build(0, world)
    mgr = shardpoint.CheckpointManager(root, keep_last=2, memory=_tier(base))
    saved = {}
    for i in range(1, 5):
        step(m, opt, sched, i, rank, world)
        mgr.save(shardpoint.TrainState(model=m, optimizer=opt, scheduler=sched, step=i), i)
        saved[i] = snapshot(m, opt)
    mgr.wait()
    return saved


def _restore(rank: int, world: int, root: str, base: str, durable_only: bool) -> dict[str, Any]:
    m, opt, sched = build(1, world)
    state = shardpoint.TrainState(model=m, optimizer=opt, scheduler=sched, step=0)
    if durable_only:
        report = shardpoint.CheckpointManager(root).restore(state)
        tier = "durable (no memory tier)"
    else:
        report = shardpoint.CheckpointManager(root, memory=_tier(base)).restore(state)
        tier = report.tier  # type: ignore[union-attr]
    assert report is not None
    return {"step": report.step, "tier": tier, "values": snapshot(m, opt)}


def test_memory_snapshot_restores_on_any_number_of_ranks(tmp_path: Path) -> None:
    base = f"/dev/shm/shardpoint-test-{tmp_path.name}-{os.urandom(4).hex()}"  # unique: a killed run may leave one
    root = str(tmp_path / "root")
    try:
        saved = run_ranks(_train, 2, root, base, timeout=240)[0]
        assert [i.step for i in shardpoint.CheckpointManager(root).list()] == [3]
        for world in (1, 3, 2):
            got = run_ranks(_restore, world, root, base, False, timeout=240)
            for r in got:
                assert (r["step"], r["tier"]) == (4, "memory")
                assert r["values"].keys() == saved[4].keys()
                for k, v in saved[4].items():
                    assert torch.equal(r["values"][k], v), (world, k)
        for r in run_ranks(_restore, 3, root, base, True, timeout=240):  # the drained step, resharded from disk
            assert r["step"] == 3
            for k, v in saved[3].items():
                assert torch.equal(r["values"][k], v), k
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _restore_with_a_failing_accept(rank: int, world: int, root: str, base: str) -> str:
    m, opt, sched = build(1, world)
    state = shardpoint.TrainState(model=m, optimizer=opt, scheduler=sched, step=0)
    mgr = shardpoint.CheckpointManager(root, memory=MemoryTier(every=1, durable_every=100, path=base))
    try:
        mgr.restore(state, accept=lambda info: info.metrics["loss"] < 10)  # no step recorded a loss: KeyError
    except KeyError as e:
        return f"KeyError {e}"
    except shardpoint.ShardpointError as e:
        assert rank != 0 or isinstance(e.__cause__, KeyError), repr(e.__cause__)
        return f"ShardpointError {e}"
    return "restored"


def test_an_accept_that_raises_on_rank_0_reaches_every_rank(tmp_path: Path) -> None:
    """Memory snapshots are judged by rank 0 alone (it holds every host's inventory):
    a caller's ``accept`` that raises there is that rank's error, and every other
    rank raises too, naming rank 0, at once rather than after the group's timeout."""
    base = f"/dev/shm/shardpoint-test-{tmp_path.name}-{os.urandom(4).hex()}"
    root = str(tmp_path / "root")
    try:
        run_ranks(_train_memory_only, 2, root, base, timeout=240)
        got = run_ranks(_restore_with_a_failing_accept, 2, root, base, timeout=120,
                        env={"SHARDPOINT_GROUP_TIMEOUT": "600"})
        assert got[0] == "ShardpointError rank 0 failed: KeyError: 'loss'", got  # the KeyError is its __cause__
        assert got[1].startswith("ShardpointError rank 0 failed, so this collective call failed on every rank") \
            and "KeyError: 'loss'" in got[1], got
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _train_memory_only(rank: int, world: int, root: str, base: str) -> None:
    m, opt, sched = build(0, world)
    mgr = shardpoint.CheckpointManager(root, memory=MemoryTier(every=1, durable_every=100, path=base))
    for i in range(1, 3):
        step(m, opt, sched, i, rank, world)
        mgr.save(shardpoint.TrainState(model=m, optimizer=opt, scheduler=sched, step=i), i)
    mgr.wait()
