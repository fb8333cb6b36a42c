"""What an operator sees (issue 33, item 1): one INFO line per save and restore on the
``shardpoint`` logger with the step, the bytes and the time; the same figures as typed
records on the handle, the load report and the manager's ``on_event`` hook; on two
real gloo ranks, each rank its own figures and rank 0 the whole checkpoint's bytes."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch

import shardpoint
from shardpoint.layout import FlatShard
from shardpoint.report import LoadStats, SaveStats
from tests._dist import run_ranks

pytestmark = pytest.mark.distributed


def _ranks(rank: int, world: int, root: str) -> dict[str, Any]:
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    logger = logging.getLogger("shardpoint")
    logger.setLevel(logging.DEBUG)
    logger.addHandler(Keep())
    events: list[Any] = []
    mgr = shardpoint.CheckpointManager(root, on_event=events.append)
    n = 50_000
    state = {"w": FlatShard(torch.arange(n, dtype=torch.float32) + rank * n, (n * world,), rank * n), "step": 3}
    mgr.save(state, 3)
    handle = mgr.save(state, 4, blocking=False)
    assert handle is not None
    mgr.wait()
    report = mgr.restore(state)
    assert report is not None
    meta = shardpoint.metadata(f"{root}/step-00000004")
    return {"events": [type(e).__name__ + repr(e) for e in events], "saves": [e for e in events if isinstance(e, SaveStats)],
            "loads": [e for e in events if isinstance(e, LoadStats)], "handle": handle.stats, "report": report.stats,
            "info": [r.getMessage() for r in records if r.levelno == logging.INFO],
            "debug": [r.getMessage() for r in records if r.levelno == logging.DEBUG], "nbytes": meta.nbytes}


def test_saves_and_restores_are_logged_and_counted(tmp_path: Path) -> None:
    res = run_ranks(_ranks, 2, str(tmp_path / "root"), timeout=240)
    for rank, r in enumerate(res):
        saves, loads = r["saves"], r["loads"]
        assert [s.step for s in saves] == [3, 4] and [s.rank for s in saves] == [rank, rank], r["events"]
        for s in saves:
            assert s.bytes_written >= 200_000 and s.bytes_referenced == 0 and s.world_size == 2
            assert 0 < s.stall_s <= s.wall_s and set(s.phases) == {"describe", "coordinate", "stage", "write", "commit"}
            assert s.path.endswith(f"step-0000000{s.step}")
            assert (s.checkpoint_bytes == r["nbytes"]) if rank == 0 else s.checkpoint_bytes is None
        assert r["handle"] == saves[1]  # the handle of the save with blocking=False carries the same record
        assert len(loads) == 1 and loads[0] == r["report"]
        load = loads[0]
        assert load.step == 4 and load.tier == "durable" and load.bytes_read >= 200_000 and load.wall_s > 0
        assert set(load.phases) == {"locate", "read", "finish"}
        # rank 0 writes one INFO line per save and per restore; every rank DEBUG lines
        info = r["info"]
        if rank == 0:
            assert any("the save of step 3 committed" in m and "from 2 rank(s)" in m and "KB" in m for m in info), info
            assert any("the save of step 4 committed" in m and "the caller waited" in m for m in info), info
            assert any(m.startswith("restored step 4 from") and "(durable)" in m for m in info), info
        else:
            assert not any("committed" in m or m.startswith("restored") for m in info), info
        assert any(f"rank {rank}:" in m and "written" in m for m in r["debug"]), r["debug"]
