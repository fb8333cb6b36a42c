"""The job the memory-tier kill trials run (tests/failure/test_tiers_sigkill.py): FSDP2
+ AdamW on 2 ranks and a 16 MB ballast, a snapshot every step, durable every 5; it
restores, checks what it restored against what was recorded for that step, then
trains until it is killed. Rank 0 records each step's values (full tensors' SHA-256)
before saving that step."""

from __future__ import annotations

import hashlib
import json
import os
from datetime import timedelta
from typing import Any

import torch


def digests(m: Any, opt: Any, ballast: torch.Tensor) -> dict[str, str]:
    from tests.distributed.test_train_state import snapshot

    out = {k: hashlib.sha256(v.detach().contiguous().numpy().tobytes()).hexdigest() for k, v in snapshot(m, opt).items()}
    out["ballast"] = hashlib.sha256(ballast.numpy().tobytes()).hexdigest()
    return out


def job(rank: int, world: int, port: int, root: str, base: str, records: str, q: Any, max_steps: int) -> None:
    try:
        _job(rank, world, port, root, base, records, q, max_steps)
    except BaseException:
        import traceback

        q.put((rank, "error", traceback.format_exc(), None, False))
        raise


def _job(rank: int, world: int, port: int, root: str, base: str, records: str, q: Any, max_steps: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      OMP_NUM_THREADS="1")
    import torch.distributed as dist

    import shardpoint
    from shardpoint.tiers import MemoryTier
    from tests.distributed.test_train_state import build, step

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=60))
    m, opt, sched = build(0, world)
    ballast = torch.zeros(4 << 20)
    mgr = shardpoint.CheckpointManager(root, keep_last=3,
                                       memory=MemoryTier(every=1, durable_every=5, keep=2, path=base, drain="process"))

    def state(i: int) -> dict[str, Any]:
        return {"train": shardpoint.TrainState(model=m, optimizer=opt, scheduler=sched, step=i), "ballast": ballast}

    report = mgr.restore(state(0))
    start = 0
    if report is not None:
        start = int(report.step or 0)
        got = digests(m, opt, ballast)
        with open(os.path.join(records, f"step-{start}.json")) as f:
            want = json.load(f)
        if rank == 0:
            q.put((rank, "restored", start, report.tier, got == want))  # type: ignore[attr-defined]
    else:
        q.put((rank, "restored", None, None, True))
    for i in range(start + 1, max_steps + 1):
        step(m, opt, sched, i, rank, world)
        ballast.fill_(float(i))
        d = digests(m, opt, ballast)
        if rank == 0:
            tmp = os.path.join(records, f".step-{i}.json.tmp")
            with open(tmp, "w") as f:
                json.dump(d, f)
            os.replace(tmp, os.path.join(records, f"step-{i}.json"))
        mgr.save(state(i), i)
    mgr.wait()
    q.put((rank, "done", max_steps, None, True))
    dist.destroy_process_group()
