"""The memory tier of a CheckpointManager: snapshot, replication, drain, and the
restore ladder, on one host or several.

* ``save``: a step due for the tier is saved (the core's save pipeline) to each
  host's job folder in shared memory: each rank writes its file on its own host,
  rank 0 the manifest on its host; then rank 0 sends the sealed manifest to every
  host (one rank per host writes it). A step due only for memory returns once its
  state is staged: its write and commit run in the background, and the manifest's
  sharing and replicas follow at the next collective point (``_finish_snapshot``). With ``replicas``, each rank's files are
  then copied to other hosts by a background thread over the channel's side lane
  (the next snapshot waits for it). A step due for durability is drained by each
  host's first rank (its ranks' files, in its helper process); rank 0 commits the
  manifest and ``latest`` once every host's part is in (checked at the next
  collective point: a save, :meth:`Tiers.wait`). Full shared memory skips the
  snapshot with a warning (a step due for durability is then saved directly).
* ``restore_memory``: each host's first rank reports what its host holds; rank 0
  picks the newest step whose manifest is on some host and whose files the present
  hosts hold between them (or, for files on no present host, the durable root holds
  in the same save); a host lacking the manifest or an index gets it whole; every
  rank loads through its host's folder (resharding as any load), whose load first
  fetches the byte ranges of data files its host lacks from the nearest holder
  (:mod:`.peer`) and reads those of files no host holds from the root. Else the
  manager restores from the root.
"""

from __future__ import annotations

import base64
import errno
import logging
import os
import socket
import threading
import warnings
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import msgspec

from ..collective import Comm, agree
from ..errors import CollectiveMismatchError, CorruptCheckpointError, MemoryTierError, ShardpointError
from ..format.manifest import MANIFEST_NAME, Manifest
from ..load.locate import committed, read_manifest
from ..load.pipeline import LoadOptions, load_state
from ..saving.fence import Owner
from ..saving.handle import SaveHandle, settle_in_flight
from ..saving.pipeline import save_state
from ..saving.records import SaveOptions
from ..storage import Storage, storage_for
from .config import MemoryTier, job_identity
from .drain import Drainer, DrainJob, DrainResult
from .hosts import (
    Candidate,
    FileSpec,
    HostInventory,
    Hosts,
    Redrain,
    RestoreDecision,
    StepHolding,
    drain_parts,
    needed,
    rank_files,
    redrain_parts,
    replica_plan,
    restore_plan,
    unhealthy,
)
from .peer import PeerFetch
from .replicate import Move, transfer
from .report import TieredLoadReport
from .shm import JobArea, PrivateStorage
from .view import TieredView

_LOG = logging.getLogger("shardpoint.tiers")


def no_space(e: BaseException) -> bool:
    """Whether ``e`` (on any rank: a peer's failure arrives as its message) is a full device."""
    seen: BaseException | None = e
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno == errno.ENOSPC:
            return True
        seen = seen.__cause__ or seen.__context__
    return "[Errno 28]" in str(e) or "No space left on device" in str(e)


class _PartDone(msgspec.Struct, frozen=True, array_like=True):
    """One rank's word on its host's part of a drain spread over hosts (every rank
    not draining a part: done)."""

    done: bool
    error: str | None = None


class _PartsDone(msgspec.Struct, frozen=True, array_like=True):
    """Rank 0's verdict on the parts: all done, and the hosts' errors."""

    done: bool
    errors: list[str]


@dataclass(frozen=True, slots=True)
class _Pending:
    """A drain spread over hosts: each host in ``hosts`` copies its part; rank 0 commits
    once all of them report theirs done (known alike on every rank)."""

    step: int
    save_id: str
    hosts: frozenset[int]


