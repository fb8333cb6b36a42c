"""The handle of an asynchronous save, and the save in flight at exit.

One save is in flight at a time (:data:`shardpoint.runtime.PROCESS`'s
``in_flight``): the next save, a load (which waits for the data lane) or
:meth:`SaveHandle.wait` waits for it and the first of them re-raises its error.

At interpreter exit (before Python joins threads and runs ``atexit``), a save
still in flight gets up to :data:`EXIT_GRACE` seconds to commit; after that its
collectives are closed, it is abandoned without a manifest (so nothing torn is
ever committed) and a loud warning names it. Its thread always ends before the
interpreter finalises, which a daemon thread woken inside torch's C++ code would
otherwise turn into an abort (SIGABRT) of a clean exit.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
from typing import Any

import torch

from ..collective import close_channels
from ..errors import SaveTimeoutError
from ..report import SaveStats
from ..runtime import PROCESS
from .buffers import StagingBuffer

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
        #: What the save cost on this rank, once it committed (None before, or when it failed).
        self.stats: SaveStats | None = None

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
            raise SaveTimeoutError(f"the overlapped save to {self.path} is still copying after {timeout}s; "
                                   "wait longer, or call handle.wait() to see its error")
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
            raise SaveTimeoutError(f"the asynchronous save to {self.path} is still running after {timeout}s; "
                                   "wait longer (it is still writing), or look for a rank that stopped")
        self._release_hooks()
        self._join()
        if PROCESS.in_flight is self:
            PROCESS.in_flight = None
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


    def _hold_optimizers(self, opts: list[torch.optim.Optimizer]) -> None:
        """A step pre-hook on each optimizer that waits until the overlapped copy is
        taken: the step is the first thing that changes what the save copies."""

        def wait_for_copy(*_: Any) -> None:
            self._staged.wait()

        self._hooks = [opt.register_step_pre_hook(wait_for_copy) for opt in opts]

    def _fail(self, error: BaseException) -> None:
        self._error = error
        self._staged.set()
        self._done.set()


def wait_in_flight() -> None:
    """Wait for the save in flight, if any (re-raising its error). Every save starts here."""
    _ensure_exit_hook()
    h = PROCESS.in_flight
    if isinstance(h, SaveHandle):
        h.wait()


def settle_in_flight() -> None:
    """Wait for the save in flight, if any, to end; its error stays with its
    handle for :meth:`SaveHandle.wait` or the next save to raise."""
    _ensure_exit_hook()
    h = PROCESS.in_flight
    if isinstance(h, SaveHandle):
        h._done.wait()
        h._join()


def staging_nbytes() -> int:
    """Bytes held by the asynchronous staging buffer (tests and benchmarks)."""
    s = PROCESS.staging
    return s.nbytes if isinstance(s, StagingBuffer) else 0


def _at_exit() -> None:
    """Give the save in flight :data:`EXIT_GRACE` seconds, then close the
    channels so that its thread ends (with an error) while the interpreter is
    still whole; warn when it did not commit. Then destroy the channels' lanes
    here, not in the destructors that run while the process exits (one of them,
    now and then, aborted a clean exit with SIGABRT)."""
    h = PROCESS.in_flight
    if not isinstance(h, SaveHandle):
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
        # a logger, not print: with no handler configured, Python's last resort writes it to stderr
        logging.getLogger("shardpoint.save").warning(
            "shardpoint WARNING: the asynchronous save of %s %s and was NOT committed (no manifest was written, so "
            "it does not count as a checkpoint). Call handle.wait() or CheckpointManager.wait() before exiting or "
            "destroying the process group.", what, how)


def _ensure_exit_hook() -> None:
    """Register :func:`_at_exit` once per process, at the first save or restore (not at
    import: a script that only imports shardpoint keeps Python's exit as it is).
    threading's exit hooks run before Python joins non-daemon threads and before
    ``atexit``, while every thread and torch itself are still whole."""
    if PROCESS.exit_hook:
        return
    PROCESS.exit_hook = True
    register = getattr(threading, "_register_atexit", None)
    if register is not None:
        register(_at_exit)
    else:  # pragma: no cover - every supported Python has it
        atexit.register(_at_exit)
