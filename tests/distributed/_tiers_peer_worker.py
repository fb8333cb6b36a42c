"""One rank of the peer-memory restore tests (tests/distributed/test_tiers_peer.py) and
of benchmarks/tiers_restore_bench.py, started by torchrun inside a network namespace
whose host name is its own.

    python -m tests.distributed._tiers_peer_worker train OUT BASE ROOT MB
    python -m tests.distributed._tiers_peer_worker resume OUT BASE ROOT MB NAME

``train`` (any hosts x ranks): FSDP2 + AdamW and a ballast of MB megabytes sharded
``Shard(0)`` over the ranks (a DTensor), a memory snapshot every step
(``replicas=1``, durable every 5, or every ``$TIERS_DURABLE_EVERY``) up to step 7, then waits for replication and
drains, records the state of step 7 and trains on to step 10 without saving (the
uninterrupted run's losses), writes ``ready-<rank>`` and sleeps until killed.

``resume`` (any hosts and ranks; a rank that fails writes ``error-<rank>.txt``): restores into a fresh model and ballast; writes
(``NAME-<rank>.json``) the step, tier and pieces, the bytes the report says this
rank received and its host needed, the bytes into this host's network interface
during the restore (the host's first rank reads them, in its namespace), the
restore's wall time, whether the state is byte-equal to the recorded one, and the
losses of the steps after it up to 10 (the global batch of 24 kept).
"""

from __future__ import annotations

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
from tests.distributed._tiers_hosts_worker import as_bytes
from tests.distributed._tiers_hosts_worker import train_step as hosts_train_step
from tests.distributed.test_train_state import build, snapshot

BATCH = 24  # a whole share on 2, 4 and 6 ranks
LAST = 10
IFACE = "sp0"


def tier(base: str) -> MemoryTier:
    return MemoryTier(every=1, durable_every=int(os.environ.get("TIERS_DURABLE_EVERY", "5")), keep=2, replicas=1,
                      path=os.path.join(base, socket.gethostname()))


def ballast(mb: float, fill: bool) -> Any:
    """A DTensor of ``mb`` megabytes, ``Shard(0)`` over the world (rows of 256 floats)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    rows = max(1, int(mb * (1 << 20)) // 1024)
    full = torch.arange(rows * 256, dtype=torch.float32).reshape(rows, 256) if fill else torch.zeros(rows, 256)
    return distribute_tensor(full, init_device_mesh("cpu", (dist.get_world_size(),)), [Shard(0)])


def train_step(m: Any, opt: Any, sched: Any, i: int, rank: int, world: int) -> float:
    """One step on this rank's share of a global batch of 24; returns the global loss."""
    return hosts_train_step(m, opt, sched, i, rank, world, batch=BATCH)


def state_of(m: Any, opt: Any, sched: Any, big: Any, i: int) -> dict[str, Any]:
    return {"train": shardpoint.TrainState(model=m, optimizer=opt, scheduler=sched, step=i), "ballast": big}


def values(m: Any, opt: Any, big: Any) -> dict[str, str]:
    return as_bytes({**snapshot(m, opt), "ballast": big.full_tensor()})


def train(out: str, base: str, root: str, mb: str) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    m, opt, sched = build(0, world)
    big = ballast(float(mb), True)
    mgr = shardpoint.CheckpointManager(root, keep_last=2, memory=tier(base), timeout=120)
    losses, states = {}, {}
    for i in range(1, LAST + 1):
        losses[i] = train_step(m, opt, sched, i, rank, world)
        if i <= 7:
            mgr.save(state_of(m, opt, sched, big, i), i)
        if i == 7:
            states[i] = values(m, opt, big)
            mgr.wait()  # replication and drains done
    if rank == 0:
        with open(os.path.join(out, "train.json"), "w") as f:
            json.dump({"losses": losses, "states": states}, f)
    with open(os.path.join(out, f"ready-{rank}"), "w") as f:
        f.write(socket.gethostname())
    while True:  # until killed
        time.sleep(1)


def _rx() -> int:
    """Bytes received by this host's network interface (this namespace's)."""
    try:
        with open(f"/sys/class/net/{IFACE}/statistics/rx_bytes") as f:
            return int(f.read())
    except OSError:
        return -1


def resume(out: str, base: str, root: str, mb: str, name: str) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    with open(os.path.join(out, "train.json")) as f:
        ref = json.load(f)
    m, opt, sched = build(1, world)
    big = ballast(float(mb), False)
    # "die": its holder is killed mid-transfer; a vanished peer is given up after the manager's timeout
    mgr = shardpoint.CheckpointManager(root, keep_last=2, memory=tier(base), timeout=30 if name == "die" else 120)
    dist.barrier()
    rx0 = _rx()
    t0 = time.perf_counter()
    report = mgr.restore(state_of(m, opt, sched, big, 0))
    wall = time.perf_counter() - t0
    dist.barrier()
    rx1 = _rx()
    assert report is not None
    step = int(report.step or 0)
    got = values(m, opt, big)
    want = ref["states"].get(str(step), {})
    losses = {i: train_step(m, opt, sched, i, rank, world) for i in range(step + 1, LAST + 1)}
    mgr.close()
    result = {"rank": rank, "host": socket.gethostname(), "local_rank": int(os.environ.get("LOCAL_RANK", "0")),
              "step": step, "tier": getattr(report, "tier", None), "pieces": getattr(report, "pieces", {}),
              "received": getattr(report, "received", None), "host_needed": getattr(report, "host_needed", None),
              "durable_read": getattr(report, "durable_read", None),
              "host_durable_needed": getattr(report, "host_durable_needed", None),
              "rx": rx1 - rx0, "wall_s": wall, "equal": got == want,
              "differ": sorted(k for k in want if got.get(k) != want[k]), "losses": losses}
    with open(os.path.join(out, f"{name}-{rank}.json"), "w") as f:
        json.dump(result, f)


def main() -> None:
    mode, out, base = sys.argv[1:4]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    if mode == "train":
        train(out, base, *sys.argv[4:6])
    else:
        try:
            resume(out, base, *sys.argv[4:7])
        except Exception as e:
            with open(os.path.join(out, f"error-{dist.get_rank()}.txt"), "w") as f:
                f.write(f"{socket.gethostname()} {type(e).__name__}: {e}")
            raise
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
