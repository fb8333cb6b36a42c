"""The checkpoint channel on real gloo ranks: asynchronous saves beside the per-step
preemption check never cross (the README's loop runs to the end), the check does
not wait for the save in flight, a load and a restore wait for it, exits after
asynchronous saves are clean, and an arrival costs each rank a constant number of
store operations and leaves nothing in the store."""

from __future__ import annotations

import os
import signal
import subprocess
import textwrap
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

import shardpoint
from shardpoint.runtime import PROCESS
from tests._dist import run_ranks, torchrun

pytestmark = pytest.mark.distributed
STEPS = 100


def _weights(step: int) -> torch.Tensor:
    return torch.arange(64 * 16, dtype=torch.float32).reshape(64, 16) + step


def loop_case(rank: int, world: int, root: str, steps: int, preempt_at: int) -> dict:
    """The README's loop: an asynchronous save and the preemption check every step,
    beside the training group's own all-reduce. Rank 1 is told to stop at
    ``preempt_at``; every rank must save that step and stop there."""
    import torch.distributed as dist

    mgr = shardpoint.CheckpointManager(root, keep_last=2)
    mgr.handle_signals()
    w = torch.zeros(64, 16)
    stopped = None
    for step in range(steps):
        t = torch.ones(4)
        dist.all_reduce(t)  # training traffic on the default group
        assert float(t[0]) == world
        w.copy_(_weights(step))
        state = shardpoint.TrainState(rng=False, w=w, r=shardpoint.PerRank(torch.full((2,), float(rank))))
        mgr.save(state, step, blocking=False)
        if rank == 1 and step == preempt_at:
            os.kill(os.getpid(), signal.SIGUSR1)  # what SLURM sends before the end of an allocation
        if mgr.save_if_preempted(state, step):
            stopped = step
            break
    mgr.wait()
    return {"stopped": stopped, "latest": mgr.latest().step, "steps": [i.step for i in mgr.list()]}


def _check_loop(root: Path, results: list[dict], preempt_at: int) -> None:
    for r, res in enumerate(results):
        assert res["stopped"] == preempt_at, f"rank {r}: {res}"
        assert res["latest"] == preempt_at and res["steps"] == [preempt_at - 1, preempt_at], f"rank {r}: {res}"
    full = shardpoint.load_full(root / f"step-{preempt_at:08d}")
    assert torch.equal(full["extra"]["w"], _weights(preempt_at))
    assert sorted(full["extra"]["r"]) == list(range(len(results)))


@pytest.mark.parametrize("world", [2, 4])
def test_async_saves_and_the_preemption_check_every_step(tmp_path: Path, world: int) -> None:
    results = run_ranks(loop_case, world, str(tmp_path), STEPS, STEPS - 3, timeout=600)
    _check_loop(tmp_path, results, STEPS - 3)


def check_does_not_wait_case(rank: int, world: int, root: str) -> dict:
    """The save in flight is held at its "written" phase until the main thread
    releases it after two preemption checks; if a check waited for the save, the
    hold would run out instead."""
    released = threading.Event()

    def hold(phase: str) -> None:
        if phase == "written" and not released.wait(60):
            raise AssertionError("the preemption check waited for the save in flight")

    PROCESS.seams.phase = hold
    mgr = shardpoint.CheckpointManager(root)
    state = shardpoint.TrainState(rng=False, w=_weights(rank * 0))
    t0 = time.monotonic()
    mgr.save(state, 1, blocking=False)
    checks = [mgr.save_if_preempted(state, 1), mgr.save_if_preempted(state, 2)]
    took = time.monotonic() - t0
    in_flight = not mgr._pending.done()
    released.set()
    mgr.wait()
    PROCESS.seams.phase = None
    return {"checks": checks, "in_flight": in_flight, "took": took, "latest": mgr.latest().step}


def test_the_preemption_check_does_not_wait_for_the_save_in_flight(tmp_path: Path) -> None:
    results = run_ranks(check_does_not_wait_case, 2, str(tmp_path), timeout=300)
    for res in results:
        assert res["checks"] == [False, False] and res["in_flight"] and res["latest"] == 1, res
        assert res["took"] < 60


def load_during_save_case(rank: int, world: int, root: str) -> dict:
    """A load of the path being saved, and a restore, issued while the save is in
    flight (held for a moment after its data is written), see the new checkpoint."""
    def slow(phase: str) -> None:
        if phase == "written":
            time.sleep(1.0)

    PROCESS.seams.phase = slow
    path = f"{root}/plain"
    h = shardpoint.save({"w": _weights(7)}, path, blocking=False)
    target = {"w": torch.zeros(64, 16)}
    was_in_flight = not h.done()
    shardpoint.load(target, path)
    loaded = torch.equal(target["w"], _weights(7))
    h.wait()

    mgr = shardpoint.CheckpointManager(f"{root}/mgr")
    mgr.save(shardpoint.TrainState(rng=False, w=_weights(3)), 3)
    mgr.save(shardpoint.TrainState(rng=False, w=_weights(5)), 5, blocking=False)
    restored_in_flight = not mgr._pending.done()
    w = torch.zeros(64, 16)
    report = mgr.restore(shardpoint.TrainState(rng=False, w=w))
    PROCESS.seams.phase = None
    mgr.wait()
    return {"was_in_flight": was_in_flight, "loaded": loaded, "restored_in_flight": restored_in_flight,
            "step": report.step, "restored": torch.equal(w, _weights(5))}


