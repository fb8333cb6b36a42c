"""The one owner of a save: every step of a collective save runs from
:func:`save_state`, in order:

    describe -> arrive -> coordinate -> stage -> write -> commit -> after-commit

1. describe (:mod:`.describe`): what this rank holds, in global coordinates.
2. arrive: every rank of the group came for this save (:mod:`shardpoint.collective`).
3. coordinate (:mod:`.coordinate`): one round trip to rank 0, which plans who writes
   which bytes (replicated bytes once) and answers each rank with its assignment.
4. stage (:mod:`.stage`): what this rank writes, in file order: in place (blocking),
   or copied to a reused host buffer (asynchronous; in the background with
   ``overlap``).
5. write (:mod:`.write`): one data file per rank, checksummed as it streams,
   fsynced, its index beside it; unchanged chunks referenced (incremental).
6. commit (:mod:`.commit`): rank 0 checks replicas, checks the files, writes the
   manifest last and (a manager's save) points ``latest`` at it, before any rank
   returns; a stale attempt of the job is refused there and while planning
   (:mod:`.fence`).
7. after-commit: the caller's ``after_commit`` (rank 0, after every rank returned:
   retention).

A failure at any step raises on every rank and commits nothing. A blocking save
runs the steps on the caller's thread; ``blocking=False`` runs steps 5-7 on a
background thread after staging, and ``overlap=True`` moves step 4's copy there
too. Nothing else differs.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

from .._gc import gc_paused
from ..collective import Comm
from ..health import roles_of
from ..report import SaveStats, human
from ..runtime import PROCESS
from ..storage import Storage
from .commit import commit
from .coordinate import request_assignment
from .coordinator import Coordinator
from .describe import data_file, describe
from .handle import SaveHandle, wait_in_flight
from .incremental import Session
from .records import Described, Planned, SaveOptions, Staged, WriteStatus
from .stage import Stage, optimizers
from .write import write

T = TypeVar("T")
_LOG = logging.getLogger("shardpoint.save")


@gc_paused()
def save_state(comm: Comm, storage: Storage, state: Any, options: SaveOptions, *, blocking: bool = True,
               overlap: bool = False) -> SaveHandle | None:
    """Save ``state`` to ``storage`` on every rank of ``comm`` (see :func:`shardpoint.save`).
    Returns None when ``blocking``, else the handle of the save continuing in the background."""
    clock = _Clock()
    wait_in_flight()  # one save at a time: an earlier asynchronous save commits (or raises) first
    comm.arrive("save", storage.url)
    described: Described | None = None
    error: BaseException | None = None
    try:
        described = describe(state)
    except Exception as e:  # noqa: BLE001 - fanned out to every rank by the plan
        error = e
    clock.mark("describe")
    handle = None if blocking else SaveHandle(storage.url)
    try:
        planned, coord = request_assignment(comm, storage, described, error, options)
    except Exception as e:
        if handle is None:
            raise
        handle._fail(e)  # surfaced on wait(), as every error of an asynchronous save
        PROCESS.in_flight = handle
        return handle
    clock.mark("coordinate")
    assert described is not None
    stage = Stage(described, planned.assignment)
    owners = described.health_owners
    if handle is None:
        _finish(comm, storage, planned, coord, stage.in_place, options, owners, clock)
        return None
    if overlap:
        stage.guard()
        handle._hold_optimizers(optimizers(state))
        staging: Callable[[], Staged] = stage.copy
    else:
        staged, error = _attempt(stage.copy)
        clock.mark("stage")
        handle._staged.set()

        def staging() -> Staged:
            if error is not None:
                raise error
            assert staged is not None
            return staged

    def background() -> None:
        try:
            handle.stats = _finish(comm, storage, planned, coord, staging, options, owners, clock, handle)
        except BaseException as e:  # noqa: BLE001 - surfaced on wait()
            handle._error = e
        finally:
            handle._staged.set()
            handle._done.set()

    PROCESS.in_flight = handle
    clock.stall = clock.elapsed()
    handle._thread = comm.start_background(background, "shardpoint-save")
    return handle


def _finish(comm: Comm, storage: Storage, planned: Planned, coord: Coordinator | None, staging: Callable[[], Staged],
            options: SaveOptions, owners: tuple[tuple[str, object], ...], clock: _Clock,
            handle: SaveHandle | None = None) -> SaveStats:
    """Stage (if not yet), write, commit, after-commit: every rank, every mode. Returns
    what the save cost on this rank (logged, and given to ``options.on_stats``)."""
    staged, error = _attempt(staging)
    if handle is not None:
        handle._staged.set()
    clock.mark("stage")
    PROCESS.seams.fire_phase("planned")
    fname = data_file(comm.rank, planned.save_id)
    status: WriteStatus | None = None
    if error is None:
        assert staged is not None
        status, error = _attempt(_write, storage, fname, staged, options.incremental, owners)
    clock.mark("write")
    total = commit(comm, storage, planned, coord, fname, status, error, options)
    clock.mark("commit")
    wall = clock.elapsed()
    stats = SaveStats(
        path=storage.url, step=options.step, rank=comm.rank, world_size=comm.world,
        bytes_written=(status.size + status.index.size) if status is not None and status.index is not None else 0,
        bytes_referenced=sum(int(r.get("bytes", 0)) for r in (status.refs or {}).values()) if status is not None else 0,
        checkpoint_bytes=total, wall_s=wall, stall_s=clock.stall if handle is not None else wall,
        phases=dict(clock.phases))
    _log_save(stats, options.what)
    if options.on_stats is not None:
        options.on_stats(stats)
    if coord is not None and options.after_commit is not None:
        try:
            options.after_commit()
        except Exception as e:  # noqa: BLE001 - the checkpoint is committed; retention may try again next save
            warnings.warn(f"shardpoint: cleaning up old checkpoints after the save failed: {e}", stacklevel=2)
    return stats


class _Clock:
    """Seconds since a save began, and per stage (stages may run on two threads, one after the other)."""

    def __init__(self) -> None:
        self.t0 = self.last = time.perf_counter()
        self.phases: dict[str, float] = {}
        self.stall = 0.0

    def mark(self, phase: str) -> None:
        now = time.perf_counter()
        self.phases[phase] = self.phases.get(phase, 0.0) + now - self.last
        self.last = now

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0


def _log_save(stats: SaveStats, what: str) -> None:
    """One INFO line per save (rank 0: the whole checkpoint), a DEBUG line per rank;
    their figures are formatted only when a handler would take the line."""
    if stats.rank == 0 and stats.checkpoint_bytes is not None and _LOG.isEnabledFor(logging.INFO):
        rate = human(stats.checkpoint_bytes / stats.wall_s) + "/s" if stats.wall_s > 0 else "-"
        ref = f", {human(stats.bytes_referenced)} referenced by rank 0" if stats.bytes_referenced else ""
        _LOG.info("%s committed %s: %s from %d rank(s) in %.3fs (%s); the caller waited %.3fs%s",
                  what, stats.path, human(stats.checkpoint_bytes), stats.world_size, stats.wall_s, rate, stats.stall_s, ref)
    if _LOG.isEnabledFor(logging.DEBUG):
        phases = ", ".join(f"{k} {v:.3f}s" for k, v in stats.phases.items())
        _LOG.debug("%s, rank %d: %s written, %s referenced; %s", what, stats.rank, human(stats.bytes_written),
                   human(stats.bytes_referenced), phases)


def _write(storage: Storage, fname: str, staged: Staged, incremental: Session | None,
           owners: tuple[tuple[str, object], ...]) -> WriteStatus:
    status = write(storage, fname, staged, incremental)
    if status.nonfinite:  # what each key that holds a NaN or an infinity is (the manifest's health record)
        status = dataclasses.replace(status, roles=roles_of(owners, status.nonfinite))
    PROCESS.seams.fire_phase("written")
    return status


def _attempt(fn: Callable[..., T], *args: Any) -> tuple[T | None, BaseException | None]:
    """``fn(*args)`` and None, or None and its error: a rank's failure is carried to
    the next collective step, which raises it on every rank."""
    try:
        return fn(*args), None
    except Exception as e:  # noqa: BLE001 - fanned out to every rank by the next collective
        return None, e
