"""Child side of the fencing tests: one *attempt* of a two-rank job (real gloo ranks)
that runs a plan of manager calls on one root, every tensor filled with
``step * 10 + attempt`` so that a checkpoint's values say which attempt saved which
step. The test freezes an attempt by PID (SIGSTOP) at a chosen point of a save, runs
a newer attempt to the end meanwhile, then thaws the old one (SIGCONT).

A *hold* makes the point deterministic: the save's phase hook writes
``<dir>/at-<attempt>-<rank>`` and waits for ``<dir>/go-<attempt>`` before going on;
the test stops the attempt's processes once a rank is there.

Ranks are forked from the test suite's fork server (tests/_dist.py), so an attempt
costs a gloo setup, not an interpreter."""

from __future__ import annotations

import os
import time
import traceback
from datetime import timedelta
from typing import Any

import torch

import shardpoint
from shardpoint import collective
from shardpoint.layout import FlatShard
from shardpoint.runtime import PROCESS

N = 64  # elements of w per rank


def make_state(rank: int, world: int) -> dict[str, Any]:
    return {"model": {"w": FlatShard(torch.zeros(N), (N * world,), rank * N), "b": torch.zeros(16)}, "step": 0,
            "rng": shardpoint.PerRank(torch.zeros(4))}


def fill(state: dict[str, Any], value: float) -> None:
    state["model"]["w"].local.fill_(value)
    state["model"]["b"].fill_(value)
    state["step"] = int(value)
    state["rng"].value.fill_(value)


def values(state: Any) -> set[float]:
    """Every value a loaded (full) state holds."""
    w = state["model"]["w"]
    w = w.local if isinstance(w, FlatShard) else w
    out = {float(v) for t in (w, state["model"]["b"]) for v in torch.unique(t).tolist()}
    rng = state["rng"]
    rng = rng.value if isinstance(rng, shardpoint.PerRank) else rng
    for t in (rng.values() if isinstance(rng, dict) else [rng]):
        out |= {float(v) for v in torch.unique(t).tolist()}
    return out


def main(rank: int, world: int, port: int, root: Any, attempt: int, plan: list[list[Any]], hold: dict[str, Any] | None,
         folder: str, q: Any) -> None:
    """Run ``plan`` (``["restore"]``, ``["save", step, blocking]``, ``["wait"]``,
    ``["sleep", seconds]``) and put ``(rank, outcomes)`` on ``q``: per call ``"ok"``,
    ``"restored N"`` or ``"<ErrorType>: <message>"``. ``hold``: ``{"phase": name,
    "save": n}``, the n-th save (from 1) waits at that phase boundary."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    import torch.distributed as dist

    torch.set_num_threads(1)
    collective.GROUP_TIMEOUT = timedelta(seconds=120)
    with open(os.path.join(folder, f"pid-{attempt}-{rank}"), "w") as f:
        f.write(str(os.getpid()))
    outcomes: list[str] = []
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=120))
        if isinstance(root, dict):  # an S3 location: {"url", "storage_options"}
            mgr = shardpoint.CheckpointManager(root["url"], keep_last=2, timeout=60,
                                               storage_options=root["storage_options"])
        else:
            mgr = shardpoint.CheckpointManager(root, keep_last=2, timeout=60)
        state = make_state(rank, world)
        saves = 0
        if hold is not None:
            def hook(phase: str) -> None:
                if phase == hold["phase"] and saves == hold["save"]:
                    with open(os.path.join(folder, f"at-{attempt}-{rank}"), "w"):
                        pass
                    while not os.path.exists(os.path.join(folder, f"go-{attempt}")):
                        time.sleep(0.02)

            PROCESS.seams.phase = hook
        for call in plan:
            try:
                if call[0] == "restore":
                    report = mgr.restore(state)
                    outcomes.append(f"restored {report.step if report else None}")
                elif call[0] == "save":
                    saves += 1
                    fill(state, call[1] * 10 + attempt)
                    mgr.save(state, call[1], blocking=call[2])
                    outcomes.append("ok")
                elif call[0] == "wait":
                    mgr.wait()
                    outcomes.append("ok")
                elif call[0] == "sleep":
                    time.sleep(call[1])
                    outcomes.append("ok")
            except shardpoint.ShardpointError as e:
                outcomes.append(f"{type(e).__name__}: {e}")
        dist.barrier()
        q.put((rank, outcomes))
    except BaseException:  # noqa: BLE001 - reported to the test
        q.put((rank, outcomes + ["CRASH " + traceback.format_exc()]))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