def test_load_and_restore_wait_for_the_save_in_flight(tmp_path: Path) -> None:
    results = run_ranks(load_during_save_case, 2, str(tmp_path), timeout=300)
    for res in results:
        assert res["was_in_flight"] and res["restored_in_flight"], res  # the tests did race a save
        assert res["loaded"] and res["step"] == 5 and res["restored"], res


# -- exits ---------------------------------------------------------------------------
_EXIT_SCRIPT = textwrap.dedent("""
    import sys, torch, torch.distributed as dist, shardpoint
    from datetime import timedelta
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank = dist.get_rank()
    root, steps, how = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    mgr = shardpoint.CheckpointManager(root, keep_last=2)
    w = torch.zeros(256, 64)
    for step in range(steps):
        w.fill_(step)
        state = shardpoint.TrainState(rng=False, w=w)
        mgr.save(state, step, blocking=False)
        if mgr.save_if_preempted(state, step):
            break
    if how != "no-wait":
        mgr.wait()
    if how == "destroy":
        dist.destroy_process_group()
    print("finished", rank, flush=True)
""")


def _torchrun(script: Path, nproc: int, *args: str, limit: float = 240) -> subprocess.CompletedProcess:
    return torchrun(nproc, script, *args, timeout=limit)


@pytest.mark.parametrize("how", ["wait", "destroy", "no-wait"])
def test_exit_after_async_saves_is_clean(tmp_path: Path, how: str) -> None:
    """Every rank exits 0 (torchrun reports any rank's SIGABRT as a failure), and
    the last save committed, also when nobody waited for it (the exit gives it
    time to commit)."""
    script = tmp_path / "train.py"
    script.write_text(_EXIT_SCRIPT)
    runs = int(os.environ.get("SHARDPOINT_EXIT_RUNS", "1"))  # CI time; SHARDPOINT_EXIT_RUNS=20 for a soak
    for i in range(runs):
        root = tmp_path / f"run{i}"
        proc = _torchrun(script, 2, str(root), "12", how)
        assert proc.returncode == 0, f"run {i} ({how}) exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr[-4000:]}"
        assert proc.stdout.count("finished") == 2 and "WARNING" not in proc.stderr, proc.stderr[-4000:]
        mgr = shardpoint.CheckpointManager(root)
        assert mgr.latest().step == 11
        assert torch.all(shardpoint.load_full(root / "step-00000011")["extra"]["w"] == 11)


# -- store operations ----------------------------------------------------------------
class CountingStore:
    """The real store, with each call counted by method name (not a mock: every
    call goes through)."""

    def __init__(self, store: Any) -> None:
        self._store = store
        self.calls: Counter[str] = Counter()

    def __getattr__(self, name: str) -> Any:
        inner = getattr(self._store, name)

        def call(*args: Any, **kwargs: Any) -> Any:
            self.calls[name] += 1
            return inner(*args, **kwargs)

        return call


def store_ops_case(rank: int, world: int, calls: int) -> dict:
    import torch.distributed as dist

    from shardpoint.collective import Comm

    Comm().arrive("load", "/warm-up")  # makes the channel's lanes (torch's own store traffic)
    dist.barrier()
    base = dist.distributed_c10d._get_default_store()
    before = base.num_keys()
    dist.barrier()
    counts = []
    for i in range(calls):
        comm = Comm()
        counting = CountingStore(comm.store)
        comm.store = counting  # type: ignore[assignment]
        comm.arrive("save", f"/ckpt/{i}")
        counts.append(dict(counting.calls))
    dist.barrier()
    after = base.num_keys()
    dist.barrier()
    return {"counts": counts, "before": before, "after": after}


def test_arrival_costs_a_constant_number_of_store_operations_per_rank() -> None:
    world, calls = 16, 3
    results = run_ranks(store_ops_case, world, calls, timeout=600)
    for i in range(calls):
        per_rank = [sum(res["counts"][i].values()) for res in results]
        # six each, plus the last arrival's read and release, plus the last leaver's six deletions
        assert max(per_rank) <= 14, per_rank
        assert sum(per_rank) <= 6 * world + 8, per_rank
        assert all(set(res["counts"][i]) <= {"compare_set", "add", "append", "wait", "get", "set", "delete_key"}
                   for res in results), [res["counts"][i] for res in results]
    # nothing is left behind: the store holds as many keys after the calls as before
    assert results[0]["after"] == results[0]["before"], results[0]


