"""CheckpointManager: step folders, discovery, retention, preemption."""

from __future__ import annotations

import re
import signal
import threading
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any

import torch

from . import _save
from .api import DEFAULT_TIMEOUT, PathLike, load, save
from .errors import ShardpointError
from .format.manifest import MANIFEST_NAME, read_manifest
from .report import LoadReport
from .storage import Storage, storage_for

_STEP = re.compile(r"^step-(\d+)$")
LATEST = "latest"


@dataclass(frozen=True, slots=True)
class CheckpointInfo:
    """A committed checkpoint under a manager's root."""

    step: int
    path: str
    time: datetime
    size: int
    world_size: int


class CheckpointManager:
    """Saves numbered checkpoints under ``root`` and finds them again.

    ``save(state, step)`` writes ``root/step-<step, 8 digits>/`` (collective, with
    the core's commit rule) and then points ``root/latest`` at it. Only committed
    checkpoints (with a manifest) are ever listed, restored or kept.

    Args:
        root: a directory or URL.
        keep_last: keep the newest N committed checkpoints (None: keep all).
        keep_every: also keep every checkpoint whose step is a multiple of K.
        process_group, timeout, storage_options: as for :func:`shardpoint.save`.
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
        try:
            man = read_manifest(sub)
        except ShardpointError:
            return None
        return CheckpointInfo(
            step=int(m.group(1)), path=sub.url, time=datetime.fromtimestamp(man.created, tz=timezone.utc),
            size=sum(f["size"] for f in man.files.values()), world_size=man.world_size,
        )

    def list(self) -> list[CheckpointInfo]:
        """Committed checkpoints, oldest step first."""
        out = [i for i in (self._info(n) for n in self.storage.list_dirs()) if i is not None]
        return sorted(out, key=lambda i: i.step)

    def latest(self) -> CheckpointInfo | None:
        """The checkpoint to resume from: the one ``latest`` names if it is committed
        (so a rolled-back run that saved step 200 beside an old step 500 resumes from
        200), else the highest committed step, else None."""
        try:
            if self.storage.exists(LATEST):
                name = bytes(self.storage.read(LATEST)).decode().strip()
                info = self._info(name) if _STEP.match(name) else None
                if info is not None:
                    return info
        except (ShardpointError, OSError, UnicodeDecodeError):
            pass
        found = self.list()
        return found[-1] if found else None

    def has_checkpoint(self) -> bool:
        """Whether ``root`` holds at least one committed checkpoint."""
        return self.latest() is not None

    # -- save -----------------------------------------------------------------------
    def save(self, state: Any, step: int, *, blocking: bool = True) -> Any:
        """Save ``state`` as step ``step``. Collective. After the commit, ``latest``
        points at it and retention runs (rank 0), deleting only committed checkpoints
        the policy does not keep (never the new one nor the one restored from) and
        leftovers of saves that never committed.

        With ``blocking=False`` returns a handle (see :func:`shardpoint.save`); call
        :meth:`wait` before the process group is torn down."""
        self.wait()
        name = self.step_dir(step)
        target = self.storage.child(name)

        def after_commit() -> Any:
            self.storage.write_atomic(LATEST, name.encode())
            return lambda: self._retain(newest=step)  # after every rank returned from the commit

        token = _save.after_commit_hook.set(after_commit)
        try:
            handle = save(state, target, process_group=self.process_group, timeout=self.timeout,
                          overwrite=True, blocking=blocking)
        finally:
            _save.after_commit_hook.reset(token)
        if not blocking:
            handle.step = step
            self._pending = handle
        return handle

    def wait(self) -> None:
        """Wait for an asynchronous save to commit (re-raising its error)."""
        h, self._pending = self._pending, None
        if h is not None:
            h.wait()

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
        for name in self.storage.list_dirs():
            m = _STEP.match(name)
            if not m or int(m.group(1)) == newest:
                continue
            if int(m.group(1)) in keep and name in committed_names:
                continue
            sub = self.storage.child(name)
            sub.remove(MANIFEST_NAME)  # uncommit first: a half-deleted folder is never taken for a checkpoint
            sub.remove_all()

    # -- restore --------------------------------------------------------------------
    def restore(
        self,
        state: Any,
        step: int | None = None,
        *,
        only: list[str] | str | None = None,
        exclude: list[str] | str | None = None,
        strict: bool = True,
    ) -> LoadReport | None:
        """Load the latest committed checkpoint (or ``step``) into ``state`` in place.
        Collective. Returns None, touching nothing, when there is no checkpoint (and
        raises :class:`CheckpointNotFoundError` when an explicit ``step`` is absent).
        The report's ``step`` says which step was loaded."""
        if step is None:
            info = self.latest()
            if info is None:
                return None
        else:
            info = self._info(self.step_dir(step))
            if info is None:
                from .errors import CheckpointNotFoundError

                raise CheckpointNotFoundError(
                    f"no committed checkpoint for step {step} under {self.root}; committed steps: {[i.step for i in self.list()]}"
                )
        report = load(state, self.storage.child(self.step_dir(info.step)), only=only, exclude=exclude, strict=strict,
                      process_group=self.process_group, timeout=self.timeout)
        report.step = info.step
        self._restored = info.step
        return report

    # -- preemption -----------------------------------------------------------------
    def handle_signals(self, signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGUSR1)) -> None:
        """Opt in to preemption: after this, SIGTERM (and SLURM's SIGUSR1) only set a
        flag; :meth:`save_if_preempted` then saves on every rank at the same step."""
        for s in signals:
            self._old_handlers[s] = signal.signal(s, lambda *_: self._preempt.set())

    def save_if_preempted(self, state: Any, step: int) -> bool:
        """Collective; call it once per step on every rank. If any rank was told to
        stop, every rank saves ``step`` and this returns True (then exit); otherwise
        returns False. One small all-reduce on the checkpoint group per call."""
        from .collective import Comm

        comm = Comm(self.process_group, self.timeout)
        flag = torch.tensor([1 if self._preempt.is_set() else 0], dtype=torch.uint8)
        if comm.world > 1:
            comm.group()  # every rank calls this at the same step, so the group can be made here
        if not int(comm.any_true(flag)[0]):
            return False
        self.save(state, step)
        return True

    def __repr__(self) -> str:
        return f"CheckpointManager({self.root!r}, keep_last={self.keep_last}, keep_every={self.keep_every})"
