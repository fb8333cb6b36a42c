"""One rank of the memory tier's two-host tests (tests/distributed/test_tiers_hosts.py),
started by torchrun inside a network namespace whose host name is its own.

    python -m tests.distributed._tiers_hosts_worker train OUT BASE ROOT_R1 ROOT_R0 ROOT_DIRECT
    python -m tests.distributed._tiers_hosts_worker resume OUT BASE ROOT_R1 ROOT_R0 NAME
    python -m tests.distributed._tiers_hosts_worker crash OUT BASE ROOT STEPS

``train`` (2 hosts x 2 ranks): FSDP2 + AdamW, one model saved to two managers each
step (a snapshot every step, durable every 5; one with ``replicas=1`` under ROOT_R1,
one with ``replicas=0`` under ROOT_R0), and step 5 also saved directly (no memory
tier) under ROOT_DIRECT; after step 7 it waits for replication and
drains, records the state of steps 5 and 7, trains on to step 10 without saving
(the uninterrupted run's losses), writes ``ready-<rank>`` and sleeps until killed.

``resume`` (any hosts and ranks): each manager restores into a fresh model; writes
(``NAME-<rank>.json``) the step, tier and pieces of each, whether the state is
byte-equal to the recorded one, and the losses of the steps after it up to 10 (the
global batch of 8 kept).

``crash``: restores (when there is something), checks what it restored against the
records, then trains and snapshots (``replicas=1``) up to STEPS (``+N``: N steps
past the restored one), recording each step.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import sys
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

import shardpoint
from shardpoint.tiers import MemoryTier
from tests.distributed.test_train_state import build, snapshot

BATCH = 8
LAST = 10


def tier(base: str, replicas: int, keep: int = 2) -> MemoryTier:
    return MemoryTier(every=1, durable_every=5, keep=keep, replicas=replicas, path=os.path.join(base, socket.gethostname()))


def train_step(m: Any, opt: Any, sched: Any, i: int, rank: int, world: int, batch: int = BATCH) -> float:
    """One step on this rank's share of a global batch of ``batch``; returns the global loss."""
    g = torch.Generator().manual_seed(1000 + i)
    x, y = torch.randn(batch, 6, generator=g), torch.randn(batch, 2, generator=g)
    n = batch // world
    loss = torch.nn.functional.mse_loss(m(x[rank * n: (rank + 1) * n]), y[rank * n: (rank + 1) * n])
    loss.backward()
    opt.step()
    opt.zero_grad()
    sched.step()
    total = loss.detach().clone()
    dist.all_reduce(total)
    return float(total) / world


def as_bytes(values: dict[str, torch.Tensor]) -> dict[str, str]:
    return {k: hashlib.sha256(v.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
            for k, v in values.items()}


def train(out: str, base: str, root1: str, root0: str, direct: str) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    m, opt, sched = build(0, world)
    mgrs = [shardpoint.CheckpointManager(root, keep_last=2, memory=tier(base, r), timeout=120)
            for root, r in ((root1, 1), (root0, 0))]
    losses, states = {}, {}
    for i in range(1, LAST + 1):
        losses[i] = train_step(m, opt, sched, i, rank, world)
        if i <= 7:
            for mgr in mgrs:
                mgr.save(shardpoint.TrainState(model=m, optimizer=opt, scheduler=sched, step=i), i)
        if i == 5:  # the durable checkpoint drained over two hosts against a direct save
            shardpoint.CheckpointManager(direct, timeout=120).save(
                shardpoint.TrainState(model=m, optimizer=opt, scheduler=sched, step=i), i)
        if i in (5, 7):
            states[i] = as_bytes(snapshot(m, opt))
        if i == 7:
            for mgr in mgrs:
                mgr.wait()  # replication and drains done: the state host B's loss is tested against
    if rank == 0:
        with open(os.path.join(out, "train.json"), "w") as f:
            json.dump({"losses": losses, "states": states}, f)
    with open(os.path.join(out, f"ready-{rank}"), "w") as f:
        f.write(socket.gethostname())
    while True:  # until killed: host B's loss, then the job's restart
        time.sleep(1)


def resume(out: str, base: str, root1: str, root0: str, name: str) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    with open(os.path.join(out, "train.json")) as f:
        ref = json.load(f)
    result: dict[str, Any] = {"rank": rank, "host": socket.gethostname()}
    for which, root, r in (("r1", root1, 1), ("r0", root0, 0)):
        m, opt, sched = build(1, world)
        state = shardpoint.TrainState(model=m, optimizer=opt, scheduler=sched, step=0)
        report = shardpoint.CheckpointManager(root, keep_last=2, memory=tier(base, r), timeout=120).restore(state)
        assert report is not None
        step = int(report.step or 0)
        got = as_bytes(snapshot(m, opt))
        want = ref["states"].get(str(step), {})
        losses = {i: train_step(m, opt, sched, i, rank, world) for i in range(step + 1, LAST + 1)}
        result[which] = {"step": step, "tier": report.tier, "pieces": report.pieces,  # type: ignore[attr-defined]
                        "equal": got == want, "differ": sorted(k for k in want if got.get(k) != want[k]),
                        "losses": losses}
    with open(os.path.join(out, f"{name}-{rank}.json"), "w") as f:
        json.dump(result, f)


def crash(out: str, base: str, root: str, until: str) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    m, opt, sched = build(0, world)
    ballast = torch.zeros(1 << 20)
    mgr = shardpoint.CheckpointManager(root, keep_last=3, memory=tier(base, 1), timeout=120)

    def state(i: int) -> dict[str, Any]:
        return {"train": shardpoint.TrainState(model=m, optimizer=opt, scheduler=sched, step=i), "ballast": ballast}

    report = mgr.restore(state(0))
    start = int(report.step or 0) if report is not None else 0
    if report is not None:
        with open(os.path.join(out, f"step-{start}.json")) as f:
            want = json.load(f)
        got = as_bytes({**snapshot(m, opt), "ballast": ballast})
        if rank == 0:
            with open(os.path.join(out, f"restored-{time.monotonic_ns()}.json"), "w") as f:
                json.dump({"step": start, "tier": report.tier, "equal": got == want}, f)  # type: ignore[attr-defined]
    elif rank == 0:
        with open(os.path.join(out, f"restored-{time.monotonic_ns()}.json"), "w") as f:
            json.dump({"step": None, "tier": None, "equal": True}, f)
    steps = start + int(until[1:]) if until.startswith("+") else int(until)  # "+N": N steps after the restored one
    for i in range(start + 1, steps + 1):
        train_step(m, opt, sched, i, rank, world)
        ballast.fill_(float(i))
        d = as_bytes({**snapshot(m, opt), "ballast": ballast})
        if rank == 0:
            tmp = os.path.join(out, f".step-{i}.json.tmp")
            with open(tmp, "w") as f:
                json.dump(d, f)
            os.replace(tmp, os.path.join(out, f"step-{i}.json"))
        mgr.save(state(i), i)
    mgr.wait()
    with open(os.path.join(out, f"done-{rank}"), "w") as f:
        f.write(str(steps))


def main() -> None:
    mode, out, base = sys.argv[1:4]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    if mode == "train":
        train(out, base, *sys.argv[4:7])
    elif mode == "resume":
        resume(out, base, *sys.argv[4:7])
    else:
        crash(out, base, sys.argv[4], sys.argv[5])
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
