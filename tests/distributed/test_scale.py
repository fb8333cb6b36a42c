"""Save coordination stays flat in the world size: counted at the Comm layer
(``shardpoint.runtime.PROCESS.seams.traffic``: bytes that arrive in this process through the
checkpoint group's collectives), with real gloo ranks.

A non-coordinator rank sends its description to rank 0 and receives only its own
assignment and the outcome, so what it receives does not grow with the world; a
second save of the same layout reuses the cached plan and receives a few hundred
bytes; the manifest describes each sharded tensor by its layout, not per rank.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests._dist import run_ranks

KEYS = 2000
ROWS = 3  # rows of each tensor per rank: tiny tensors, so the test measures coordination, not I/O


def _state(rank: int, world: int, fill: float, rows: int = ROWS) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (world,))
    out = {}
    for i in range(KEYS):
        local = torch.full((rows, 2), fill + i, dtype=torch.float32)
        out[f"layer{i}"] = DTensor.from_local(local, mesh, [Shard(0)], run_check=False,
                                                  shape=torch.Size((rows * world, 2)), stride=(2, 1))
    out["step"] = int(fill)
    return out


def _save_three_times(rank: int, world: int, root: str) -> dict:
    import shardpoint
    from shardpoint.runtime import PROCESS

    traffic = PROCESS.seams.traffic
    from shardpoint.runtime import PROCESS

    def plan_id() -> str:  # the id of the plan this rank's assignment came from
        (held,) = PROCESS.assignments.values()
        return held[1]

    path = Path(root) / f"w{world}"
    got = {}
    traffic.reset()
    shardpoint.save(_state(rank, world, 1.0), path)
    got["first"], got["plans"] = traffic.received, [plan_id()]
    traffic.reset()
    shardpoint.save(_state(rank, world, 2.0), path, overwrite=True)  # same layout, new values
    got["second"] = traffic.received
    got["plans"].append(plan_id())
    got["manifest"] = (path / "manifest.json").stat().st_size
    back = shardpoint.load_full(path, keys=["layer0", "layer1999", "step"])
    assert back["step"] == 2
    assert torch.equal(back["layer1999"], torch.full((ROWS * world, 2), 2.0 + 1999))
    # a changed layout (one more row per rank) is planned afresh, never served the cached plan
    traffic.reset()
    shardpoint.save(_state(rank, world, 3.0, rows=ROWS + 1), path, overwrite=True)
    got["changed"] = traffic.received
    got["plans"].append(plan_id())
    back = shardpoint.load_full(path, keys=["layer7"])
    assert torch.equal(back["layer7"], torch.full(((ROWS + 1) * world, 2), 3.0 + 7))
    return got


@pytest.mark.timeout(900)
def test_save_coordination_is_flat_from_2_to_8_ranks(tmp_path: Path) -> None:
    small = run_ranks(_save_three_times, 2, str(tmp_path), timeout=600)
    large = run_ranks(_save_three_times, 8, str(tmp_path), timeout=900)
    for w, res in ((2, small), (8, large)):
        for r, got in enumerate(res[1:], start=1):
            assert got["second"] <= 64 << 10, f"world {w}, rank {r}: a second save of the same layout received {got}"
        # the same layout reuses the plan; a changed one is planned afresh (the loads above show the bytes are right)
        for r, got in enumerate(res):
            first, second, changed = got["plans"]
            assert first == second and changed != second, f"world {w}, rank {r}: plan ids {got['plans']}"
    worst = lambda res: max(g["first"] for g in res[1:])  # noqa: E731 - non-coordinator ranks only
    assert worst(large) <= 1.5 * worst(small), (
        f"a non-coordinator rank received {worst(small)} bytes at 2 ranks but {worst(large)} at 8")
    assert large[0]["manifest"] <= 1.5 * small[0]["manifest"], (
        f"the manifest is {small[0]['manifest']} bytes at 2 ranks but {large[0]['manifest']} at 8")


def _load_once(rank: int, world: int, root: str) -> int:
    """Bytes this rank receives through the checkpoint group's collectives in one load
    (the key agreement and the outcome) of a checkpoint of 200 sharded tensors."""
    import shardpoint
    from shardpoint.runtime import PROCESS

    path = Path(root) / f"load{world}"
    keys = 200
    state = {k: v for k, v in _state(rank, world, 1.0).items() if k == "step" or int(k[5:]) < keys}
    shardpoint.save(state, path)
    target = {k: v for k, v in _state(rank, world, 0.0).items() if k == "step" or int(k[5:]) < keys}
    PROCESS.seams.traffic.reset()
    shardpoint.load(target, path)
    assert target["step"] == 1 and torch.equal(target["layer199"].to_local(), torch.full((ROWS, 2), 1.0 + 199))
    return PROCESS.seams.traffic.received


@pytest.mark.timeout(900)
def test_load_coordination_is_flat_from_2_to_8_ranks(tmp_path: Path) -> None:
    """A non-coordinator rank sends rank 0 its part of the key agreement and receives
    one merged answer, and then the outcome: the same bytes at 2, 4 and 8 ranks."""
    got = {w: run_ranks(_load_once, w, str(tmp_path), timeout=600) for w in (2, 4, 8)}
    others = {w: max(res[1:]) for w, res in got.items()}
    assert max(others.values()) <= 1.1 * min(others.values()), others
    assert got[8][0] > got[2][0], got  # the coordinator's share is what grows


def _memory_restore_once(rank: int, world: int, root: str) -> tuple[int | None, str, int]:
    """Bytes this rank receives through the checkpoint group's collectives in one restore
    from the memory tier, in a fresh manager (its hosts found, inventories, the plan, the load)."""
    import shardpoint
    from shardpoint.layout import FlatShard
    from shardpoint.runtime import PROCESS
    from shardpoint.tiers import MemoryTier

    n = 1000
    state = {"w": FlatShard(torch.arange(n, dtype=torch.float32) + rank * n, (n * world,), rank * n), "step": 1}
    tier = MemoryTier(every=1, durable_every=100, path=f"{root}/shm{world}")
    mgr = shardpoint.CheckpointManager(f"{root}/root{world}", memory=tier)
    mgr.save(state, 1)
    mgr.close()
    again = shardpoint.CheckpointManager(f"{root}/root{world}", memory=tier)
    PROCESS.seams.traffic.reset()
    report = again.restore(state)
    got = PROCESS.seams.traffic.received
    again.close()
    assert report is not None
    return report.step, getattr(report, "tier", ""), got


@pytest.mark.timeout(900)
def test_memory_restore_coordination_is_flat_from_2_to_8_ranks(tmp_path: Path) -> None:
    """A restore from the memory tier: each host's first rank reports its inventory to
    rank 0, which answers with the plan; the hosts' grouping travels as runs, not per
    rank. A non-coordinator rank receives the same bytes at 2, 4 and 8 ranks."""
    got = {w: run_ranks(_memory_restore_once, w, str(tmp_path), timeout=600) for w in (2, 4, 8)}
    assert all(step == 1 and tier == "memory" for res in got.values() for step, tier, _ in res), got
    others = {w: max(b for _, _, b in res[1:]) for w, res in got.items()}
    assert max(others.values()) <= 1.1 * min(others.values()), others
