"""CheckpointManager: step folders, discovery, retention, preemption."""

from __future__ import annotations

import builtins
import functools
import logging
import math
import os
import signal
import threading
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from types import FrameType
from typing import TYPE_CHECKING, Any

from .api import DEFAULT_TIMEOUT, PathLike, load
from .collective import Comm, agree, seconds
from .errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    ShardpointError,
    UnhealthyCheckpointError,
    UsageError,
)
from .format.manifest import MANIFEST_NAME
from .format.pointer import LATEST, STEP_FOLDER, Pointer
from .format.refs import split_ref
from .health import HealthRule
from .load.locate import read_manifest
from .report import LoadReport, LoadStats, SaveStats, human
from .runtime import PROCESS
from .saving.fence import Owner, claim
from .saving.handle import SaveHandle
from .saving.incremental import Session, Tracker
from .saving.pipeline import save_state
from .saving.records import SaveOptions
from .storage import Storage, storage_for
from .tiers import MemoryTier, TieredLoadReport  # the memory tier (issue 23): hooks in the block at the end
from .tiers.hosts import StepHolding
from .tiers.tiered import Tiers

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

#: What ``signal.signal`` returns: the handler it replaced.
_Handler = Callable[[int, FrameType | None], object] | int | signal.Handlers | None

_EPOCH = datetime.fromtimestamp(0, tz=timezone.utc)
_LOG = logging.getLogger("shardpoint.manager")


@dataclass(frozen=True, slots=True)
class CheckpointInfo:
    """A committed checkpoint under a manager's root."""

    step: int
    path: str
    time: datetime
    size: int
    world_size: int
    damaged: str | None = None
    """None for a sound checkpoint; else why its manifest cannot be trusted (then
    ``time`` is the epoch and ``size`` and ``world_size`` are 0: unknown)."""
    referenced: int = 0
    """Bytes it stores by reference in earlier checkpoints' data files (incremental
    saves); ``size`` counts only its own files."""
    nonfinite: tuple[str, ...] | None = None
    """The keys whose tensors held a NaN or an infinity when saved; None when the
    checkpoint was saved before shardpoint recorded health."""
    metrics: Mapping[str, float] = field(default_factory=dict)
    """The numbers given to :meth:`CheckpointManager.save` for this step."""
    unfit: tuple[str, ...] = ()
    """The keys of ``nonfinite`` that make it unfit to resume from under the manager's
    :class:`~shardpoint.health.HealthRule` (by default a NaN in the model or optimizer
    state, an infinity in a parameter or optimizer state; an infinity in a buffer or
    an extra, such as ``best_val_loss = inf``, is only recorded)."""
    nan: tuple[str, ...] | None = None
    """Of ``nonfinite``, the keys that held a NaN (None: not recorded)."""
    roles: Mapping[str, str] = field(default_factory=dict)
    """Each key of ``nonfinite``'s role (``param``, ``buffer``, ``optimizer``, ``extra``, ``state``)."""

    @property
    def healthy(self) -> bool:
        """Sound, and nothing it holds makes it unfit to resume from (``unfit`` is empty)."""
        return self.damaged is None and not self.unfit


def _unhealthy(info: CheckpointInfo, accept: Callable[[CheckpointInfo], bool] | None) -> str:
    """Why ``info`` is not fit to resume from ("" when it is): ``accept``'s verdict
    when given (it sees ``info.unfit``, the health rule's), else the health rule's."""
    if accept is not None:
        if accept(info):
            return ""
        why = f"metrics {dict(info.metrics)} that accept= rejected"
        return why + (f" (it also holds {_nonfinite(info.unfit)})" if info.unfit else "")
    return _nonfinite(info.unfit) if info.unfit else ""


def _nonfinite(keys: tuple[str, ...]) -> str:
    shown = ", ".join(repr(k) for k in keys[:5])
    more = f" and {len(keys) - 5} more" if len(keys) > 5 else ""
    return f"non-finite values (NaN or infinity) in {shown}{more}"


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _best_policy(given: object) -> tuple[str, int, str] | None:
    """``keep_best`` as ``(metric, n, "min" | "max")``, checked."""
    if given is None:
        return None
    given = tuple(given) if isinstance(given, list) else given
    ok = isinstance(given, tuple) and len(given) in (2, 3) and isinstance(given[0], str) and _is_int(given[1]) \
        and given[1] >= 1 and (len(given) == 2 or given[2] in ("min", "max"))
    if not ok:
        raise UsageError(f"keep_best={given!r}: give (metric, n) to keep the n lowest, or (metric, n, 'max') to keep "
                         "the n highest, e.g. keep_best=('loss', 3)")
    assert isinstance(given, tuple)
    return (given[0], given[1], given[2] if len(given) == 3 else "min")


def _best(infos: Sequence[CheckpointInfo], metric: str, n: int, mode: str) -> builtins.list[int]:
    """The steps of the ``n`` best of ``infos`` by ``metric`` (lowest with ``min``)."""
    scored = [(i.metrics[metric], i.step) for i in infos
              if i.damaged is None and metric in i.metrics and not math.isnan(i.metrics[metric])]
    scored.sort(key=lambda vs: vs[0] if mode == "min" else -vs[0])
    return [s for _, s in scored[:n]]


