"""Start real ranks for multi-process tests: fresh processes, a real gloo process
group on a free loopback port, a bound on time, and no leftovers.

Ranks are forked from a fork server that imported torch and shardpoint once (the
``forkserver`` start method with a preload): a rank starts in milliseconds instead of
the seconds of CPU that importing torch costs a spawned process, which over the
suite's few hundred ranks is minutes on a 2-core machine. The server is a clean,
single-threaded process (it imports, nothing more), so forking it is safe; each rank
still gets its own fresh interpreter state, the parent's environment of the moment and
its own process group. ``SHARDPOINT_TEST_START=spawn`` starts ranks the slow way."""

from __future__ import annotations

import os
import pickle
import queue
import signal
import socket
import subprocess
import sys
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(nproc: int, script: str | os.PathLike[str], *args: str, timeout: float = 240,
             env: dict[str, str] | None = None, cwd: str | os.PathLike[str] | None = None,
             merge_stderr: bool = False) -> subprocess.CompletedProcess[str]:
    """Run ``script`` under torchrun on ``nproc`` local ranks (a free loopback port,
    OMP_NUM_THREADS=1, this interpreter's import path); the whole process group is
    killed if it outlives ``timeout``. Returns the finished process with its output
    (stderr folded into stdout with ``merge_stderr``)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_addr",
           "127.0.0.1", "--master_port", str(free_port()), str(script), *args]
    full = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path), **(env or {})}
    proc = subprocess.Popen(cmd, env=full, cwd=cwd, start_new_session=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT if merge_stderr else subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err or "")


_PRELOAD = ["torch", "torch.distributed", "numpy", "shardpoint", "tests._dist"]


_preloaded: list[str] | None = None  # what the running fork server imported


def _context(preload: list[str] | None = None) -> Any:
    """The start method of ranks: a fork server that imported ``preload`` (see above).
    A test that needs other modules preloaded (DeepSpeed's) gets a server of its own:
    the running one is stopped first (one server at a time, as multiprocessing has)."""
    global _preloaded
    if os.environ.get("SHARDPOINT_TEST_START") == "spawn":
        return mp.get_context("spawn")
    import multiprocessing.forkserver as fs

    preload = preload or _PRELOAD
    if _preloaded is not None and _preloaded != preload:
        fs._forkserver._stop()  # private, but the only way to change the preload of a running server
    _preloaded = preload
    fs.set_forkserver_preload(preload)
    return mp.get_context("forkserver")


def _entry(fn: Callable[..., Any], rank: int, world_size: int, port: int, q: Any, args: tuple, env: dict) -> None:
    os.environ.clear()
    os.environ.update(env)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size), OMP_NUM_THREADS="1",
    )
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    backend = os.environ.get("SHARDPOINT_TEST_BACKEND", "gloo")  # tests/cuda: "nccl" for the world of one GPU
    try:
        if backend == "nccl" or os.environ.get("SHARDPOINT_TEST_CUDA"):
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timedelta(seconds=120))
        result = fn(rank, world_size, *args)
        # plain pickle copies tensors by value; torch's queue would share memory with a
        # process that is about to exit
        q.put((rank, True, pickle.dumps(result)))
    except BaseException:  # noqa: BLE001 - report everything to the parent
        q.put((rank, False, traceback.format_exc()))
    finally:
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:
            pass


class RankFailed(AssertionError):
    pass


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120, env: dict | None = None,
              preload: list[str] | None = None) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` fresh gloo ranks and
    return their results in rank order. Raises ``RankFailed`` with the failing ranks'
    tracebacks, or on timeout (killing every rank). ``preload``: the modules the fork
    server imports (default: torch and shardpoint)."""
    ctx = _context(preload)
    q = ctx.Queue()
    port = free_port()
    environ = dict(os.environ, **(env or {}))  # a forked rank would see the server's environment, not ours
    procs = [
        ctx.Process(target=_entry, args=(fn, r, world_size, port, q, args, environ), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, tuple[bool, Any]] = {}
    import time

    deadline = time.monotonic() + timeout
    try:
        while len(results) < world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RankFailed(f"ranks {sorted(set(range(world_size)) - set(results))} did not finish within {timeout}s")
            try:
                rank, ok, value = q.get(timeout=min(left, 1.0))
                results[rank] = (ok, value)
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in results]
                if dead:
                    raise RankFailed(f"ranks {dead} died with exit codes {[procs[r].exitcode for r in dead]}") from None
    finally:
        for p in procs:
            p.join(timeout=5)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    failed = {r: v for r, (ok, v) in results.items() if not ok}
    if failed:
        raise RankFailed("\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(failed.items())))
    return [pickle.loads(results[r][1]) for r in range(world_size)]
