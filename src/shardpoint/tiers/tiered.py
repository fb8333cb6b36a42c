"""The memory tier of a CheckpointManager: snapshot, drain, and the restore ladder.

* ``save``: a step due for the tier is saved (the core's save pipeline, blocking) to
  this host's job folder in shared memory; a step due for durability is then drained
  from that snapshot by rank 0's helper. Full shared memory skips the snapshot with a
  warning (a step due for durability is then saved directly to the root).
* ``restore_memory``: every rank says which complete snapshots it sees; the newest
  one every rank sees, if it is at least as new as the durable resume point, is
  loaded (resharding as any load). Else the manager restores from the root.
"""

from __future__ import annotations

import errno
import socket
import warnings
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

from ..api import load
from ..collective import Comm, agree
from ..errors import CorruptCheckpointError, ShardpointError, UsageError
from ..saving.pipeline import save_state
from ..saving.records import SaveOptions
from .config import MemoryTier, job_identity
from .drain import Drainer, DrainJob
from .report import TieredLoadReport
from .shm import JobArea


def no_space(e: BaseException) -> bool:
    """Whether ``e`` (on any rank: a peer's failure arrives as its message) is a full device."""
    seen: BaseException | None = e
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno == errno.ENOSPC:
            return True
        seen = seen.__cause__ or seen.__context__
    return "[Errno 28]" in str(e) or "No space left on device" in str(e)


