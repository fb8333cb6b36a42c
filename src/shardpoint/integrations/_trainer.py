"""What the trainer integrations (Lightning, Accelerate, transformers) share: an
arrival check that runs *before* the core's collective save or load, and RNG
streams captured now and applied later.

Why a second arrival check: a trainer calls the checkpoint at a point of its own
loop, and users guard such calls with ``if is_main_process:``. The core names the
absent ranks and lets the next call of another path go on, but a trainer often
saves the *same* path again (Lightning's ``last.ckpt`` at every save), which
the core takes for a late arrival at the abandoned call. Here each arrival is keyed
by what the call is about (operation, path and the trainer's global step), so a
save that only rank 0 made is abandoned with a
:class:`~shardpoint.CollectiveMismatchError` naming the absent ranks before the
core is entered, and the next save of the whole job meets in a fresh slot.
"""

from __future__ import annotations

import json
import time
from datetime import timedelta
from typing import Any

from .._rng import current_streams, set_streams
from ..errors import CollectiveMismatchError

__all__ = ["arrive", "capture_rng", "apply_rng", "timeout_seconds"]

#: This process's RNG streams, captured now and set later (the core's own helpers).
capture_rng, apply_rng = current_streams, set_streams


def timeout_seconds(timeout: timedelta | float) -> float:
    return timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)


def arrive(op: str, path: str, step: int | str, timeout: timedelta | float, process_group: Any = None) -> None:
    """Block until every rank of ``process_group`` arrived for ``op`` on ``path`` at
    ``step``, or raise :class:`CollectiveMismatchError` naming the ranks that did
    not come within ``timeout`` (a rank that comes later gets the same error at
    once). Without torch.distributed, or on one rank, returns at once."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    group = process_group if process_group is not None else dist.group.WORLD
    world = dist.get_world_size(group)
    if world == 1:
        return
    rank = dist.get_rank(group)
    from torch.distributed.distributed_c10d import _get_default_store

    ranks = dist.get_process_group_ranks(group)
    store = dist.PrefixStore(f"shardpoint-trainer/{'-'.join(map(str, ranks))}/", _get_default_store())
    base = json.dumps([op, str(path), str(step)])
    verdict_key = f"{base}/verdict"
    store.set(f"{base}/r/{rank}", "1")
    count = store.add(f"{base}/n", 1)
    seconds = timeout_seconds(timeout)
    deadline = time.monotonic() + seconds
    pause = 0.002
    while True:
        if store.check([verdict_key]):
            verdict = store.get(verdict_key).decode()
        elif count >= world:
            verdict = store.compare_set(verdict_key, "", "ok").decode()
        elif time.monotonic() >= deadline:
            absent = [r for r in range(world) if not store.check([f"{base}/r/{r}"])]
            verdict = store.compare_set(verdict_key, "", "aborted:" + json.dumps(absent)).decode()
        else:
            time.sleep(pause)
            pause = min(pause * 2, 0.05)
            count = store.add(f"{base}/n", 0)
            continue
        break
    if verdict == "ok":
        return
    absent = json.loads(verdict.split(":", 1)[1])
    raise CollectiveMismatchError(
        f"checkpoint {op} of {path!r} at step {step} is collective, but ranks {absent} did not call it within "
        f"{seconds:g}s, so it was abandoned on every rank. Call it on every rank (not inside "
        "`if trainer.is_global_zero:` / `accelerator.is_main_process` / `process_index == 0`); "
        "the next save made by every rank works",
        ranks=absent,
    )
