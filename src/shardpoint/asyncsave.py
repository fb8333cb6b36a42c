"""Asynchronous save: stage, return, write and commit in the background.

The call blocks for the arrival check, the walk of the state, the plan (one round
trip to rank 0) and one copy of what this rank writes into a staging buffer that
is reused across saves (pinned host memory when the tensors live on a GPU);
replica rows another rank writes are only checksummed, in place. With
``overlap=True`` it does not wait for the copy either: the copy runs in the
background while the caller's next forward and backward run, each optimizer in
the state waits for it before its next step, and a tensor changed during the copy
fails the save (docs/async.md). Checksums, the replica check, the writes and the
commit run in a background thread whose collectives use shardpoint's own gloo
group, never the training group. One save is in flight
at a time; the next save (or :meth:`SaveHandle.wait`) waits for it and re-raises
its error. The background thread holds the checkpoint channel's data lane (see
:mod:`shardpoint.collective`): a load or a save waits for it, the per-step
preemption check does not.

At interpreter exit (before Python joins threads and runs ``atexit``), a save
still in flight gets up to :data:`EXIT_GRACE` seconds to commit; after that its
collectives are closed, it is abandoned without a manifest (so nothing torn is
ever committed) and a loud warning names it. Its thread always ends before the
interpreter finalises, which a daemon thread woken inside torch's C++ code would
otherwise turn into an abort (SIGABRT) of a clean exit.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from typing import Any

import torch

from . import _stage
from ._save import _Local, describe, finish_save, only_checked, plan_save, to_write
from .collective import Comm, close_channels
from .storage import Storage

#: Seconds a save still in flight at interpreter exit gets to commit before it is
#: abandoned (``SHARDPOINT_EXIT_GRACE``).
EXIT_GRACE = float(os.environ.get("SHARDPOINT_EXIT_GRACE", 30.0))


class SaveHandle:
    """What ``save(..., blocking=False)`` returns."""

    def __init__(self, path: str) -> None:
        self.path = path
        #: The training step, when :class:`CheckpointManager` started the save.
        self.step: int | None = None
        self._done = threading.Event()
        self._staged = threading.Event()
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._hooks: list[Any] = []

    def done(self) -> bool:
        """Whether the save has finished (committed or failed)."""
        return self._done.is_set()

    def staged(self) -> bool:
        """Whether the state's copy is taken: from then on the saved tensors may
        change (always True once ``save`` returns, unless ``overlap=True``)."""
        return self._staged.is_set()

    def wait_staged(self, timeout: float | None = None) -> None:
        """Block until the copy of the state is taken (``overlap=True``): after it,
        changing the saved tensors no longer affects the save. Its errors surface on
        :meth:`wait`."""
        if not self._staged.wait(timeout):
            raise TimeoutError(f"the overlapped save to {self.path} is still copying after {timeout}s")
        self._release_hooks()

    def _release_hooks(self) -> None:
        """Remove the optimizer step pre-hooks (on the caller's thread: never while a
        step iterates them)."""
        hooks, self._hooks = self._hooks, []
        for h in hooks:
            h.remove()

    def wait(self, timeout: float | None = None) -> None:
        """Block until the save is committed; re-raise its error if it failed."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"the asynchronous save to {self.path} is still running after {timeout}s")
        self._release_hooks()
        self._join()
        global _in_flight
        if _in_flight is self:
            _in_flight = None
        if self._error is not None:
            err, self._error = self._error, None
            raise err

    def _join(self, timeout: float | None = None) -> None:
        """Wait for the thread itself, not only its result: a thread still
        unwinding when the process exits can abort the interpreter."""
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(timeout)

    def __repr__(self) -> str:
        return f"SaveHandle({self.path!r}, done={self.done()})"


_staging = _stage.Staging()
_in_flight: SaveHandle | None = None


def wait_in_flight() -> None:
    """Wait for the save in flight, if any (re-raising its error)."""
    h = _in_flight
    if h is not None:
        h.wait()


def settle_in_flight() -> None:
    """Wait for the save in flight, if any, to end; its error stays with its
    handle for :meth:`SaveHandle.wait` or the next save to raise."""
    h = _in_flight
    if h is not None:
        h._done.wait()
        h._join()


def staging_nbytes() -> int:
    """Bytes held by the staging buffer (for tests and benchmarks)."""
    return _staging.nbytes


def save_async(comm: Comm, storage: Storage, state: Any, overwrite: bool, after_commit: Any,
               overlap: bool = False) -> SaveHandle:
    """Plan, stage what this rank writes (``overlap``: in the background, guarded),
    and continue the save in the background."""
    global _in_flight
    wait_in_flight()
    comm.arrive("save", storage.url)
    handle = SaveHandle(storage.url)
    local: _Local | None = None
    err: BaseException | None = None
    try:
        local = describe(state, comm.rank)
    except Exception as e:  # noqa: BLE001 - fanned out by the plan
        err = e
    try:
        planned = plan_save(comm, storage, local, err, overwrite)
    except Exception as e:  # noqa: BLE001 - surfaced on wait(), as every error of an asynchronous save
        handle._error = e
        handle._staged.set()
        handle._done.set()
        _in_flight = handle
        return handle
    assert local is not None
    stage = _Stage(local, planned.assign)
    checked = None
    if overlap:
        stage.guard()
        handle._hooks = _hook_optimizers(state, handle)
    else:
        try:
            checked = stage()
        except Exception as e:  # noqa: BLE001 - fanned out in the background
            err = e
        handle._staged.set()

    def run() -> None:
        try:
            if overlap:
                def staged() -> dict[int, list[int]]:
                    try:
                        return stage()
                    finally:
                        handle._staged.set()

                finish_save(comm, storage, planned, local, None, after_commit, stage=staged)
            else:
                finish_save(comm, storage, planned, local, err, after_commit, stage=lambda: checked)
        except BaseException as e:  # noqa: BLE001 - surfaced on wait()
            handle._error = e
        finally:
            handle._staged.set()
            handle._done.set()

    _in_flight = handle
    handle._thread = comm.start_background(run, "shardpoint-save")
    return handle


