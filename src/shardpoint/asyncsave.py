"""Asynchronous save: stage, return, write and commit in the background.

The call blocks only for the arrival check, the walk of the state and one copy
of the local tensors into a staging buffer that is reused across saves (pinned
host memory when the tensors live on a GPU). Planning, checksums, the replica
check, the writes and the commit run in a background thread whose collectives
use shardpoint's own gloo group, never the training group. One save is in flight
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

from ._save import _Local, describe, save_collective
from .collective import Comm, close_channels
from .storage import Storage

_ALIGN = 64

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
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None

    def done(self) -> bool:
        """Whether the save has finished (committed or failed)."""
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> None:
        """Block until the save is committed; re-raise its error if it failed."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"the asynchronous save to {self.path} is still running after {timeout}s")
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


class _Staging:
    """One reusable host buffer that holds a copy of the local tensors."""

    def __init__(self) -> None:
        self.buf: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        return 0 if self.buf is None else self.buf.numel()

    def stage(self, views: list[torch.Tensor]) -> list[torch.Tensor]:
        offs, total = [], 0
        for v in views:
            offs.append(total)
            total += -(-v.numel() * v.element_size() // _ALIGN) * _ALIGN
        on_gpu = any(v.device.type == "cuda" for v in views)
        if self.buf is None or self.buf.numel() < total:
            self.buf = None  # free the old one before allocating the new
            self.buf = torch.empty(max(total, 1), dtype=torch.uint8, pin_memory=on_gpu and torch.cuda.is_available())
        out = []
        for v, off in zip(views, offs):
            n = v.numel() * v.element_size()
            if n == 0:
                out.append(torch.empty(v.shape, dtype=v.dtype))
                continue
            dst = self.buf[off : off + n].view(v.dtype).view(v.shape)
            dst.copy_(v.detach(), non_blocking=on_gpu)
            out.append(dst)
        if on_gpu:
            torch.cuda.synchronize()
        return out


_staging = _Staging()
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


def save_async(comm: Comm, storage: Storage, state: Any, overwrite: bool, after_commit: Any) -> SaveHandle:
    """Stage ``state`` and continue the save in the background."""
    global _in_flight
    wait_in_flight()
    comm.arrive("save", storage.url)
    local: _Local | None = None
    err: BaseException | None = None
    try:
        local = describe(state, comm.rank)
        staged = _staging.stage(local.views + [v for vs in local.per_rank_views.values() for v in vs])
        n = len(local.views)
        local.views = staged[:n]
        pos = n
        for k, vs in local.per_rank_views.items():
            local.per_rank_views[k] = staged[pos : pos + len(vs)]
            pos += len(vs)
    except Exception as e:  # noqa: BLE001 - fanned out in the background
        local, err = None, e
    handle = SaveHandle(storage.url)

    def run() -> None:
        try:
            save_collective(comm, storage, local, err, overwrite, after_commit)
        except BaseException as e:  # noqa: BLE001 - surfaced on wait()
            handle._error = e
        finally:
            handle._done.set()

    _in_flight = handle
    handle._thread = comm.start_background(run, "shardpoint-save")
    return handle


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