def referenced_files(root: Storage, folders: list[str]) -> dict[str, set[str]] | None:
    """Folder -> the data files in it that the committed checkpoints in ``folders``
    (under ``root``) refer to; None when one of their manifests cannot be read."""
    out: dict[str, set[str]] = {}
    for name in set(folders):
        try:
            man = read_manifest(root.child(name))
        except CheckpointNotFoundError:
            continue
        except (CorruptCheckpointError, OSError):
            return None
        for ref in man.refs:
            folder, fname = split_ref(ref)
            out.setdefault(folder, set()).add(fname)
    return out


def drop_all(root: Storage, names: list[str], needed: dict[str, set[str]]) -> None:
    """Delete the step folders ``names`` under ``root`` (:func:`drop`), every manifest
    first: a checkpoint among them may refer to another's files, so a kill between
    two folders must leave no manifest that refers to a file already deleted."""
    for name in names:
        root.child(name).remove(MANIFEST_NAME)
    for name in names:
        drop(root.child(name), needed.get(name))
        PROCESS.seams.fire_phase("dropped")


def drop(sub: Storage, still: set[str] | None) -> None:
    """Delete the step folder ``sub``, except the data files in ``still`` (which kept
    checkpoints refer to). The manifest goes first: a half-deleted folder is never
    taken for a checkpoint, and a kill at any moment leaves every referenced file."""
    sub.remove(MANIFEST_NAME)
    if not still:
        sub.remove_all()
        return
    for f in sub.list():
        if f not in still:
            sub.remove(f)


