"""Process crash, host alive: SIGKILL every rank of a 2-rank FSDP2 + AdamW job (a
snapshot every step, durable every 5; the drain in a helper process) at a random
moment, over several trials on one root and one shared-memory folder. Each restart
restores the newest complete snapshot, never a torn one (its values equal the ones
recorded for that step), never goes back, and every committed durable checkpoint
still verifies. ``SHARDPOINT_TIERS_SOAK`` trials (default 3)."""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import random
import shutil
import time
from pathlib import Path
from typing import Any

import pytest

from shardpoint import CheckpointManager
from shardpoint.verify import verify
from tests._dist import free_port

pytestmark = pytest.mark.distributed

WORLD = 2
SOAK = int(os.environ.get("SHARDPOINT_TIERS_SOAK", 3))
SEED = int(os.environ.get("SHARDPOINT_SOAK_SEED", random.randrange(1 << 30)))


def trial(ctx: Any, root: Path, base: str, records: Path, kill_after: float | None, limit: float = 90.0) -> list[tuple]:
    """Start the job; ``kill_after`` seconds after it restored, SIGKILL every rank
    (None: let it finish). Returns the ranks' messages."""
    from tests.failure._tiers_crash import job

    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=job, args=(r, WORLD, port, str(root), base, str(records), q, 10_000 if kill_after else 12),
                         daemon=True) for r in range(WORLD)]
    for p in procs:
        p.start()
    msgs: list[tuple] = []
    deadline = time.monotonic() + limit
    killed_at = None
    try:
        while any(p.is_alive() for p in procs):
            assert time.monotonic() < deadline, f"trial did not end within {limit}s: {msgs}"
            try:
                msgs.append(q.get(timeout=0.05))
            except queue.Empty:
                pass
            if kill_after is not None and killed_at is None and any(m[1] == "restored" for m in msgs):
                killed_at = time.monotonic() + kill_after
            if killed_at is not None and time.monotonic() >= killed_at:
                for p in procs:
                    p.kill()
            dead = [p.exitcode for p in procs if p.exitcode not in (None, 0, -9)]
            assert not dead, f"a rank failed: {dead} {msgs}"
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(10)
    while True:
        try:
            msgs.append(q.get_nowait())
        except queue.Empty:
            break
    return msgs


@pytest.mark.timeout(max(240, SOAK * 20))
def test_sigkill_every_rank_restores_the_newest_complete_snapshot(tmp_path: Path) -> None:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "shardpoint", "tests.failure._tiers_crash"])
    root, records = tmp_path / "root", tmp_path / "records"
    records.mkdir()
    base = f"/dev/shm/shardpoint-test-{tmp_path.name}-{os.urandom(4).hex()}"  # unique: a killed run may leave one
    rng = random.Random(SEED)
    last: int | None = None
    tiers: list[str] = []
    try:
        for n in range(SOAK + 1):
            kill = rng.uniform(0.2, 3.0) if n < SOAK else None  # the last trial runs to its end
            msgs = trial(ctx, root, base, records, kill)
            restored = [m for m in msgs if m[1] == "restored"]
            assert restored, f"trial {n} (seed {SEED}) never restored: {msgs}"
            _, _, step, tier, equal = restored[0]
            assert equal, f"trial {n} (seed {SEED}): step {step} from {tier} differs from what was saved at that step"
            if last is not None:
                assert step is not None and step >= last, f"trial {n} (seed {SEED}): went back from {last} to {step}"
                tiers.append(tier)
            last = step
            for info in CheckpointManager(root).list():
                assert info.damaged is None and verify(info.path).ok, f"trial {n} (seed {SEED}): {info}"
        assert any(m[1] == "done" for m in msgs)
        assert CheckpointManager(root).latest() is not None
        assert "memory" in tiers, tiers
        if os.environ.get("SHARDPOINT_SOAK_LOG"):
            print(f"seed {SEED}: restored from {tiers}, last step {last}")
    finally:
        shutil.rmtree(base, ignore_errors=True)
