"""Child side of the SIGKILL tests: a two-rank "training job" that resumes from
its CheckpointManager and then saves step after step, every tensor filled with
the step number, until it is killed; and the fresh-process check that runs after.

Children are forked from a forkserver that has torch and shardpoint imported
(see ``test_sigkill.py``), so a trial costs a gloo setup, not an interpreter.
"""

from __future__ import annotations

import os
import signal
import threading
from datetime import timedelta
from typing import Any

import torch

import shardpoint
from shardpoint import collective
from shardpoint.layout import FlatShard
from shardpoint.runtime import PROCESS
from shardpoint.storage import LocalStorage, Storage
from shardpoint.verify import verify
from tests.failure._storage import KillMidWrite

N = 64  # elements of w per rank
#: Incremental trials: a frozen tensor that never changes (so later saves refer to the first one's data).
FROZEN = 1 << 18


def frozen() -> torch.Tensor:
    return torch.arange(FROZEN, dtype=torch.float32)


def make_state(rank: int, world: int, incremental: bool = False) -> dict[str, Any]:
    state = {
        "model": {"w": FlatShard(torch.zeros(N), (N * world,), rank * N), "b": torch.zeros(16)},
        "step": 0,
        "rng": shardpoint.PerRank(torch.zeros(4, dtype=torch.int64)),
    }
    if incremental:
        state["frozen"] = frozen()
    return state


def fill(state: dict[str, Any], step: int) -> None:
    state["model"]["w"].local.fill_(step)
    state["model"]["b"].fill_(step)
    state["step"] = step
    state["rng"].value.fill_(step)


def uniform_step(state: dict[str, Any]) -> int | None:
    """The step all values of a loaded state agree on, or None."""
    values = {int(state["step"])}
    for t in (state["model"]["w"].local, state["model"]["b"], state["rng"].value):
        values |= {int(v) for v in torch.unique(t).tolist()}
    return values.pop() if len(values) == 1 else None


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _report(q: Any, msg: tuple[int, str]) -> None:
    q.put(msg)
    q.close()
    q.join_thread()  # flushed before the process ends, even by os._exit


def train(rank: int, world: int, port: int, root: str, kill: dict[str, Any], q: Any, log: str) -> None:
    """Resume, then save steps until killed (or ``max_steps`` saves). ``kill``:
    ``{"rank": r, "after": seconds}`` (a timer), ``{"rank": r, "phase": name, "save": n}``
    (the n-th save's phase boundary) or ``{"rank": r, "phase": "mid-write", "save": n}``."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)  # the survivors' gloo/TCPStore complaints go to the trial's log
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    import torch.distributed as dist

    torch.set_num_threads(1)
    collective.GROUP_TIMEOUT = timedelta(seconds=30)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=30))
    mine = kill.get("rank") == rank
    storage: Storage = LocalStorage(root)
    if mine and kill.get("phase") == "mid-write":
        storage = KillMidWrite(storage, nth=kill["save"])
    inc = bool(kill.get("incremental"))
    mgr = shardpoint.CheckpointManager(storage, keep_last=2, timeout=20, incremental=inc)
    state = make_state(rank, world, inc)
    report = mgr.restore(state)
    start = 0 if report is None else report.step
    if report is not None and uniform_step(state) != start:
        _report(q, (rank, f"bad: restored step {start} but the state holds {state}"))
        os._exit(1)
    saves = 0
    if mine and "after" in kill:
        t = threading.Timer(kill["after"], _die)
        t.daemon = True
        t.start()
    if mine and kill.get("phase") not in (None, "mid-write"):
        def hook(phase: str) -> None:
            if phase == kill["phase"] and saves == kill["save"]:
                _die()

        PROCESS.seams.phase = hook
    try:
        for step in range(start + 1, start + 1 + kill.get("max_steps", 40)):
            saves += 1
            fill(state, step)
            mgr.save(state, step)
    except Exception as e:  # noqa: BLE001 - a survivor of the kill fails here, as it should
        kind = "ShardpointError" if isinstance(e, shardpoint.ShardpointError) else "other"
        _report(q, (rank, f"error ({kind}): {type(e).__name__}: {str(e)[:200]}"))
        os._exit(1)
    _report(q, (rank, "done"))
    dist.destroy_process_group()


def check(root: str, q: Any, incremental: bool = False) -> None:
    """In a fresh process: every committed checkpoint verifies and holds one step's
    values (and, incremental, the unchanged frozen tensor); latest() names one; a
    restore of it gives that step throughout."""
    out: dict[str, Any] = {"bad": []}
    try:
        mgr = shardpoint.CheckpointManager(root)
        info = mgr.latest()
        out["latest"] = None if info is None else info.step
        out["committed"] = [i.step for i in mgr.list()]
        for i in mgr.list():
            res = verify(i.path)
            if not res.ok:
                out["bad"].append(f"step {i.step}: verify: {res.summary()}")
            full = shardpoint.load_full(i.path)
            vals = {int(full["step"])}
            for t in (full["model"]["w"], full["model"]["b"], *full["rng"].values()):
                vals |= {int(v) for v in torch.unique(t).tolist()}
            if vals != {i.step}:
                out["bad"].append(f"step {i.step}: holds values {sorted(vals)}")
            if incremental and not torch.equal(full.get("frozen", torch.empty(0)), frozen()):
                out["bad"].append(f"step {i.step}: the frozen tensor differs")
        if info is not None:
            state = make_state(0, 1, incremental)
            state["model"]["w"] = FlatShard(torch.zeros(2 * N), (2 * N,), 0)
            report = mgr.restore(state)
            if report is None or report.step != info.step or uniform_step(state) != info.step:
                out["bad"].append(f"restore of latest ({info.step}) gave step {report and report.step}, state {state}")
    except Exception as e:  # noqa: BLE001 - reported to the test
        out["bad"].append(f"{type(e).__name__}: {e}")
    q.put(out)