class CheckpointManager:
    """Saves numbered checkpoints under ``root`` and finds them again.

    ``save(state, step)`` writes ``root/step-<step, 8 digits>/`` (collective, with
    the core's commit rule) and then points ``root/latest`` at it (a sealed
    pointer: a flipped bit in it is an error, never another step). Only committed
    checkpoints (with a manifest) are ever listed, restored or kept. A damaged
    ``latest`` or a damaged manifest of the checkpoint to resume from makes
    :meth:`latest` and :meth:`restore` raise :class:`CorruptCheckpointError`;
    ``restore(state, fallback=True)`` resumes from the previous sound one instead.

    Args:
        root: a directory or URL.
        keep_last: keep the newest N committed checkpoints (None: keep all).
        keep_every: also keep every checkpoint whose step is a multiple of K.
        keep_best: also keep the N best checkpoints by a metric given to :meth:`save`:
            ``("loss", 3)`` keeps the three lowest losses, ``("accuracy", 3, "max")`` the
            three highest; a step without the metric (or with a NaN) is never among them.
        incremental: store chunks whose bytes equal what this manager's previous save
            (in this process) wrote by reference to that save's data file instead of
            writing them again: a frozen base is written once. Each checkpoint still
            loads, verifies and reshards on its own, but its folder is no longer
            self-contained: retention keeps referenced data, and :func:`shardpoint.export`
            makes a self-contained copy. Off by default, so that copying or deleting
            one step folder by hand keeps working.
        process_group, timeout, storage_options: as for :func:`shardpoint.save`.
        memory: a :class:`~shardpoint.tiers.MemoryTier`: snapshots in shared memory,
            drained to ``root`` (docs/tiers.md).
        health: which NaNs and infinities make a step unfit to resume from
            (:class:`~shardpoint.health.HealthRule`; by default a NaN in the model or
            optimizer state and an infinity in a parameter or optimizer state).
        save_every: the step interval :meth:`should_save` answers by.
        on_event: called on every rank with the figures of each save and restore
            (:class:`~shardpoint.report.SaveStats`, :class:`~shardpoint.report.LoadStats`:
            bytes, seconds per stage, the caller's stall), to send to TensorBoard or
            W&B; the same figures go to the ``shardpoint`` logger (INFO on rank 0).

    One writer: the attempt of the job that restores from ``root`` (or first saves
    into it) owns it; an older attempt that wakes up later (frozen, presumed dead,
    replaced by a restart) gets :class:`~shardpoint.errors.FencedError` from its next
    save and can neither commit, move ``latest`` nor delete anything. Use one manager
    per root per job (a second manager's restore supersedes the first).

    Retention with references: a step the policy drops is uncommitted (its manifest
    removed first) and its files deleted, except the data files that a kept
    checkpoint still refers to; those stay in the folder, which is no longer listed,
    until no kept checkpoint refers to them.
    """

    def __init__(
        self,
        root: PathLike,
        *,
        keep_last: int | None = None,
        keep_every: int | None = None,
        keep_best: tuple[str, int] | tuple[str, int, str] | None = None,
        process_group: ProcessGroup | None = None,
        timeout: timedelta | float = DEFAULT_TIMEOUT,
        storage_options: dict[str, Any] | None = None,
        incremental: bool = False,
        memory: MemoryTier | None = None,
        health: HealthRule | None = None,
        save_every: int | None = None,
        on_event: Callable[[SaveStats | LoadStats], None] | None = None,
    ) -> None:
        if keep_last is not None and (not _is_int(keep_last) or keep_last < 1):
            raise UsageError(f"keep_last must be a whole number >= 1 (got {keep_last!r}); use None to keep everything")
        if keep_every is not None and (not _is_int(keep_every) or keep_every < 1):
            raise UsageError(f"keep_every must be a positive whole step interval (got {keep_every!r})")
        if save_every is not None and (not _is_int(save_every) or save_every < 1):
            raise UsageError(f"save_every must be a positive whole step interval (got {save_every!r}); None saves "
                             "whenever should_save() is not asked")
        if not isinstance(root, (str, os.PathLike, Storage)):
            raise UsageError(f"root must be a directory path or a URL (got {type(root).__name__} {root!r})")
        seconds(timeout)  # a bad timeout is refused here, not at the first save
        if health is not None and not isinstance(health, HealthRule):
            raise UsageError(f"health={health!r}: give a shardpoint.health.HealthRule (or None for the default)")
        #: Which non-finite values make a step unfit to resume from.
        self.health = health if health is not None else HealthRule()
        self.storage: Storage = storage_for(root, storage_options)
        self.root = self.storage.url
        self.keep_last, self.keep_every, self.save_every = keep_last, keep_every, save_every
        self.keep_best = _best_policy(keep_best)
        #: Called on every rank with what each save (:class:`~shardpoint.report.SaveStats`) and
        #: restore (:class:`~shardpoint.report.LoadStats`) cost on that rank.
        self.on_event = on_event
        self.process_group, self.timeout = process_group, timeout
        self._storage_options = storage_options
        self._restored: int | None = None
        self._pending: SaveHandle | None = None
        self._preempt = threading.Event()
        self._old_handlers: dict[int, _Handler] = {}
        self.incremental = incremental
        self._tracker = Tracker() if incremental else None
        self._session: Session | None = None
        self._owner: Owner | None = None  # rank 0: this attempt's claim on the root (saving/fence.py)
        self._tiers = self._make_tiers(memory)  # memory tier: see the block at the end of the class

    # -- discovery ------------------------------------------------------------------
    @staticmethod
    def step_dir(step: int) -> str:
        """Folder name of a step: ``step-00000100``."""
        if not _is_int(step) or step < 0:
            raise UsageError(f"step must be a whole number >= 0 (got {step!r})")
        return f"step-{step:08d}"

    def _info(self, name: str) -> CheckpointInfo | None:
        m = STEP_FOLDER.match(name)
        if not m:
            return None
        sub = self.storage.child(name)
        if not sub.exists(MANIFEST_NAME):
            return None
        try:
            man = read_manifest(sub)
        except CheckpointNotFoundError:  # removed since the check above
            return None
        except (CorruptCheckpointError, OSError) as e:
            return CheckpointInfo(step=int(m.group(1)), path=sub.url, time=_EPOCH, size=0, world_size=0,
                                  damaged=str(e))
        return CheckpointInfo(
            step=int(m.group(1)), path=sub.url, time=datetime.fromtimestamp(man.created, tz=timezone.utc),
            size=man.own_bytes(), world_size=man.world_size, referenced=man.referenced_bytes(),
            nonfinite=None if man.nonfinite is None else tuple(man.nonfinite), metrics=dict(man.metrics),
            unfit=self.health.unfit(man.nonfinite, man.nan, man.roles),
            nan=None if man.nan is None else tuple(man.nan), roles=dict(man.roles),
        )

    def list(self) -> list[CheckpointInfo]:
        """Committed checkpoints (those with a manifest), oldest step first. One whose
        manifest is damaged is listed too, with ``damaged`` saying why."""
        out = [i for i in (self._info(n) for n in self.storage.list_dirs()) if i is not None]
        return sorted(out, key=lambda i: i.step)

    def _read_latest(self) -> str | None:
        """The step folder ``latest`` names, or None when there is no ``latest``.
        Raises CorruptCheckpointError when it is damaged."""
        if not self.storage.exists(LATEST):
            return None
        where = f"{self.root}/{LATEST}"
        fix = (f"Resume from the newest sound checkpoint with restore(state, fallback=True), or pick one with "
               f"restore(state, step=N) (N from list()); deleting {where} makes latest() the highest committed step.")
        try:
            data = bytes(self.storage.read(LATEST))
        except OSError as e:
            raise CorruptCheckpointError(f"{where}: cannot be read ({e}). {fix}") from e
        return Pointer.parse(data, where, fix).folder

    def _resume_point(self) -> CheckpointInfo | None:
        """What :meth:`latest` returns; raises CorruptCheckpointError naming the file."""
        try:
            name = self._read_latest()
        except CorruptCheckpointError:
            if not self.list():  # a damaged pointer to nothing: there is nothing to resume from
                return None
            raise
        info = self._info(name) if name is not None else None
        if info is None:  # no latest, or it names a folder with no manifest (deleted by hand)
            found = self.list()
            info = found[-1] if found else None
        if info is not None and info.damaged:
            raise CorruptCheckpointError(f"cannot resume: step {info.step} is damaged: {info.damaged}")
        return info

    def latest(self) -> CheckpointInfo | None:
        """The checkpoint to resume from: the one ``latest`` names if it is committed
        (so a rolled-back run that saved step 200 beside an old step 500 resumes from
        200), else the highest committed step, else None.

        Raises:
            CorruptCheckpointError: ``latest`` is damaged, or the checkpoint it names
                (or the highest one) has a damaged manifest. Nothing is guessed:
                ``restore(state, fallback=True)`` takes the previous sound one.
        """
        return self._resume_point()

    def has_checkpoint(self) -> bool:
        """Whether ``root`` holds at least one committed checkpoint (sound or damaged:
        :meth:`restore` then says which)."""
        return bool(self.list())

    def all_steps(self) -> builtins.list[int]:
        """The steps of the committed checkpoints, oldest first (damaged ones included)."""
        return [i.step for i in self.list()]

    def latest_step(self) -> int | None:
        """The step :meth:`latest` names, or None when there is no checkpoint."""
        info = self.latest()
        return info.step if info is not None else None

    def should_save(self, step: int) -> bool:
        """Whether ``step`` is due for a save: a multiple of ``save_every`` (every step
        when it is None), or any step once a preemption signal arrived
        (:meth:`handle_signals`; local to this rank, see :meth:`save_if_preempted`)."""
        if not _is_int(step) or step < 0:
            raise UsageError(f"step must be a whole number >= 0 (got {step!r})")
        return self._preempt.is_set() or self.save_every is None or step % self.save_every == 0

    def delete(self, step: int) -> None:
        """Delete checkpoint ``step``. Call it on every rank: each waits for its save in
        flight (see :meth:`wait`), then rank 0 deletes. The manifest goes first, so a
        half-deleted folder is never taken for a checkpoint; the data files that other
        kept checkpoints refer to (incremental saves) stay. Refused to an attempt that a
        newer one superseded (:class:`FencedError`) and for the step ``latest`` names."""
        name = self.step_dir(step)
        self.wait()
        if Comm(self.process_group, self.timeout).rank != 0:
            return
        if self._info(name) is None:
            raise CheckpointNotFoundError(f"no committed checkpoint for step {step} under {self.root}; committed "
                                          f"steps: {self.all_steps()}")
        self._owner_of().check(f"deleting step {step}")
        if self._read_latest() == name:
            raise UsageError(f"step {step} is the one {self.root}/{LATEST} names (the resume point); save a newer "
                             "step first")
        others = [self.step_dir(s) for s in self.all_steps() if s != step]
        needed = referenced_files(self.storage, others)
        if needed is None:
            raise CorruptCheckpointError(f"cannot delete step {step}: a manifest under {self.root} cannot be read, so "
                                         "which data other checkpoints refer to is unknown; `shardpoint verify` it")
        drop(self.storage.child(name), needed.get(name))

    def close(self) -> None:
        """Wait for the save in flight (and, with a memory tier, its replication and
        drain; then collective), and give back the signal handlers
        :meth:`handle_signals` replaced. Also ``with CheckpointManager(...) as mgr:``."""
        try:
            self.wait()
            if self._tiers is not None:
                self._tiers.close()
        finally:
            for s, h in self._old_handlers.items():
                signal.signal(s, h)
            self._old_handlers.clear()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- save -----------------------------------------------------------------------
    def save(self, state: object, step: int, *, blocking: bool = True, overlap: bool = False,
             metrics: Mapping[str, float] | None = None) -> SaveHandle | None:
        """Save ``state`` as step ``step``. Collective. After the commit, ``latest``
        points at it and retention runs (rank 0), deleting only committed checkpoints
        the policy does not keep (never the new one nor the one restored from) and
        leftovers of saves that never committed.

        The checkpoint records which of its tensors hold a NaN or an infinity (found
        while their bytes are checksummed) and ``metrics`` (rank 0's, e.g.
        ``{"loss": 2.31}``): :meth:`restore` passes over an unhealthy step, and
        ``shardpoint ls`` shows both. A save with non-finite values still commits.

        With ``blocking=False`` returns a handle (see :func:`shardpoint.save`, and its
        ``overlap``); call :meth:`wait` before the process group is torn down."""
        if self._tiers is not None and self._tiers_save(state, step, blocking, overlap, metrics):
            return None  # the memory tier took the step (snapshot; drain if due for durability)
        self.wait()
        name = self.step_dir(step)
        for k, v in (metrics or {}).items():
            if not isinstance(k, str) or isinstance(v, bool) or not isinstance(v, (int, float)):
                raise UsageError(f"metrics[{k!r}] = {v!r}: metrics are numbers by name (give float(value)); nothing "
                                 "was saved")
        target = self.storage.child(name)
        if overlap and blocking:
            raise UsageError("overlap=True needs blocking=False: a blocking save has already copied and written the state")
        session = self._tracker.begin(name) if self._tracker is not None else None
        options = SaveOptions(overwrite=True, owner=self._owner_of, latest=name, what=f"the save of step {step}",
                              after_commit=lambda: self._retain(newest=step), incremental=session, metrics=metrics,
                              step=step, on_stats=self._event)
        try:
            handle = save_state(Comm(self.process_group, self.timeout), target, state, options,
                                blocking=blocking, overlap=overlap)
        except BaseException:
            if self._tracker is not None:
                self._tracker.reset()
            raise
        if handle is not None:
            handle.step = step
            self._pending, self._session = handle, session
        elif session is not None and self._tracker is not None:
            self._tracker.commit(session)
        return handle

    def wait(self) -> None:
        """Wait for an asynchronous save to commit (re-raising its error). With a memory
        tier: wait for the snapshot's replication and the drain in flight too (then
        collective: call it on every rank, before the process group is torn down)."""
        h, self._pending = self._pending, None
        session, self._session = self._session, None
        if h is not None:
            try:
                h.wait()
            except BaseException:
                if self._tracker is not None:
                    self._tracker.reset()
                raise
            if session is not None and self._tracker is not None:
                self._tracker.commit(session)
        if self._tiers is not None:  # memory tier: the drain in flight
            self._tiers.wait()

    # -- ownership (saving/fence.py) ------------------------------------------------------
    def _owner_of(self) -> Owner:
        """Rank 0: this attempt's claim on the root, made on first use (a first save
        that did not restore). Every commit, ``latest`` update and retention pass is
        checked against it."""
        if self._owner is None:
            self._owner = claim(self.storage)
        return self._owner

    def _claim(self) -> None:
        """Rank 0, at a restore: claim the next generation of the root, so that an
        older attempt of the job that is only frozen can no longer commit, move
        ``latest`` or delete anything once it wakes. A claim that fails (a read-only
        root) is only warned about: the first save claims again, and fails there."""
        if Comm(self.process_group, self.timeout).rank != 0:
            return
        try:
            self._owner = claim(self.storage)
        except (OSError, ShardpointError) as e:
            self._owner = None
            warnings.warn(f"shardpoint: could not claim {self.root} for this attempt ({e}); the first save claims it "
                          "again", stacklevel=3)

    @property
    def generation(self) -> int | None:
        """This attempt's generation of the root (rank 0, once it restored or saved;
        None elsewhere and before): see docs/guarantees.md, "one writer"."""
        return self._owner.generation if self._owner is not None else None

    def _retain(self, newest: int) -> None:
        """Retention after step ``newest`` committed (rank 0). Refused to an attempt a
        newer one superseded. Counted and deleted: committed steps up to ``newest``
        that the policy does not keep; a committed step above ``newest`` is an older
        attempt's (frozen between its manifest and ``latest``) and is left alone.
        Deleted too: folders with no manifest (leftovers of saves that never committed:
        this attempt's, or an older attempt's in flight, which can no longer commit)."""
        self._owner_of().check(f"retention after the save of step {newest}")
        found = self.list()
        committed = [i for i in found if i.step <= newest]
        keep = {newest}
        if self._restored is not None:
            keep.add(self._restored)
        steps = [i.step for i in committed]
        if self.keep_last is None:
            keep.update(steps)
        else:
            keep.update(sorted(steps)[-self.keep_last :])
        if self.keep_every:
            keep.update(s for s in steps if s % self.keep_every == 0)
        if self.keep_best is not None:
            keep.update(_best(committed, *self.keep_best))
        committed_names = {self.step_dir(i.step) for i in committed}
        ahead = {self.step_dir(i.step) for i in found if i.step > newest}
        doomed = [name for name in self.storage.list_dirs() if (m := STEP_FOLDER.match(name)) and int(m.group(1)) != newest
                  and name not in ahead and not (int(m.group(1)) in keep and name in committed_names)]
        if not doomed:
            return
        kept = [self.step_dir(i.step) for i in committed if i.step in keep] + [self.step_dir(newest)] + sorted(ahead)
        needed = referenced_files(self.storage, kept)
        if needed is None:
            warnings.warn(f"shardpoint: retention under {self.root} skipped: a kept checkpoint's manifest cannot be "
                          "read, so which data it refers to is unknown", stacklevel=2)
            return
        drop_all(self.storage, doomed, needed)

    def export(self, dest: PathLike, step: int | None = None, *, overwrite: bool = False) -> str:
        """Write a self-contained copy of checkpoint ``step`` (default: :meth:`latest`)
        to ``dest``: the chunks it stores by reference are copied in (CRC-checked), so
        the copy loads, verifies and converts with nothing beside it. Not collective;
        returns ``dest``'s URL. The same as ``shardpoint export ROOT/step-N DEST``."""
        from ._export import export_checkpoint

        info = self.latest() if step is None else self._info(self.step_dir(step))
        if info is None or info.damaged:
            raise CheckpointNotFoundError(f"no sound committed checkpoint for step {step} under {self.root}")
        dst = storage_for(dest, self._storage_options)
        export_checkpoint(self.storage.child(self.step_dir(info.step)), dst, overwrite=overwrite)
        return dst.url

    # -- restore --------------------------------------------------------------------
    def restore(
        self,
        state: object,
        step: int | None = None,
        *,
        only: builtins.list[str] | str | None = None,  # builtins: in this class `list` is the method
        exclude: builtins.list[str] | str | None = None,
        strict: bool = True,
        fallback: bool = False,
        accept: Callable[[CheckpointInfo], bool] | None = None,
    ) -> LoadReport | None:
        """Load the latest healthy committed checkpoint (or ``step``) into ``state`` in
        place. Collective. Returns None, touching nothing, when there is no checkpoint
        (and raises :class:`CheckpointNotFoundError` when an explicit ``step`` is absent).
        The report's ``step`` says which step was loaded, and ``passed_over`` which
        newer steps were not, and why. Waits for an asynchronous save in flight first,
        so that it is found (its error stays for :meth:`wait`).

        A checkpoint whose saved tensors hold a NaN or an infinity (recorded when it
        was saved) is passed over with a warning naming the step and its keys, and the
        newest healthy one before it is restored; so is one that ``accept`` rejects.
        An explicit ``step`` is loaded as asked, healthy or not (with a warning). With
        a memory tier the same rules apply to its snapshots (docs/tiers.md).

        Args:
            fallback: when ``latest`` or the manifest of the checkpoint to resume from
                is damaged, load the newest sound checkpoint before it (any sound one
                when ``latest`` itself is damaged) with a warning, instead of raising.
            accept: a predicate over a candidate's :class:`CheckpointInfo` (its
                ``metrics``, say ``lambda i: i.metrics.get("loss", 0) < 10``): a step it
                rejects is passed over like an unhealthy one. It must decide the same on
                every rank (the metrics it sees are the same everywhere).

        Raises:
            CorruptCheckpointError: (without ``fallback``) ``latest`` or the manifest of
                the checkpoint to resume from (or of ``step``) is damaged; the message
                names the file. Also everything :func:`shardpoint.load` raises.
        """
        from .saving.handle import settle_in_flight

        settle_in_flight()
        if self._tiers is not None and self._tiers.bypass:  # the ladder's own durable restore (claimed, told there)
            return self._restore_durable(state, step, only=only, exclude=exclude, strict=strict, fallback=fallback,
                                         accept=accept)
        t0 = time.perf_counter()
        self._claim()
        if self._tiers is not None:  # memory tier: the restore ladder
            report: LoadReport | None = self._tiers_restore(state, step, only=only, exclude=exclude, strict=strict,
                                                            fallback=fallback, accept=accept)
        else:
            report = self._restore_durable(state, step, only=only, exclude=exclude, strict=strict, fallback=fallback,
                                           accept=accept)
        if report is not None:
            self._restored_event(report, time.perf_counter() - t0)
        return report

    def _restore_durable(self, state: object, step: int | None, *, only: builtins.list[str] | str | None,
                         exclude: builtins.list[str] | str | None, strict: bool, fallback: bool,
                         accept: Callable[[CheckpointInfo], bool] | None) -> LoadReport | None:
        """:meth:`restore` from the root (without a memory tier, or as its ladder's last
        rung). Rank 0 chooses the step and every rank loads that one: ranks that read
        ``latest`` a moment apart (an older attempt still committing) could choose two."""
        comm = Comm(self.process_group, self.timeout)
        comm.arrive("restore", self.root)
        chosen, passed = self._agreed(comm, lambda: self._choose(step, fallback, accept))
        if chosen is None:
            return None
        while True:
            try:
                report = load(state, self.storage.child(self.step_dir(chosen)), only=only, exclude=exclude,
                              strict=strict, process_group=self.process_group, timeout=self.timeout)
                break
            except CorruptCheckpointError as e:  # its data is missing or damaged (every rank raises alike)
                if not fallback or step is not None:
                    raise
                again, more = self._agreed(comm, functools.partial(self._before_damaged, chosen, e, accept))
                assert again is not None  # _before_damaged raises when there is none
                chosen = again
                passed.update(more)
        report.step = chosen
        report.passed_over = passed
        self._restored = chosen
        return report

    def _choose(self, step: int | None, fallback: bool,
                accept: Callable[[CheckpointInfo], bool] | None) -> tuple[int | None, dict[int, str]]:
        """Rank 0: the step a durable restore loads (None: nothing to restore), and the
        steps passed over with why (warned)."""
        if step is None:
            try:
                info = self._resume_point()
            except CorruptCheckpointError as e:
                if not fallback:
                    raise
                info = self._fallback(e)
            if info is None:
                return None, {}
            info, passed = self._healthy_from(info, accept)
            return info.step, passed
        info = self._info(self.step_dir(step))
        if info is None:
            raise CheckpointNotFoundError(
                f"no committed checkpoint for step {step} under {self.root}; committed steps: {self.all_steps()}")
        if info.damaged:
            raise CorruptCheckpointError(f"step {step} is damaged: {info.damaged}")
        why = _unhealthy(info, None)
        if why:
            warnings.warn(f"shardpoint: restoring step {step} as asked, although it holds {why}", stacklevel=2)
        return step, {}

    def _agreed(self, comm: Comm, decide: Callable[[], tuple[int | None, dict[int, str]]]
                ) -> tuple[int | None, dict[int, str]]:
        """Rank 0's ``decide()`` on every rank (collective), with the warnings it gave
        given on every rank too; its error is raised on every rank."""
        payload: object = None
        error: BaseException | None = None
        if comm.rank == 0:
            with warnings.catch_warnings(record=True) as said:
                warnings.simplefilter("always")
                try:
                    at, passed = decide()
                    payload = {"step": at, "passed": {str(k): v for k, v in passed.items()},
                               "warned": [str(w.message) for w in said]}
                except Exception as e:  # noqa: BLE001 - raised on every rank by agree
                    error = e
        got = agree(comm, payload, error, lambda everyone: everyone[0])
        for message in got["warned"]:
            warnings.warn(message, stacklevel=4)
        return got["step"], {int(k): v for k, v in got["passed"].items()}

    def _restored_event(self, report: LoadReport, wall: float) -> None:
        """After a restore: its stats (with the step and tier) on the report, one INFO
        line (rank 0), and the event hook."""
        tier = getattr(report, "tier", "durable")
        base = report.stats
        report.stats = LoadStats(path=base.path if base else self.root, step=report.step,
                                 rank=base.rank if base else 0, bytes_read=report.bytes_read, wall_s=wall,
                                 phases=dict(base.phases) if base else {}, tier=tier)
        if report.stats.rank == 0:
            passed = f"; passed over {sorted(report.passed_over, reverse=True)}" if report.passed_over else ""
            _LOG.info("restored step %s from %s (%s) in %.3fs: %s read by rank 0%s", report.step, report.stats.path,
                      tier, wall, human(report.bytes_read), passed)
        self._event(report.stats)

    def _event(self, stats: SaveStats | LoadStats) -> None:
        """Give ``stats`` to the ``on_event`` hook (a failing hook is warned about, never
        fails the save or restore)."""
        if self.on_event is None:
            return
        try:
            self.on_event(stats)
        except Exception as e:  # noqa: BLE001 - the user's hook; the checkpoint is fine
            warnings.warn(f"shardpoint: the on_event hook of the manager of {self.root} failed: "
                          f"{type(e).__name__}: {e}", stacklevel=3)

    def _healthy_from(self, newest: CheckpointInfo,
                      accept: Callable[[CheckpointInfo], bool] | None) -> tuple[CheckpointInfo, dict[int, str]]:
        """The newest healthy, accepted, sound checkpoint at or before ``newest``, and
        the steps passed over on the way with why (warned, newest first)."""
        passed: dict[int, str] = {}
        older = [i for i in self.list() if i.step < newest.step and i.damaged is None]
        for info in [newest, *reversed(older)]:
            why = _unhealthy(info, accept)
            if not why:
                break
            passed[info.step] = why
            warnings.warn(f"shardpoint: not restoring step {info.step} under {self.root}: it holds {why}; "
                          "trying the step before it (restore(state, step=N) loads a step as it is)", stacklevel=3)
        else:
            detail = "; ".join(f"step {s}: {w}" for s, w in passed.items())
            raise UnhealthyCheckpointError(
                f"no checkpoint under {self.root} is fit to resume from ({detail}). Load one as it is with "
                "restore(state, step=N), or start from scratch")
        return info, passed

    def _before_damaged(self, bad: int, error: CorruptCheckpointError,
                        accept: Callable[[CheckpointInfo], bool] | None) -> tuple[int, dict[int, str]]:
        """Rank 0, ``restore(fallback=True)`` after loading step ``bad`` failed on missing
        or damaged data: the newest fit step before it (warned about, naming both), and
        the steps passed over on the way. What the failed load had filled in is
        overwritten by this one for every key both hold."""
        older = [i for i in self.list() if i.step < bad and i.damaged is None]
        if not older:
            raise CorruptCheckpointError(f"{error}; no sound checkpoint before step {bad} to fall back to under "
                                         f"{self.root}") from error
        warnings.warn(f"shardpoint: step {bad} under {self.root} cannot be loaded ({error}); falling back to the "
                      "checkpoint before it", stacklevel=3)
        info, passed = self._healthy_from(older[-1], accept)
        return info.step, {bad: f"missing or damaged data: {error}", **passed}

    def _fallback(self, error: CorruptCheckpointError) -> CheckpointInfo:
        """The newest sound checkpoint older than the damaged one to resume from
        (the newest sound one when ``latest`` itself is damaged)."""
        try:
            name = self._read_latest()
        except CorruptCheckpointError:
            name = None
        found = self.list()
        target = self._info(name) if name is not None else None
        if target is None:
            target = found[-1] if found else None
        sound = [i for i in found if not i.damaged and (target is None or not target.damaged or i.step < target.step)]
        if not sound:
            raise CorruptCheckpointError(f"{error}; no sound checkpoint to fall back to under {self.root}") from error
        warnings.warn(f"{error}; falling back to step {sound[-1].step}", stacklevel=3)
        return sound[-1]

    # -- preemption -----------------------------------------------------------------
    def handle_signals(self, signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGUSR1)) -> None:
        """Opt in to preemption: after this, SIGTERM (and SLURM's SIGUSR1) only set a
        flag; :meth:`save_if_preempted` then saves on every rank at the same step."""
        for s in signals:
            self._old_handlers[s] = signal.signal(s, lambda *_: self._preempt.set())

    def save_if_preempted(self, state: object, step: int) -> bool:
        """Collective; call it once per step on every rank. If any rank was told to
        stop, every rank saves ``step`` and this returns True (then exit); otherwise
        returns False. One small all-reduce per call, on a lane of its own: it does
        not wait for an asynchronous save in flight (the save it starts does)."""
        # the channel's control lane: never waits for a save in flight
        if not Comm(self.process_group, self.timeout).flag_any(self._preempt.is_set()):
            return False
        self.save(state, step)
        return True

    # -- memory tier (shardpoint.tiers, issue 23) ----------------------------------------
    # A step due only for the memory tier is saved to node-local shared memory; a step due
    # for durability is drained from there to the root by a helper. restore() takes the
    # newest step restorable in full from either. docs/tiers.md.
    def _make_tiers(self, memory: MemoryTier | None) -> Tiers | None:
        if memory is None:
            return None
        if self.incremental:
            raise UsageError("CheckpointManager(memory=..., incremental=True): a memory tier with incremental saves is "
                             "not supported yet (a drained checkpoint would refer to files in shared memory); "
                             "leave one of them out")

        return Tiers(memory, root=self.root, storage_options=self._storage_options, process_group=self.process_group,
                     timeout=self.timeout, folder=self.step_dir, owner=self._owner_of,
                     on_drained=lambda s: self._retain(newest=s))

    @property
    def memory(self) -> MemoryTier | None:
        """The memory tier given to the constructor, if any."""
        return self._tiers.tier if self._tiers is not None else None

    def _tiers_save(self, state: Any, step: int, blocking: bool, overlap: bool,
                    metrics: Mapping[str, float] | None) -> bool:
        """True when the memory tier took ``step``; False: save it directly to the root."""
        assert self._tiers is not None
        if not blocking or overlap:
            raise UsageError(f"save(step={step}, blocking=False) with a memory tier: the snapshot is the fast path "
                             "(it returns once the state is copied; its write to shared memory runs in the background) and the "
                             "durable write runs in a helper; "
                             "call save(state, step)")
        return self._tiers.save(state, step, metrics=metrics, durable=self._preempt.is_set())

    def _tiers_restore(self, state: Any, step: int | None, **kw: Any) -> TieredLoadReport | None:
        """The restore ladder: the newest memory snapshot the present hosts hold in full
        between them that is fit to resume from (healthy, and accepted by ``accept``),
        if at least as new as the step the root would resume from; else the durable
        restore as without a memory tier. An explicit ``step`` is loaded from memory
        when the hosts hold it in full, else from the root."""
        assert self._tiers is not None
        self._tiers.wait()
        accept = kw["accept"]
        memory = {k: kw[k] for k in ("only", "exclude", "strict")}
        fit, newest = self._durable_choice(accept if step is None else None)  # an explicit step: accept is not asked
        if step is None:
            got = self._tiers.restore_memory(state, fit, **memory, root_newest=newest,
                                             judge=lambda s, e: _unhealthy(self._snapshot_info(s, e), accept))
        else:
            got = self._tiers.restore_memory(state, None, **memory, root_newest=newest, judge=lambda s, e: "",
                                             step=step)
            if got is not None:
                why = _unhealthy(self._snapshot_info(step, None), None)
                if why:
                    warnings.warn(f"shardpoint: restoring memory snapshot {step} as asked, although it holds {why}",
                                  stacklevel=3)
        if got is not None:
            self._restored = got.step
            return got
        passed = dict(self._tiers.passed)
        try:
            with self._tiers.bypassed():
                report = self.restore(state, step, **kw)
        except CheckpointNotFoundError as e:
            if step is None:
                raise
            raise CheckpointNotFoundError(f"{e}; memory snapshots the present hosts hold in full: "
                                          f"{self._tiers.restorable}") from None
        self._tiers.after_durable_restore(report.step if report is not None else None)
        if report is None:
            return None
        report.passed_over = {**passed, **report.passed_over}
        return TieredLoadReport.of(report, "durable", self.storage.child(self.step_dir(report.step or 0)).url)

    def _durable_choice(self, accept: Callable[[CheckpointInfo], bool] | None) -> tuple[int | None, int | None]:
        """The step a restore from the root would load (the newest fit one at or before
        the resume point; None when none is fit), found without warnings (the durable
        restore, when it runs, warns), and the resume point's step. A damaged resume
        point: the newest listed step for both (the durable restore then says what is
        damaged)."""
        try:
            newest = self._resume_point()
        except CorruptCheckpointError:
            last = max((i.step for i in self.list()), default=None)
            return last, last
        if newest is None:
            return None, None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                return self._healthy_from(newest, accept)[0].step, newest.step
            except ShardpointError:  # nothing on the root is fit
                return None, newest.step

    def _snapshot_info(self, step: int, entry: StepHolding | None) -> CheckpointInfo:
        """A memory snapshot as a :class:`CheckpointInfo` (for ``accept`` and health):
        from a host's inventory entry, or (None) from this host's copy of its manifest."""
        assert self._tiers is not None
        if entry is None:
            man = read_manifest(self._tiers.area.storage(step))
            entry = StepHolding(created=man.created, world_size=man.world_size, nonfinite=list(man.nonfinite or []),
                                nan=man.nan, roles=dict(man.roles), metrics=dict(man.metrics), need={})
        nonfinite, nan, roles = tuple(entry.nonfinite), entry.nan, dict(entry.roles)
        return CheckpointInfo(
            step=step, path=self._tiers.area.storage(step).url,
            time=datetime.fromtimestamp(entry.created, tz=timezone.utc),
            size=sum((entry.need or {}).values()), world_size=entry.world_size,
            nonfinite=nonfinite, metrics=dict(entry.metrics), unfit=self.health.unfit(nonfinite, nan, roles),
            nan=None if nan is None else tuple(nan), roles=roles)

    def __repr__(self) -> str:
        return (f"CheckpointManager({self.root!r}, keep_last={self.keep_last}, keep_every={self.keep_every}, "
                f"keep_best={self.keep_best}, "
                f"incremental={self.incremental})")
