"""Run shardpoint's read paths on a checkpoint in a separate worker process with a
hard time bound, so that a hang (a blocking open of a FIFO, a runaway loop) is
caught as a failure instead of stalling the suite, and so that whatever a hostile
checkpoint does happens outside the test process.

The worker imports torch once and answers one request per line: a checkpoint
directory in, one outcome per call out. On a timeout the worker is killed (its
whole process group) and the next request starts a fresh one.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
import traceback
from typing import Any

CALLS = ("load", "load_full", "metadata", "verify")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class Hung(AssertionError):
    """A call did not return within its time bound."""


class Sandbox:
    """A worker process that runs read calls on checkpoints, each bounded in time."""

    def __init__(self, timeout: float = 20.0) -> None:
        self.timeout = timeout
        self.proc: subprocess.Popen[bytes] | None = None

    def _start(self) -> subprocess.Popen[bytes]:
        if self.proc is None or self.proc.poll() is not None:
            env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
            self.proc = subprocess.Popen(
                [sys.executable, "-c", "from tests.failure._sandbox import serve; serve()"],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=ROOT, env=env, start_new_session=True,
            )
            self._ask({"ping": True}, 120.0)  # importing torch on a busy machine takes a while
        return self.proc

    def _ask(self, req: dict[str, Any], timeout: float) -> dict[str, Any]:
        proc = self.proc
        assert proc is not None and proc.stdin is not None and proc.stdout is not None
        proc.stdin.write((json.dumps(req) + "\n").encode())
        proc.stdin.flush()
        deadline = time.monotonic() + timeout
        line = b""
        while not line.endswith(b"\n"):
            left = deadline - time.monotonic()
            ready, _, _ = select.select([proc.stdout], [], [], max(left, 0))
            if not ready:
                self.close()
                raise Hung(f"{req.get('calls')} on {req.get('path')} did not return within {timeout:g}s")
            chunk = os.read(proc.stdout.fileno(), 1 << 16)
            if not chunk:
                code = proc.wait()
                self.proc = None
                raise AssertionError(f"the sandbox worker died (exit code {code}) on {req}")
            line += chunk
        return json.loads(line)

    def run(self, path: str, calls: tuple[str, ...] = CALLS, **options: Any) -> dict[str, dict[str, Any]]:
        """Outcome of each call on ``path``: ``{"ok": True, ...}`` or ``{"ok": False,
        "type": ..., "shardpoint": bool, "message": ..., "traceback": ...}``."""
        self._start()
        return self._ask({"path": path, "calls": list(calls), **options}, self.timeout)["results"]

    def forbid_unpickling(self) -> None:
        """From now on, any unpickling in the worker raises (see :func:`_forbid_unpickling`)."""
        self._start()
        self._ask({"ping": True, "forbid_unpickling": True}, self.timeout)

    def close(self) -> None:
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()
            self.proc = None


def _call(name: str, path: str, verify_data: bool) -> dict[str, Any]:
    import shardpoint
    from shardpoint.verify import verify
    from tests.failure._sample import template

    try:
        if name == "load":
            report = shardpoint.load(template(), path, strict=False, verify=verify_data)
            return {"ok": True, "loaded": report.loaded}
        if name == "load_full":
            out = shardpoint.load_full(path, verify=verify_data)
            return {"ok": True, "keys": sorted(out)}
        if name == "metadata":
            m = shardpoint.metadata(path)
            return {"ok": True, "tensors": sorted(m.tensors)}
        res = verify(path)
        return {"ok": True, "verified": res.ok, "problems": [str(p) for p in res.problems],
                "files": res.damaged_files, "keys": res.damaged_keys}
    except BaseException as e:  # noqa: BLE001 - the caller judges the type
        return {"ok": False, "type": type(e).__name__, "shardpoint": isinstance(e, shardpoint.ShardpointError),
                "message": str(e)[:2000], "traceback": traceback.format_exc()[-4000:]}


def _forbid_unpickling() -> None:
    """Make every unpickling entry point fail loudly: a read path that reached one
    would then report ``UnpicklingForbidden`` instead of passing quietly."""
    import pickle

    import torch

    class UnpicklingForbidden(BaseException):
        pass

    def refuse(*_a: Any, **_k: Any) -> Any:
        raise UnpicklingForbidden("an unpickling function was called")

    class Refuse(pickle.Unpickler):
        def __init__(self, *_a: Any, **_k: Any) -> None:
            refuse()

    pickle.load = pickle.loads = refuse  # type: ignore[assignment]
    pickle.Unpickler = Refuse  # type: ignore[misc]
    torch.load = refuse  # type: ignore[assignment]


def serve() -> None:
    """Worker loop (runs in the sandbox process)."""
    import torch

    torch.set_num_threads(1)
    for line in sys.stdin:
        req = json.loads(line)
        if req.get("forbid_unpickling"):
            _forbid_unpickling()
        if req.get("ping"):
            out: dict[str, Any] = {"pong": True}
        else:
            out = {"results": {c: _call(c, req["path"], req.get("verify", True)) for c in req["calls"]}}
        sys.stdout.write(json.dumps(out) + "\n")
        sys.stdout.flush()