class Tiers:
    """The memory tier of one manager (see the module docstring)."""

    def __init__(self, tier: MemoryTier, *, root: str, storage_options: dict[str, Any] | None, process_group: Any,
                 timeout: timedelta | float, folder: Callable[[int], str], owner: Callable[[], Owner],
                 on_drained: Callable[[int], None]) -> None:
        self.tier = tier
        self.root, self.storage_options = root, storage_options
        self.process_group, self.timeout = process_group, timeout
        #: Rank 0: this attempt's claim on the root (claimed on first use): snapshots and drains are fenced by it.
        self.folder, self.owner, self.on_drained = folder, owner, on_drained
        self.area = JobArea(tier.path, job_identity(tier, root))
        self.drainer = Drainer(tier.drain)
        #: Steps whose snapshot was skipped because shared memory was full (this process).
        self.skipped: list[int] = []
        #: Steps a drain failed to make durable, with why (rank 0).
        self.failed: dict[int, str] = {}
        #: Per snapshot step, what its replication could not do (this rank's part; empty: all done).
        self.replication: dict[int, list[str]] = {}
        self.bypass = False
        self.hosts: Hosts | None = None
        #: Copies per rank actually made: ``tier.replicas``, at most the other hosts' number.
        self.replicas = 0
        self._replicating: threading.Thread | None = None
        self._pending: _Pending | None = None
        self._part: DrainResult | None = None  # this host's part of the pending drain, once ended
        #: The snapshot whose write and commit run in the background: its step and handle.
        self._snapshot: tuple[int, SaveHandle] | None = None
        self._created = False
        #: The last :meth:`restore_memory`: snapshots passed over, with why (every rank).
        self.passed: dict[int, str] = {}
        #: The last :meth:`restore_memory`: the steps the present hosts held in full (every rank).
        self.restorable: list[int] = []
        #: Rank 0, in :meth:`restore_memory`: each present host's inventory (what it holds of each step).
        self._invs: list[HostInventory] = []

    def _comm(self) -> Comm:
        return Comm(self.process_group, self.timeout)

    @property
    def _name(self) -> str:
        """The job folder's name: the same on every host (its base may differ)."""
        return os.path.basename(self.area.dir)

    def _open(self, comm: Comm, *, create: bool = True) -> Hosts:
        """Once per manager, collective: the hosts (by host name), the side lane that
        carries files between hosts, and (``create``) the job folder on each host."""
        if self.hosts is not None:
            if create and not self._created:
                self._create(comm)
            return self.hosts
        comm.arrive("tiers-open", self._name)
        # rank 0 groups the ranks by host and sends every rank the grouping (its size in hosts, not ranks)
        names = comm.gather_json(socket.gethostname())
        hosts = Hosts.from_wire(comm.broadcast_json(Hosts.of(names).wire() if names is not None else None))
        self.replicas = min(self.tier.replicas, len(hosts) - 1)
        if self.replicas < self.tier.replicas and comm.rank == 0:
            warnings.warn(f"shardpoint: MemoryTier(replicas={self.tier.replicas}) on {len(hosts)} host(s) "
                          f"{list(hosts.names)}: a replica never lands on its own host, so {self.replicas} "
                          "cop(ies) per rank are made. Lower replicas= to silence this", stacklevel=4)
        if len(hosts) > 1:
            comm.open_side()
        self.hosts = hosts
        if create:
            self._create(comm)
        return hosts

    def _create(self, comm: Comm) -> None:
        """The job folder on every host (collective)."""
        error: BaseException | None = None
        try:
            self.area.open()
        except Exception as e:  # noqa: BLE001 - fanned out to every rank
            error = e
        agree(comm, None, error)
        self._created = True

    def _leader(self, comm: Comm) -> bool:
        assert self.hosts is not None
        return self.hosts.is_leader(comm.rank)

    # -- save ------------------------------------------------------------------------
    def save(self, state: Any, step: int, *, metrics: Mapping[str, float] | None, durable: bool) -> bool:
        """Snapshot ``step`` if due, replicate it, and start its drain if due for
        durability. Collective. Returns False when the caller must save the step
        directly to the root instead (due for durability, but its snapshot did not
        fit in shared memory)."""
        comm = self._comm()
        # the previous snapshot is committed and shared first: its commit runs on the
        # channel in the background, and nothing else may use the channel meanwhile
        self._finish_snapshot(comm)
        self._settle(comm, wait=False)
        snap, dur = self.tier.due(step)
        dur = dur or durable
        if not (snap or dur):
            return True
        self._open(comm)
        self._join_replication()  # the previous snapshot's replicas are in before a new one starts
        if dur:
            self._settle(comm, wait=True)  # one drain at a time
        leader = self._leader(comm)
        if leader:  # the memory bound: room for the new snapshot first (replicas included)
            draining = {self.drainer.job.step} if self.drainer.job is not None else set()
            if self._pending is not None:  # its commit reads the manifest here
                draining.add(self._pending.step)
            self.area.free(self.tier.keep - 1, draining, background=True)  # its bytes beside the staging copy
            if step not in draining:
                self.area.remove(step)  # a leftover of an abandoned run of this step
        storage = self.area.storage(step)
        options = SaveOptions(overwrite=True, metrics=metrics, owner=self.owner, what=f"the memory snapshot of step {step}",
                              check_files=False)  # each host holds its own ranks' files: restores check completeness
        try:
            # A step due only for memory returns once its state is copied (staged); the
            # write to shared memory and the commit go on in the background, and the
            # manifest's sharing and the replicas follow at the next collective point
            # (_finish_snapshot). A step due for durability is written before save
            # returns: if it does not fit, this very state is saved to the root instead.
            handle = save_state(comm, storage, state, options, blocking=dur)
        except ShardpointError as e:
            if not self._skip(comm, step, e, dur):
                raise
            return not dur
        if handle is not None:
            self._snapshot = (step, handle)
            return True
        self._after_commit(comm, step, storage, dur)
        return True

    def _skip(self, comm: Comm, step: int, e: ShardpointError, dur: bool) -> bool:
        """A snapshot that failed for want of room in shared memory is skipped, with a
        warning (True); any other failure is the caller's to raise (False)."""
        if not no_space(e):
            return False
        if self._leader(comm):
            self.area.remove(step)
        self.skipped.append(step)
        warnings.warn(f"shardpoint: memory snapshot of step {step} skipped: shared memory under {self.area.dir} "
                      f"is full ({e}). Training goes on; "
                      + ("the step is saved directly to the durable root." if dur else
                         "give MemoryTier(path=...) more room or lower keep="), stacklevel=4)
        return True

    def _after_commit(self, comm: Comm, step: int, storage: PrivateStorage, dur: bool) -> None:
        """A committed snapshot: its manifest to every host, its replicas started, and
        (``dur``) its drain started. Collective."""
        assert self.hosts is not None
        man = self._share_manifest(comm, step, storage, self._leader(comm))
        saver = rank_files(man.files)
        if self.replicas > 0:
            self._replicate(comm, step, storage.inner.root, replica_plan(self.hosts, saver, self.replicas))
        if dur:
            self._drain_parts(comm, step, man.save_id, drain_parts(self.hosts, saver), whole=True)

    def _finish_snapshot(self, comm: Comm) -> None:
        """Wait for the snapshot still writing in the background (every rank learns the
        same outcome), then share and replicate it. Collective; called at the next
        snapshot, :meth:`wait` and before a restore, after any save still writing in
        the background has ended: the channel is then free for this manager's
        collectives. Full shared memory skips it with a warning, as for a blocking
        snapshot."""
        settle_in_flight()  # any save writing in the background (this manager's or another's) is off the channel
        pending, self._snapshot = self._snapshot, None
        if pending is None:
            return
        step, handle = pending
        try:
            handle.wait()
        except ShardpointError as e:
            if not self._skip(comm, step, e, False):
                raise
            return
        self._after_commit(comm, step, self.area.storage(step), False)

    def _share_manifest(self, comm: Comm, step: int, storage: PrivateStorage, leader: bool) -> Manifest:
        """Rank 0 sends the committed snapshot's sealed manifest to every rank; the first
        rank of each other host writes it into its host's step folder (atomically). A
        host that cannot hold it is warned about (a restore fetches it from another)."""
        data = bytes(storage.read(MANIFEST_NAME)) if comm.rank == 0 else b""
        if self.hosts is not None and len(self.hosts) > 1:
            data = base64.b64decode(comm.broadcast_json(base64.b64encode(data).decode() if comm.rank == 0 else None))
            if leader and self.hosts.of_rank[comm.rank] != self.hosts.of_rank[0]:
                try:
                    storage.write_atomic(MANIFEST_NAME, data)
                except OSError as e:
                    warnings.warn(f"shardpoint: the manifest of memory snapshot {step} could not be written on host "
                                  f"{socket.gethostname()} ({e}); a restore there fetches it from another host",
                                  stacklevel=4)
        elif comm.rank != 0:
            data = bytes(storage.read(MANIFEST_NAME))
        return Manifest.parse(data, f"{storage.url}/{MANIFEST_NAME}")

    def _replicate(self, comm: Comm, step: int, folder: str, moves: list[Move]) -> None:
        """Copy this rank's files to their replica holders and take the files it holds
        for others, in a background thread on the side lane."""
        def run() -> None:
            try:
                problems = transfer(comm, folder, moves, background=True)
            except Exception as e:  # noqa: BLE001 - reported by the next snapshot, wait() or restore
                problems = [f"{type(e).__name__}: {e}"]
            self.replication[step] = problems

        self.replication[step] = ["still running"]
        self._replicating = comm.start_side(run, "shardpoint-replicate")

    def _join_replication(self) -> None:
        """Wait for the replication in flight; warn about what it could not do."""
        t, self._replicating = self._replicating, None
        if t is None:
            return
        t.join()
        for step, problems in list(self.replication.items()):
            if problems:
                warnings.warn(f"shardpoint: replication of memory snapshot {step} is incomplete ({'; '.join(problems)}"
                              "); that step survives only while every host holding its pieces does", stacklevel=4)
        self.replication.clear()

    # -- drain -----------------------------------------------------------------------
    def _drain_parts(self, comm: Comm, step: int, save_id: str, parts: dict[int, list[FileSpec]], *,
                     whole: bool) -> None:
        """Start the drain of ``step`` (every rank calls it alike; no collective):
        ``parts`` says which host copies which files. All on rank 0's host: rank 0's
        helper copies and commits (``whole``: every file of the snapshot folder). Else
        each host's first rank copies its part, and rank 0 commits at a later
        collective point, once every part is in (:meth:`_settle`)."""
        assert self.hosts is not None
        if set(parts) <= {0}:
            if comm.rank == 0:
                self._collect(wait=True)
                self.drainer.start(self._job(step, None if whole else parts.get(0, []), commit=True))
            return
        self._pending = _Pending(step, save_id, frozenset(parts))
        self._part = None
        h = self.hosts.of_rank[comm.rank]
        if self._leader(comm) and h in parts:
            if comm.rank == 0:
                self._collect(wait=True)
            self.drainer.start(self._job(step, parts[h], commit=False, save_id=save_id))

    def _job(self, step: int, files: list[FileSpec] | None, *, commit: bool, save_id: str | None = None) -> DrainJob:
        return DrainJob(step=step, src=self.area.path(step), root=self.root, folder=self.folder(step),
                        generation=self.owner().generation if commit else None,
                        storage_options=self.storage_options, files=files,
                        commit=commit, save_id=save_id)

    def _settle(self, comm: Comm, *, wait: bool) -> None:
        """Rank 0 takes the result of a committing drain that ended. With a drain spread
        over hosts pending (known alike on every rank; collective then): each host's
        first rank says whether its part is done (waits for it if ``wait``); once all
        are, rank 0 commits (its helper writes the manifest and ``latest`` after
        checking every file is there), or warns that the step was not made durable."""
        if comm.rank == 0:
            self._collect(wait=False)
        p = self._pending
        if p is None:
            return
        assert self.hosts is not None
        mine = _PartDone(True)
        if self._leader(comm) and self.hosts.of_rank[comm.rank] in p.hosts:
            if self._part is None:
                self._part = self.drainer.wait() if wait else self.drainer.poll()
            mine = _PartDone(self._part is not None, self._part.error if self._part is not None else None)
        hosts = self.hosts

        def merge(everyone: list[Any]) -> list[Any]:
            parts = [msgspec.convert(e, _PartDone) for e in everyone]
            return msgspec.to_builtins(_PartsDone(all(e.done for e in parts), [
                f"host {hosts.names[hosts.of_rank[r]]}: {e.error}" for r, e in enumerate(parts) if e.error]))

        # every host's part, to rank 0, and one answer back
        verdict = msgspec.convert(agree(comm, msgspec.to_builtins(mine), None, merge), _PartsDone)
        if not verdict.done:
            return
        self._pending, self._part = None, None
        if comm.rank != 0:
            return
        errors = verdict.errors
        if errors:
            self.failed[p.step] = "; ".join(errors)
            warnings.warn(f"shardpoint: step {p.step} was not made durable under {self.root}: {'; '.join(errors)}. "
                          "Its memory snapshot is kept until newer ones replace it", stacklevel=4)
            return
        self.drainer.start(self._job(p.step, [], commit=True))
        if wait:
            self._collect(wait=True)

    def _collect(self, *, wait: bool) -> None:
        """Rank 0: take the result of a committing drain that ended (wait for it if
        ``wait``): retention after a commit, a warning after a failure."""
        job = self.drainer.job
        if job is None or not job.commit:
            return
        result = self.drainer.wait() if wait else self.drainer.poll()
        if result is None:
            return
        if result.error is not None:
            self.failed[result.step] = result.error
            warnings.warn(f"shardpoint: step {result.step} was not made durable under {self.root}: {result.error}. "
                          "Its memory snapshot is kept until newer ones replace it", stacklevel=4)
            return
        _LOG.info("step %d drained from memory to %s/%s", result.step, self.root, self.folder(result.step))
        self.area.free(self.tier.keep, set())  # the drained snapshot, when newer ones came meanwhile
        try:
            self.on_drained(result.step)
        except Exception as e:  # noqa: BLE001 - the checkpoint is committed; retention tries again next time
            warnings.warn(f"shardpoint: cleaning up old checkpoints after step {result.step} failed: {e}", stacklevel=4)

    def wait(self) -> None:
        """Wait for the replication and the drain in flight (and run retention after
        a commit). Collective when a drain spread over hosts is pending."""
        self._finish_snapshot(self._comm())
        self._join_replication()
        self._settle(self._comm(), wait=True)
        if self._comm().rank == 0:
            self._collect(wait=True)

    def close(self) -> None:
        self.wait()
        self.drainer.close()
        self.area.settle()

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
                       exclude: list[str] | str | None, strict: bool,
                       judge: Callable[[int, StepHolding], str] = unhealthy,
                       step: int | None = None, root_newest: int | None = None) -> TieredLoadReport | None:
        """Load the newest snapshot the present hosts hold in full between them (the
        files on no present host: from the root, when it holds the same save of that
        step) that ``judge`` finds fit (by default: healthy; see
        :func:`.hosts.restore_plan`), if it is at least as new as ``durable_step`` (the
        step the root would resume from), or exactly ``step`` when given: a host lacking
        the manifest or an index gets it from a host that has it, then every rank loads
        through its own host's folder, the load fetching the byte ranges of data files
        its host lacks from the nearest holder (:mod:`.peer`) and reading those of files
        no host holds from the root. Collective. A
        snapshot due for durability that the root lacks is drained again only when
        newer than ``root_newest`` (the root's newest step; ``durable_step`` when
        None). The report's ``passed_over`` names the snapshots passed over, and why
        (warned).
        None: nothing loaded, restore from the root; :attr:`passed` then says what was
        passed over in memory and :attr:`restorable` which steps the hosts hold in full."""
        comm = self._comm()
        comm.arrive("tiers-restore", self._name)
        hosts = self._open(comm, create=False)  # a restore that finds nothing leaves no folder behind
        leader = self._leader(comm)
        # each host's inventory to rank 0, which plans; its plan (or its error: a caller's accept= may raise) to all
        plan = RestoreDecision.from_wire(
            agree(comm, msgspec.to_builtins(self.area.inventory()) if leader else None, None,
                  lambda got: self._plan(hosts, got, durable_step, judge, step, root_newest).wire()))
        self.restorable = list(plan.restorable)
        self.passed = {}
        unfit = plan.passed
        ready = {c.step: c for c in plan.cands}
        for at in sorted({*unfit, *ready}, reverse=True):  # newest first; older ones are never reached
            if at in unfit:
                self._pass(at, unfit[at])
                continue
            cand = ready[at]
            storage = self.area.storage(cand.step)
            try:
                self._gather(comm, cand, storage, leader)
            except CollectiveMismatchError:
                raise
            except ShardpointError as e:
                self._pass(at, f"it cannot be gathered on every host ({e})")
                continue
            try:  # every host holds it once gathered; if it cannot be read here, the load says so on every rank
                sizes = {n: e.size for n, e in read_manifest(storage).files.items()}
            except (ShardpointError, OSError):
                sizes = {}
            durable = self._root_storage().child(self.folder(cand.step)) if cand.durable else None
            view = TieredView(storage, sizes, durable=durable, rooted=cand.durable)
            fetch = None
            # each host's ranks' byte ranges of the data files it lacks, from the nearest holder (or, for files
            # no present host holds, what they need of them from the root: no move, the view reads them there)
            if len(hosts) > 1 or cand.durable:
                fetch = PeerFetch(comm, hosts, view, cand.step,
                                  [inv.get(str(at), StepHolding()) for inv in self._invs] if comm.rank == 0 else None,
                                  make_folder=self.area.open)
            try:
                report = load_state(comm, view, state, LoadOptions(strict=strict, only=only, exclude=exclude),
                                    fetch=fetch)
            except CorruptCheckpointError as e:
                self._pass(at, f"it cannot be loaded ({e})")
                continue
            except CollectiveMismatchError:
                raise
            except ShardpointError as e:
                if fetch is None or not fetch.failed:
                    raise
                self._pass(at, f"its byte ranges cannot be fetched ({e})")
                continue
            report.step = cand.step
            report.passed_over = dict(self.passed)
            pieces = {n: "durable" if n in view.from_root else self.area.origin(cand.step, n)
                      for n in sorted(view.names) if n != MANIFEST_NAME}
            if view.from_root:
                _LOG.info("memory snapshot %d: rank %d read %d bytes of %d file(s) no present host holds from %s",
                          cand.step, comm.rank, sum(view.from_root.values()), len(view.from_root), durable.url
                          if durable is not None else self.root)
            self._after_memory_restore(comm, cand.step, cand.redrain)
            received = sum(m.size for m in cand.fetch if m.dst == comm.rank and m.src != m.dst)
            return TieredLoadReport.of(report, "memory", storage.inner.root, pieces,
                                       received=received + (fetch.received if fetch is not None else 0),
                                       host_needed=fetch.needed if fetch is not None else 0,
                                       durable_read=sum(view.from_root.values()),
                                       host_durable_needed=fetch.durable if fetch is not None else 0)
        return None

    def _plan(self, hosts: Hosts, got: list[Any], durable_step: int | None,
              judge: Callable[[int, StepHolding], str], step: int | None,
              root_newest: int | None) -> RestoreDecision:
        """Rank 0: from every host's inventory, the snapshots passed over (why), the
        steps held in full, and the candidates in order with their re-drains (for every
        rank)."""
        invs = [msgspec.convert(got[hosts.leader(h)], HostInventory) for h in range(len(hosts))]
        self._invs = invs  # the holdings of the step chosen: its byte ranges are planned from them
        cands, passed = restore_plan(hosts, invs, durable_step, judge, rooted=self._rooted)
        restorable = sorted(c.step for c in cands)
        if step is not None:  # an explicit step: exactly that one, whatever is newer
            cands, passed = [c for c in cands if c.step == step], {s: w for s, w in passed.items() if s == step}
        due = sorted({int(s) for inv in invs for s in inv if self.tier.due(int(s))[1]})
        redrained = [msgspec.structs.replace(c, redrain=redrain_parts(
            hosts, invs, c, due, durable_step if root_newest is None else root_newest)) for c in cands]
        return RestoreDecision(passed, restorable, redrained)

    def _root_storage(self) -> Storage:
        return storage_for(self.root, self.storage_options)

    def _rooted(self, step: int, save_id: str) -> bool:
        """Rank 0: whether the durable root holds ``step`` committed by save ``save_id``
        (a drained snapshot: the same bytes as its memory copy), so that the files of
        it no present host holds can be read from there."""
        try:
            return committed(self._root_storage().child(self.folder(step)), save_id)
        except (ShardpointError, OSError):
            return False

    def _pass(self, step: int, why: str) -> None:
        """A snapshot the ladder does not restore: noted in :attr:`passed`, and warned."""
        self.passed[step] = why
        warnings.warn(f"shardpoint: not restoring memory snapshot {step}: {why}; trying an older one", stacklevel=4)

    def _gather(self, comm: Comm, cand: Candidate, storage: PrivateStorage, leader: bool) -> None:
        """Give every present host the manifest and indexes of ``cand`` (collective): the
        fetches, then (once every rank's are in) each host's first rank links replicas
        and fetched files into the step folder, where the load reads them (and the byte
        ranges it fetches of the rest). Raises on every rank when a rank failed."""
        hosts = self.hosts
        assert hosts is not None
        error: BaseException | None = None
        try:
            if any(m.dst in hosts.ranks[hosts.of_rank[comm.rank]] for m in cand.fetch):
                self.area.open()  # this host receives files: its job folder (any rank may make it)
            problems = transfer(comm, storage.inner.root, cand.fetch, progress=comm.timeout) if cand.fetch else []
            if problems:
                error = MemoryTierError("; ".join(problems))
        except CollectiveMismatchError:
            raise
        except Exception as e:  # noqa: BLE001 - fanned out to every rank
            error = e
        agree(comm, None, error)
        try:
            if leader:
                self.area.place(cand.step, needed(read_manifest(storage).files))
        except Exception as e:  # noqa: BLE001 - fanned out to every rank
            error = e
        agree(comm, None, error)

    def _after_memory_restore(self, comm: Comm, step: int, redrain: Redrain | None) -> None:
        """Snapshots newer than the restored one belong to an abandoned future and go
        (on every host); the newest snapshot due for durability that the root lacks
        (its drain was cut by the crash) is drained again, from wherever its pieces are."""
        if self._leader(comm):
            for s in self.area.steps():
                if s > step:
                    self.area.remove(s)
        if redrain is not None:
            self._drain_parts(comm, redrain.step, redrain.save_id, redrain.parts, whole=False)

    def after_durable_restore(self, step: int | None) -> None:
        """After a restore from the root (collective): every host drops the snapshots
        newer than ``step`` (all of them when nothing was restored)."""
        comm = self._comm()
        self._open(comm, create=False)
        if self._leader(comm):
            for s in self.area.steps():
                if step is None or s > step:
                    self.area.remove(s)
