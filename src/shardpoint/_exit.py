"""Let torch's gloo worker threads finish with the GIL before the interpreter
finalises (an ``atexit`` hook registered at import).

Why: a ``ProcessGroupGloo`` worker thread (``pt_gloo_runloop``) destroys each
collective's ``AsyncWork`` after it completes, and Python usually dropped its
``Work`` handle first (every ``async_op=False`` collective, e.g. the last
``broadcast_object_list`` of ``torch.distributed.checkpoint.save``). Destroying
the work drops the thread's references to the collective's tensors, and a tensor
that has a Python object needs the GIL for that (``TensorImpl::decref_pyobject`` ->
``ConcretePyInterpreterVTable::decref`` -> ``gil_scoped_acquire``). If the thread
gets there only after ``Py_FinalizeEx`` has marked the interpreter finalising (it
was not scheduled in time: a loaded machine), CPython 3.10-3.13 end it with
``pthread_exit`` inside ``take_gil``; the forced unwind meets the work's noexcept
destructor and ``std::terminate`` aborts the whole process ("terminate called
without an active exception", exit -6) after the script's work is done. This is
torch's race (pytorch/pytorch#190489), with or without ``destroy_process_group()``
(gloo's ``shutdown()`` does not join its workers).

The hook runs among the last ``atexit`` handlers, while the interpreter is still
whole: it releases the GIL in short sleeps until every gloo worker of the process
is asleep and has not run since the previous look, so a worker that still had a
reference to drop has dropped it. It waits at most :data:`SETTLE` seconds
(``SHARDPOINT_EXIT_SETTLE``, 0 turns it off), returns at once when the process
has no gloo worker (or no ``/proc``), never raises and changes nothing else: no
exit code, no other handler, no process group is touched. A collective still
waiting for its peers at exit is asleep too, so it is not waited for.
"""

from __future__ import annotations

import os
import time


def _env_seconds(name: str, default: float) -> float:
    try:
        return float(os.environ.get(name, default))
    except ValueError:  # a malformed value must not break ``import shardpoint``
        return default


#: Seconds the exit hook waits at most for gloo workers to settle (0: no hook).
SETTLE = _env_seconds("SHARDPOINT_EXIT_SETTLE", 5.0)

#: The name torch gives ProcessGroupGloo's worker threads (c10::setThreadName).
GLOO_WORKER = "pt_gloo_runloop"

_TASKS = "/proc/self/task"


def gloo_workers() -> list[str]:
    """The thread ids of this process's gloo worker threads ([] without /proc)."""
    try:
        tids = os.listdir(_TASKS)
    except OSError:
        return []
    found = []
    for tid in tids:
        try:
            with open(f"{_TASKS}/{tid}/comm") as f:
                if f.read().strip() == GLOO_WORKER:
                    found.append(tid)
        except OSError:  # the thread ended meanwhile
            continue
    return found


def _look(tids: list[str]) -> dict[str, tuple[str, int]]:
    """Each live thread's scheduler state (R, S, D...) and how many times it has
    been switched out so far (it grows every time the thread ran and blocked)."""
    seen = {}
    for tid in tids:
        try:
            with open(f"{_TASKS}/{tid}/status") as f:
                fields = dict(line.split(":", 1) for line in f.read().splitlines() if ":" in line)
            switches = int(fields["voluntary_ctxt_switches"]) + int(fields["nonvoluntary_ctxt_switches"])
            seen[tid] = (fields["State"].split()[0], switches)
        except (OSError, KeyError, ValueError, IndexError):  # ended, or a /proc we do not know
            continue
    return seen


def settle_gloo_workers(bound: float | None = None, interval: float = 0.01) -> int:
    """Release the GIL until every gloo worker thread sleeps and has not run between
    two looks taken ``interval`` apart (the sleep between them hands the GIL to a
    worker that waits for it), or ``bound`` seconds passed. Returns how many looks
    it took after the first (0: no gloo worker). Never raises."""
    bound = SETTLE if bound is None else bound
    try:
        tids = gloo_workers()
        if not tids or bound <= 0:
            return 0
        deadline = time.monotonic() + bound
        before = _look(tids)
        looks = 0
        while time.monotonic() < deadline:
            time.sleep(interval)
            now = _look(tids)
            looks += 1
            if now == before and all(state == "S" for state, _ in now.values()):
                break
            before = now
        return looks
    except Exception:  # an exit hook must not turn a clean exit into a traceback
        return 0
