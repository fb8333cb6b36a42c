"""Helpers shared by the benchmarks: memory high-water marks, page cache, durable
files, and starting real ranks as separate processes, bounded in time.

Nothing here imports torch, so the orchestrator stays light; the workers import it.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

MB = 1_000_000
MiB = 1 << 20


# --- memory -------------------------------------------------------------------------


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def rss_bytes() -> int:
    return _status_kib("VmRSS:") * 1024


def _reset_hwm() -> bool:
    """Reset the peak-RSS counter (VmHWM) to the current RSS (Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class PeakRss:
    """Resident memory growth of this process across a block: peak RSS during the
    block minus RSS just before it.

    The peak comes from the kernel's VmHWM after resetting it with
    ``/proc/self/clear_refs`` (exact, catches spikes inside one C call); where
    that reset is refused, from a thread sampling VmRSS every 2 ms.
    """

    def __init__(self) -> None:
        self.before = 0
        self.peak = 0
        self._sampler: Any = None

    def __enter__(self) -> PeakRss:
        self._hwm = _reset_hwm()
        self.before = rss_bytes()
        self.peak = self.before
        if not self._hwm:
            import threading

            self._stop = threading.Event()

            def sample() -> None:
                while not self._stop.is_set():
                    self.peak = max(self.peak, rss_bytes())
                    self._stop.wait(0.002)

            self._sampler = threading.Thread(target=sample, daemon=True)
            self._sampler.start()
        return self

    def sample(self) -> int:
        """Growth so far (peak minus before), without ending the block."""
        if self._hwm:
            self.peak = max(self.peak, _status_kib("VmHWM:") * 1024)
        else:
            self.peak = max(self.peak, rss_bytes())
        return self.peak - self.before

    def __exit__(self, *exc: object) -> None:
        if self._sampler is not None:
            self._stop.set()
            self._sampler.join()
        self.sample()

    @property
    def growth(self) -> int:
        return max(0, self.peak - self.before)


# --- disk ---------------------------------------------------------------------------


def drop_caches() -> bool:
    """Flush dirty pages and drop the page cache; False when not permitted."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def fsync_tree(root: str | os.PathLike[str]) -> None:
    """fsync every file and directory under ``root`` (for savers that do not)."""
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fd = os.open(dirpath, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def tree_bytes(root: str | os.PathLike[str]) -> int:
    return sum(p.stat().st_size for p in Path(root).rglob("*") if p.is_file())


def dd_write_mb_s(directory: str, size_mb: int, repeat: int = 3, timeout: float = 300) -> tuple[float, list[float]]:
    """Median sequential write speed with fdatasync, in MB/s (10^6 bytes), by ``dd``."""
    count = max(4, round(size_mb * MB / (16 * MiB)))
    speeds = []
    for i in range(repeat):
        f = os.path.join(directory, f"dd.{i}")
        os.sync()
        t0 = time.perf_counter()
        subprocess.run(
            ["dd", "if=/dev/zero", f"of={f}", "bs=16M", f"count={count}", "conv=fdatasync"],
            check=True, capture_output=True, timeout=timeout,
        )
        dt = time.perf_counter() - t0
        speeds.append(count * 16 * MiB / MB / dt)
        os.remove(f)
    return statistics.median(speeds), speeds


# --- processes ----------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class JobFailed(RuntimeError):
    """A job failed or timed out; ``results`` holds what each rank had written."""

    def __init__(self, msg: str, results: list[dict[str, Any]] | None = None) -> None:
        super().__init__(msg)
        self.results = results or []


def read_rank_results(workdir: str, role: str, world: int) -> list[dict[str, Any]]:
    out = []
    for r in range(world):
        p = Path(workdir, f"{role}.rank{r}.json")
        out.append(json.loads(p.read_text()) if p.exists() else {})
    return out


def launch(script: str, role: str, world: int, cfg: dict[str, Any], workdir: str, timeout: float,
           extra_env: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """Run ``python script role cfg.json`` as ``world`` real processes with the usual
    torch.distributed environment on a free loopback port. Each rank writes
    ``<workdir>/<role>.rank<r>.json``; returns those dicts in rank order.

    Every rank runs in its own session so that a timeout or a failure kills it and
    anything it started; the whole job is bounded by ``timeout`` seconds.
    """
    cfg_path = os.path.join(workdir, f"{role}.cfg.json")
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    port = free_port()
    procs: list[subprocess.Popen[bytes]] = []
    logs = []
    for r in range(world):
        env = dict(os.environ)
        env.update(
            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(r), WORLD_SIZE=str(world),
            LOCAL_RANK=str(r), LOCAL_WORLD_SIZE=str(world), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
        )
        env.update(extra_env or {})
        log = open(os.path.join(workdir, f"{role}.rank{r}.log"), "wb")
        logs.append(log)
        procs.append(subprocess.Popen([sys.executable, script, role, cfg_path], env=env, stdout=log,
                                      stderr=subprocess.STDOUT, start_new_session=True))
    deadline = time.monotonic() + timeout
    failed = ""
    try:
        while True:
            codes = [p.poll() for p in procs]
            if all(c == 0 for c in codes):
                break
            bad = [r for r, c in enumerate(codes) if c not in (None, 0)]
            if bad:
                failed = f"{role}: ranks {bad} exited with {[codes[r] for r in bad]}"
                break
            if time.monotonic() > deadline:
                failed = f"{role}: did not finish within {timeout:.0f}s"
                break
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            p.wait()
        for log in logs:
            log.close()
    if failed:
        tail = ""
        for r in range(world):
            text = Path(workdir, f"{role}.rank{r}.log").read_text(errors="replace")
            if "Traceback" in text or r == 0:
                tail += f"\n--- rank {r} log (tail) ---\n" + text[-3000:]
        raise JobFailed(failed + tail, read_rank_results(workdir, role, world))
    return read_rank_results(workdir, role, world)


def run_timed(cmd: Sequence[str], timeout: float, log_path: str, env: dict[str, str] | None = None) -> tuple[float, int]:
    """Run a command, output to ``log_path``; return (wall seconds, peak RSS in bytes
    of the command and the children it reaped). Raises JobFailed on error or timeout."""
    t0 = time.perf_counter()
    with open(log_path, "wb") as log:
        p = subprocess.Popen(list(cmd), stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        deadline = time.monotonic() + timeout
        while True:
            pid, status, usage = os.wait4(p.pid, os.WNOHANG)
            if pid:
                break
            if time.monotonic() > deadline:
                os.killpg(p.pid, signal.SIGKILL)
                os.wait4(p.pid, 0)
                p.returncode = -9
                raise JobFailed(f"{' '.join(cmd[:4])} did not finish within {timeout:.0f}s")
            time.sleep(0.05)
    dt = time.perf_counter() - t0
    p.returncode = os.waitstatus_to_exitcode(status)
    if p.returncode != 0:
        text = Path(log_path).read_text(errors="replace")
        raise JobFailed(f"{' '.join(cmd[:4])} exited with {p.returncode}:\n{text[-3000:]}")
    return dt, usage.ru_maxrss * 1024


def median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs))


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out
