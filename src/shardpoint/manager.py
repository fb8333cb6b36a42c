"""CheckpointManager: step folders, discovery, retention, preemption."""

from __future__ import annotations

import json
import re
import signal
import threading
import warnings
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any

from . import _save
from ._incremental import Tracker
from .api import DEFAULT_TIMEOUT, PathLike, load, save
from .errors import CheckpointNotFoundError, CorruptCheckpointError
from .format.digest import is_sealed, seal, unseal
from .format.manifest import MANIFEST_NAME
from .format.refs import split_ref
from .load.locate import read_manifest
from .report import LoadReport
from .storage import Storage, storage_for

_STEP = re.compile(r"^step-(\d+)$")
LATEST = "latest"
#: The only unsealed ``latest`` read (as written before seals): one step folder name, an optional newline.
#: A sealed pointer starts with '{"seal":' and is ~100 bytes, so no single flipped bit turns it into this.
_LEGACY_LATEST = re.compile(rb"step-\d{1,20}\n?")
_EPOCH = datetime.fromtimestamp(0, tz=timezone.utc)


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
        incremental: store chunks whose bytes equal what this manager's previous save
            (in this process) wrote by reference to that save's data file instead of
            writing them again: a frozen base is written once. Each checkpoint still
            loads, verifies and reshards on its own, but its folder is no longer
            self-contained: retention keeps referenced data, and :func:`shardpoint.export`
            makes a self-contained copy. Off by default, so that copying or deleting
            one step folder by hand keeps working.
        process_group, timeout, storage_options: as for :func:`shardpoint.save`.

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
        process_group: Any = None,
        timeout: timedelta | float = DEFAULT_TIMEOUT,
        storage_options: dict[str, Any] | None = None,
        incremental: bool = False,
    ) -> None:
        if keep_last is not None and keep_last < 1:
            raise ValueError(f"keep_last must be at least 1 (got {keep_last}); use None to keep everything")
        if keep_every is not None and keep_every < 1:
            raise ValueError(f"keep_every must be a positive step interval (got {keep_every})")
        self.storage: Storage = storage_for(root, storage_options)
        self.root = self.storage.url
        self.keep_last, self.keep_every = keep_last, keep_every
        self.process_group, self.timeout = process_group, timeout
        self._storage_options = storage_options
        self._restored: int | None = None
        self._pending: Any = None
        self._preempt = threading.Event()
        self._old_handlers: dict[int, Any] = {}
        self.incremental = incremental
        self._tracker = Tracker() if incremental else None
        self._session: Any = None

    # -- discovery ------------------------------------------------------------------
    @staticmethod
    def step_dir(step: int) -> str:
        """Folder name of a step: ``step-00000100``."""
        if step < 0:
            raise ValueError(f"step must be non-negative, got {step}")
        return f"step-{step:08d}"

    def _info(self, name: str) -> CheckpointInfo | None:
        m = _STEP.match(name)
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
        if not is_sealed(data):
            if _LEGACY_LATEST.fullmatch(data):  # written by a shardpoint without seals
                return data.decode().strip()
            raise CorruptCheckpointError(f"{where}: not a checkpoint pointer (no valid seal): the file is damaged. {fix}")
        try:
            name = json.loads(unseal(data, where, fix=fix))["latest"]
        except (ValueError, KeyError, TypeError):
            name = None
        if not isinstance(name, str) or not _STEP.match(name):
            raise CorruptCheckpointError(f"{where}: its seal matches but it names no step folder. {fix}")
        return name

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

    # -- save -----------------------------------------------------------------------
    def save(self, state: Any, step: int, *, blocking: bool = True, overlap: bool = False) -> Any:
        """Save ``state`` as step ``step``. Collective. After the commit, ``latest``
        points at it and retention runs (rank 0), deleting only committed checkpoints
        the policy does not keep (never the new one nor the one restored from) and
        leftovers of saves that never committed.

        With ``blocking=False`` returns a handle (see :func:`shardpoint.save`, and its
        ``overlap``); call :meth:`wait` before the process group is torn down."""
        self.wait()
        name = self.step_dir(step)
        target = self.storage.child(name)

        def after_commit() -> Any:
            self.storage.write_atomic(LATEST, seal(json.dumps({"latest": name}, separators=(",", ":")).encode()))
            return lambda: self._retain(newest=step)  # after every rank returned from the commit

        token = _save.after_commit_hook.set(after_commit)
        session = self._tracker.begin(name) if self._tracker is not None else None
        itoken = _save.incremental_hook.set(session)
        try:
            handle = save(state, target, process_group=self.process_group, timeout=self.timeout,
                          overwrite=True, blocking=blocking, overlap=overlap)
        except BaseException:
            if self._tracker is not None:
                self._tracker.reset()
            raise
        finally:
            _save.after_commit_hook.reset(token)
            _save.incremental_hook.reset(itoken)
        if not blocking:
            handle.step = step
            self._pending, self._session = handle, session
        elif session is not None:
            self._tracker.commit(session)  # type: ignore[union-attr]
        return handle

    def wait(self) -> None:
        """Wait for an asynchronous save to commit (re-raising its error)."""
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

    def _retain(self, newest: int) -> None:
        committed = self.list()
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
        committed_names = {self.step_dir(i.step) for i in committed}
        doomed = [name for name in self.storage.list_dirs() if (m := _STEP.match(name)) and int(m.group(1)) != newest
                  and not (int(m.group(1)) in keep and name in committed_names)]
        if not doomed:
            return
        kept = [self.step_dir(i.step) for i in committed if i.step in keep] + [self.step_dir(newest)]
        needed = referenced_files(self.storage, kept)
        if needed is None:
            warnings.warn(f"shardpoint: retention under {self.root} skipped: a kept checkpoint's manifest cannot be "
                          "read, so which data it refers to is unknown", stacklevel=2)
            return
        for name in doomed:
            drop(self.storage.child(name), needed.get(name))

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
        state: Any,
        step: int | None = None,
        *,
        only: list[str] | str | None = None,
        exclude: list[str] | str | None = None,
        strict: bool = True,
        fallback: bool = False,
    ) -> LoadReport | None:
        """Load the latest committed checkpoint (or ``step``) into ``state`` in place.
        Collective. Returns None, touching nothing, when there is no checkpoint (and
        raises :class:`CheckpointNotFoundError` when an explicit ``step`` is absent).
        The report's ``step`` says which step was loaded. Waits for an asynchronous
        save in flight first, so that it is found (its error stays for :meth:`wait`).

        Args:
            fallback: when ``latest`` or the manifest of the checkpoint to resume from
                is damaged, load the newest sound checkpoint before it (any sound one
                when ``latest`` itself is damaged) with a warning, instead of raising.

        Raises:
            CorruptCheckpointError: (without ``fallback``) ``latest`` or the manifest of
                the checkpoint to resume from (or of ``step``) is damaged; the message
                names the file. Also everything :func:`shardpoint.load` raises.
        """
        from .asyncsave import settle_in_flight

        settle_in_flight()
        if step is None:
            try:
                info = self._resume_point()
            except CorruptCheckpointError as e:
                if not fallback:
                    raise
                info = self._fallback(e)
            if info is None:
                return None
        else:
            info = self._info(self.step_dir(step))
            if info is None:

                raise CheckpointNotFoundError(
                    f"no committed checkpoint for step {step} under {self.root}; committed steps: {[i.step for i in self.list()]}"
                )
            if info.damaged:
                raise CorruptCheckpointError(f"step {step} is damaged: {info.damaged}")
        report = load(state, self.storage.child(self.step_dir(info.step)), only=only, exclude=exclude, strict=strict,
                      process_group=self.process_group, timeout=self.timeout)
        report.step = info.step
        self._restored = info.step
        return report

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

    def save_if_preempted(self, state: Any, step: int) -> bool:
        """Collective; call it once per step on every rank. If any rank was told to
        stop, every rank saves ``step`` and this returns True (then exit); otherwise
        returns False. One small all-reduce per call, on a lane of its own: it does
        not wait for an asynchronous save in flight (the save it starts does)."""
        from .collective import Comm

        # the channel's control lane: never waits for a save in flight
        if not Comm(self.process_group, self.timeout).flag_any(self._preempt.is_set()):
            return False
        self.save(state, step)
        return True

    def __repr__(self) -> str:
        return (f"CheckpointManager({self.root!r}, keep_last={self.keep_last}, keep_every={self.keep_every}, "
                f"incremental={self.incremental})")