def test_a_group_of_one_rank_arrives_without_the_store_and_still_waits_for_its_save(tmp_path: Path) -> None:
    """One rank has no other call to meet: its arrival makes no store operation, and a
    load still waits for the asynchronous save in flight (and reads what it wrote)."""
    world = run_ranks(one_rank_case, 1, str(tmp_path), timeout=120)[0]
    assert world["ops"] == {}, world["ops"]
    assert world["loaded"] == 7.0 and world["save_done_before_load"], world


def one_rank_case(rank: int, world: int, tmp: str) -> dict:
    import shardpoint
    from shardpoint.collective import Comm
    from shardpoint.runtime import PROCESS

    comm = Comm()
    counting = CountingStore(comm.store)
    comm.store = counting  # type: ignore[assignment]
    comm.arrive("save", "/ckpt/0")
    comm.arrive("load", "/ckpt/0")
    done = []
    PROCESS.seams.phase = lambda phase: (time.sleep(1.0), done.append(phase)) if phase == "written" else None
    mgr = shardpoint.CheckpointManager(f"{tmp}/root")
    mgr.save({"w": torch.full((4,), 7.0)}, 1, blocking=False)
    target = {"w": torch.zeros(4)}
    saved_before = bool(done)  # the save is still in flight here
    mgr.restore(target)
    PROCESS.seams.phase = None
    mgr.close()
    return {"ops": dict(counting.calls), "loaded": float(target["w"][0]),
            "save_done_before_load": bool(done) and not saved_before}


_STUCK_SCRIPT = textwrap.dedent("""
    import os, sys, time, torch, torch.distributed as dist, shardpoint
    from datetime import timedelta
    from shardpoint.runtime import PROCESS
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank = dist.get_rank()
    if rank == 0:  # holds the save between writing and the exchange of write statuses
        PROCESS.seams.phase = lambda phase: time.sleep(10) if phase == "written" else None
    mgr = shardpoint.CheckpointManager(sys.argv[1])
    mgr.save(shardpoint.TrainState(rng=False, w=torch.ones(1000)), 3, blocking=False)
    if rank == 0:
        time.sleep(13)  # rank 1 has exited by now; the save fails here and is reported at exit
    print("leaving", rank, flush=True)
""")


def test_exit_while_a_peer_holds_the_save_ends_cleanly(tmp_path: Path) -> None:
    """Rank 1 exits while its save's collective waits for rank 0: after the exit
    grace its thread leaves gloo, the process warns and exits 0 (no SIGABRT from
    a thread killed inside torch), and nothing is committed."""
    script = tmp_path / "stuck.py"
    script.write_text(_STUCK_SCRIPT)
    os.environ["SHARDPOINT_EXIT_GRACE"] = "1"
    try:
        proc = _torchrun(script, 2, str(tmp_path / "ckpt"))
    finally:
        del os.environ["SHARDPOINT_EXIT_GRACE"]
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr[-4000:]}"
    assert proc.stdout.count("leaving") == 2
    assert proc.stderr.count("step 3") >= 2 and "NOT committed" in proc.stderr, proc.stderr[-4000:]
    assert shardpoint.CheckpointManager(tmp_path / "ckpt").latest() is None


_FORK_SCRIPT = textwrap.dedent("""
    import sys
    import torch, torch.distributed as dist, shardpoint
    from torch.utils.data import DataLoader
    dist.init_process_group("gloo")
    root = sys.argv[1]
    shardpoint.save({"w": torch.ones(4)}, root)  # makes the channel's gloo groups
    shardpoint.save({"w": torch.ones(4)}, root + "-async", blocking=False).wait()
    seen = []
    for _ in range(2):  # each epoch forks workers, which exit through threading's exit hooks
        for batch in DataLoader(list(range(32)), batch_size=4, num_workers=2):
            seen += batch.tolist()
    assert sorted(seen) == sorted(list(range(32)) * 2), seen
    print("finished", dist.get_rank(), flush=True)
    dist.destroy_process_group()
""")


def test_forked_dataloader_workers_survive_the_channels(tmp_path: Path) -> None:
    """A DataLoader worker forked after a save inherits the channels' gloo groups;
    its exit must not touch them (destroying them there killed every worker with
    SIGSEGV, so the first training step after a checkpoint failed)."""
    script = tmp_path / "fork.py"
    script.write_text(_FORK_SCRIPT)
    proc = _torchrun(script, 2, str(tmp_path / "ckpt"))
    assert proc.returncode == 0 and proc.stdout.count("finished") == 2, proc.stderr[-4000:]