class _Stage:
    """Staging by need: copy the rows this rank writes (and its per-rank values)
    into the reused staging buffer, checksum the replica rows another rank writes
    where they are, and put the copies in place of the live views."""

    def __init__(self, local: _Local, assign: dict[str, Any]) -> None:
        self.local, self.assign = local, assign
        self.mine, names, self.views = to_write(local, assign)
        self.others = only_checked(local, assign)
        rows = local.meta["chunks"]
        # a per-rank chunk's name is "/per_rank/<key>@<offsets>": the key is what a message names
        self.keys = [rows["key"][i] for i in self.mine]
        self.keys += [n.removeprefix("/per_rank/").rsplit("@", 1)[0] for n in names[len(self.mine) :]]
        self.keys += [rows["key"][i] for i in self.others]
        # what the guard watches: the rows copied and the replica rows checksummed in place
        self.watched = self.views + [local.views[i] for i in self.others]
        self.before: list[int | None] | None = None
        self.after: dict[Any, Any] = {}

    def guard(self) -> None:
        """Before returning to the caller (overlap): take the version counters and
        mark the caller's streams, so the background copy reads the state as of now
        and fails if it changed."""
        self.before = _stage.versions(self.watched)
        self.after = _stage.mark(self.watched)

    def __call__(self) -> dict[int, list[int]]:
        after = self.after or _stage.mark(self.views)
        dsts = _staging.allocate(self.views)
        _stage.copy_into(dsts, self.views, after)
        others = self.watched[len(self.views):]
        checked = dict(zip(self.others, _stage.block_crcs_of(others, _stage.pool())))
        if self.before is not None:
            _stage.check_versions(self.keys, self.watched, self.before)
        pos = {id(v): d for v, d in zip(self.views, dsts)}
        lv = self.local.views
        for i in self.mine:
            lv[i] = pos.get(id(lv[i]), lv[i])
        for k, vs in self.local.per_rank_views.items():
            self.local.per_rank_views[k] = [pos.get(id(v), v) for v in vs]
        return checked


def _optimizers(obj: Any, depth: int = 0, out: list[Any] | None = None) -> list[Any]:
    """The torch optimizers in a state: in its containers, and a TrainState's (or any
    owner's) ``optimizer``."""
    out = [] if out is None else out
    if depth > 6:
        return out
    if isinstance(obj, torch.optim.Optimizer):
        if not any(o is obj for o in out):
            out.append(obj)
        return out
    if isinstance(obj, dict):
        for v in obj.values():
            _optimizers(v, depth + 1, out)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _optimizers(v, depth + 1, out)
    else:
        opt = getattr(obj, "optimizer", None)
        if opt is not None:
            _optimizers(opt, depth + 1, out)
        extra = getattr(obj, "extra", None)
        if isinstance(extra, dict):
            _optimizers(extra, depth + 1, out)
    return out


def _hook_optimizers(state: Any, handle: SaveHandle) -> list[Any]:
    """A step pre-hook on each optimizer in ``state`` that waits until the overlapped
    copy is taken: the step is the first thing that changes what the save copies."""

    def wait_for_copy(*_: Any) -> None:
        handle._staged.wait()

    return [opt.register_step_pre_hook(wait_for_copy) for opt in _optimizers(state)]


def _at_exit() -> None:
    """Give the save in flight :data:`EXIT_GRACE` seconds, then close the
    channels so that its thread ends (with an error) while the interpreter is
    still whole; warn when it did not commit. Then destroy the channels' lanes
    here, not in the destructors that run while the process exits (one of them,
    now and then, aborted a clean exit with SIGABRT)."""
    h = _in_flight
    if h is None:
        close_channels(release=True)
        return
    abandoned = not h._done.wait(EXIT_GRACE)
    if abandoned:
        close_channels()  # a thread blocked in a collective returns with an error now
    if h._done.wait(2.0 if abandoned else 0.0):
        h._join(5.0)
    # destroying a lane joins its gloo threads: not while a stuck save's collective holds one
    close_channels(release=not (h._thread is not None and h._thread.is_alive()))
    if not h.done() or h._error is not None:  # a save that committed within the grace is no news
        what = f"step {h.step} ({h.path})" if h.step is not None else h.path
        how = "was still in flight at exit" if abandoned else f"failed ({type(h._error).__name__}: {h._error})"
        print(
            f"shardpoint WARNING: the asynchronous save of {what} {how} and was NOT committed "
            "(no manifest was written, so it does not count as a checkpoint). Call handle.wait() or "
            "CheckpointManager.wait() before exiting or destroying the process group.",
            file=sys.stderr,
            flush=True,
        )


def _forget_in_child() -> None:
    """A forked child (a DataLoader worker) runs threading's exit hooks too, but the
    save in flight and the channels (cleared by collective.py) are the parent's:
    destroying the inherited gloo groups there crashed the worker with SIGSEGV."""
    global _in_flight
    _in_flight = None


os.register_at_fork(after_in_child=_forget_in_child)

# threading's exit hooks run before Python joins non-daemon threads and before
# ``atexit``, while every thread and torch itself are still whole
_register = getattr(threading, "_register_atexit", None)
if _register is not None:
    _register(_at_exit)
else:  # pragma: no cover - every supported Python has it
    atexit.register(_at_exit)