class Tiers:
    """The memory tier of one manager (see the module docstring). Rank 0 owns the drain."""

    def __init__(self, tier: MemoryTier, *, root: str, storage_options: dict[str, Any] | None, process_group: Any,
                 timeout: timedelta | float, folder: Callable[[int], str], pointer: Callable[[int], bytes],
                 on_drained: Callable[[int], None]) -> None:
        self.tier = tier
        self.root, self.storage_options = root, storage_options
        self.process_group, self.timeout = process_group, timeout
        self.folder, self.pointer, self.on_drained = folder, pointer, on_drained
        self.area = JobArea(tier.path, job_identity(tier, root))
        self.drainer = Drainer(tier.drain)
        #: Steps whose snapshot was skipped because shared memory was full (this process).
        self.skipped: list[int] = []
        #: Steps a drain failed to make durable, with why (this process, rank 0).
        self.failed: dict[int, str] = {}
        self.bypass = False
        self._opened = False

    def _comm(self) -> Comm:
        return Comm(self.process_group, self.timeout)

    def _open(self, comm: Comm) -> None:
        """Once per manager, collective: one host only (for now), and the job folder."""
        if self._opened:
            return
        comm.arrive("tiers-open", self.area.dir)
        hosts = comm.all_gather_json(socket.gethostname())
        if len(set(hosts)) > 1:
            raise UsageError(f"a memory tier over several hosts ({sorted(set(hosts))}) is not built yet: each host "
                             "would hold only its ranks' pieces and the drain reads them all from one (issue 23, "
                             "next slice). Use CheckpointManager without memory= on more than one host")
        error: BaseException | None = None
        try:
            self.area.open()
        except Exception as e:  # noqa: BLE001 - fanned out to every rank
            error = e
        agree(comm, None, error)
        self._opened = True

    # -- save ------------------------------------------------------------------------
    def save(self, state: Any, step: int, *, metrics: Mapping[str, float] | None, durable: bool) -> bool:
        """Snapshot ``step`` if due, and start its drain if due for durability. Collective.
        Returns False when the caller must save the step directly to the root instead
        (due for durability, but its snapshot did not fit in shared memory)."""
        comm = self._comm()
        if comm.rank == 0:
            self._collect(wait=False)
        snap, dur = self.tier.due(step)
        dur = dur or durable
        if not (snap or dur):
            return True
        self._open(comm)
        if comm.rank == 0:  # the memory bound: room for the new snapshot first
            draining = {self.drainer.job.step} if self.drainer.job is not None else set()
            self.area.free(self.tier.keep - 1, draining)
        storage = self.area.storage(step)
        try:
            save_state(comm, storage, state, SaveOptions(overwrite=True, metrics=metrics), blocking=True)
        except ShardpointError as e:
            if not no_space(e):
                raise
            if comm.rank == 0:
                self.area.remove(step)
            self.skipped.append(step)
            warnings.warn(f"shardpoint: memory snapshot of step {step} skipped: shared memory under {self.area.dir} "
                          f"is full ({e}). Training goes on; "
                          + ("the step is saved directly to the durable root." if dur else
                             "give MemoryTier(path=...) more room or lower keep="), stacklevel=3)
            return not dur
        if dur and comm.rank == 0:
            self._drain(step)
        return True

    def _drain(self, step: int) -> None:
        self._collect(wait=True)  # one drain at a time
        self.drainer.start(DrainJob(step=step, src=self.area.storage(step).url, root=self.root,
                                    folder=self.folder(step), pointer=self.pointer(step),
                                    storage_options=self.storage_options))

    def _collect(self, *, wait: bool) -> None:
        """Rank 0: take the result of a drain that ended (wait for it if ``wait``):
        retention after a commit, a warning after a failure."""
        result = self.drainer.wait() if wait else self.drainer.poll()
        if result is None:
            return
        if result.error is not None:
            self.failed[result.step] = result.error
            warnings.warn(f"shardpoint: step {result.step} was not made durable under {self.root}: {result.error}. "
                          "Its memory snapshot is kept until newer ones replace it", stacklevel=3)
            return
        self.area.free(self.tier.keep, set())  # the drained snapshot, when newer ones came meanwhile
        try:
            self.on_drained(result.step)
        except Exception as e:  # noqa: BLE001 - the checkpoint is committed; retention tries again next time
            warnings.warn(f"shardpoint: cleaning up old checkpoints after step {result.step} failed: {e}", stacklevel=3)

    def wait(self) -> None:
        """Rank 0: wait for the drain in flight (and run retention after it)."""
        self._collect(wait=True)

    def close(self) -> None:
        self.wait()
        self.drainer.close()

    # -- restore ---------------------------------------------------------------------
    @contextmanager
    def bypassed(self) -> Iterator[None]:
        """The manager's own (durable) restore, run from inside the ladder."""
        self.bypass = True
        try:
            yield
        finally:
            self.bypass = False

    def restore_memory(self, state: Any, durable_step: int | None, *, only: list[str] | str | None,
                       exclude: list[str] | str | None, strict: bool) -> TieredLoadReport | None:
        """Load the newest snapshot every rank sees in full, if it is at least as new as
        ``durable_step`` (rank 0's resume point on the root). Collective. None: nothing
        loaded, restore from the root."""
        comm = self._comm()
        comm.arrive("tiers-restore", self.area.dir)
        mine: list[int] = []
        for snap in self.area.complete():
            if snap.manifest.nonfinite:
                warnings.warn(f"shardpoint: not restoring memory snapshot {snap.path}: it holds non-finite values in "
                              f"{snap.manifest.nonfinite[:5]}", stacklevel=3)
            else:
                mine.append(snap.step)
        everyone = comm.all_gather_json({"steps": mine, "durable": durable_step})
        common = set(everyone[0]["steps"]).intersection(*(set(e["steps"]) for e in everyone[1:]))
        durable = everyone[0]["durable"]
        for step in sorted((s for s in common if durable is None or s >= durable), reverse=True):
            storage = self.area.storage(step)
            try:
                report = load(state, storage, only=only, exclude=exclude, strict=strict,
                              process_group=self.process_group, timeout=self.timeout)
            except CorruptCheckpointError as e:
                warnings.warn(f"shardpoint: memory snapshot of step {step} cannot be loaded ({e}); trying an older one",
                              stacklevel=3)
                continue
            report.step = step
            self.after_restore(comm.rank, step, durable)
            return TieredLoadReport.of(report, "memory", storage.url)
        return None

    def after_restore(self, rank: int, step: int | None, durable: int | None) -> None:
        """Rank 0, once a step was restored (None: none was): snapshots newer than it
        belong to an abandoned future and go; the newest snapshot due for durability
        that the root lacks (its drain was cut by the crash) is drained again."""
        if rank != 0:
            return
        for s in self.area.steps():
            if step is None or s > step:
                self.area.remove(s)
        due = [s.step for s in self.area.complete() if self.tier.due(s.step)[1] and (durable is None or s.step > durable)]
        if due:
            self._drain(due[-1])
