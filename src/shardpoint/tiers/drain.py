"""The drain: a step due for durability is copied from its memory snapshot to the
durable root, file by file, the manifest last and then ``latest``: the durable
checkpoint is the snapshot's bytes, byte for byte, committed by the same rule as a
direct save. It runs in a helper process (``python -m shardpoint.tiers._helper``, fed
one JSON line per job; off the training process's GIL) or, to compare, in a thread.

The helper exits when its parent does: at the end of its input, and between blocks
of a copy when its parent is gone (the drain is then torn: no manifest, never taken
for a checkpoint, and the snapshot it came from is still in memory)."""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields
from typing import IO, Any

import msgspec

from ..errors import CorruptCheckpointError, MemoryTierError, ShardpointError
from ..format.digest import Digester
from ..format.manifest import MANIFEST_NAME
from ..load.locate import committed, read_manifest
from ..saving.commit import commit_checkpoint
from ..saving.fence import Owner
from ..storage import Storage, storage_for
from ..storage.local import LocalStorage
from .hosts import FileSpec

BLOCK = 8 << 20


class DrainAborted(MemoryTierError):
    """The process that asked for the drain is gone; the drain stops, uncommitted."""


@dataclass(frozen=True, slots=True)
class DrainJob:
    """One step to make durable: its snapshot folder, the durable root and folder, and
    the generation of the attempt that owns the root (:mod:`shardpoint.saving.fence`;
    None: unfenced), whose ``latest`` is pointed at the folder once it is committed.

    ``files``: None copies every file the snapshot's manifest names from the snapshot
    folder; else only these files (:class:`~.hosts.FileSpec`: this host's part of a
    snapshot spread over hosts). ``commit``: write the manifest and
    ``latest`` once the files are there (with ``files`` given, only after checking that
    every file the manifest names is in the durable folder at its size)."""

    step: int
    src: str
    root: str
    folder: str
    generation: int | None = None
    storage_options: dict[str, Any] | None = None
    files: list[FileSpec] | None = None
    commit: bool = True
    save_id: str | None = None

    def wire(self) -> str:
        """One JSON line for the helper process."""
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["files"] = msgspec.to_builtins(self.files)
        return json.dumps(d)

    @staticmethod
    def from_wire(line: str) -> DrainJob:
        """Back from :meth:`wire`."""
        d = json.loads(line)
        d["files"] = msgspec.convert(d["files"], list[FileSpec] | None)
        return DrainJob(**d)


@dataclass(frozen=True, slots=True)
class DrainResult:
    """How a drain ended: ``error`` is None when its checkpoint committed."""

    step: int
    error: str | None = None


def _blocks(src: Storage, name: str, size: int, alive: Callable[[], bool], h: Any) -> Iterator[memoryview]:
    off = 0
    while off < size:
        if not alive():
            raise DrainAborted(f"drain of {name} stopped: the training process that asked for it is gone")
        b = src.read(name, off, min(BLOCK, size - off))
        if h is not None:
            h.update(b)
        off += len(b)
        yield memoryview(b)


def _copy(src: Storage, dst: Storage, name: str, size: int, alive: Callable[[], bool], digest: str | None = None,
          rel: str | None = None) -> None:
    h = Digester(digest) if digest is not None else None
    n = dst.write_file(name, _blocks(src, rel or name, size, alive, h))
    if n != size or (h is not None and h.named() != digest):
        dst.remove(name)
        raise CorruptCheckpointError(f"memory snapshot file {src.url}/{rel or name} changed while it was drained "
                                     f"({n} bytes, {size} expected, or its digest differs from its manifest's); "
                                     "the durable checkpoint was not committed")


def drain_snapshot(job: DrainJob, alive: Callable[[], bool] = lambda: True) -> None:
    """Copy the snapshot at ``job.src`` to ``job.root/job.folder``: data files and
    their indexes (each fsynced, each index checked against the manifest's digest),
    then the commit every path makes (:func:`~shardpoint.saving.commit.commit_checkpoint`:
    the files checked, the manifest, ``latest``). A checkpoint already in that folder
    is replaced as a direct save with ``overwrite`` replaces it (its files go after the
    commit); the same one (a drain run again) only gets ``latest``. With ``job.files``,
    only those files are copied (each host its part), and with ``job.commit`` the
    manifest is written only once every file it names is there. An attempt that no
    longer owns the root copies nothing (:class:`~shardpoint.errors.FencedError`)."""
    src = LocalStorage(job.src)
    root = storage_for(job.root, job.storage_options)
    dst = root.child(job.folder)
    owner = Owner(root, job.generation) if job.generation is not None else None
    what = f"the drain of step {job.step}"
    if job.files is not None and not job.commit:  # one host's part: no manifest needed here
        try:
            if job.save_id is not None and read_manifest(dst).save_id == job.save_id:
                return  # committed before (a restart re-drains): its files stay as they are
        except ShardpointError:
            pass
        if owner is not None:
            owner.check(what)
        for f in job.files:
            _copy(src, dst, f.name, f.size, alive, f.digest, f.rel)
        return
    man_bytes = bytes(src.read(MANIFEST_NAME))
    man = read_manifest(src)  # the seal is checked: a torn snapshot is never drained
    if committed(dst, man.save_id):  # drained before (a restart re-drains): only the pointer
        commit_checkpoint(dst, man, replace=True, owner=owner, latest=job.folder, data=man_bytes, what=what)
        return
    if owner is not None:
        owner.check(what)
    if job.files is None:
        for name, entry in man.files.items():
            _copy(src, dst, name, entry.size, alive)
            idx = entry.index
            if idx is not None:
                _copy(src, dst, idx.name, idx.size, alive, idx.digest)
    else:  # the other hosts' parts are checked by the commit: never a partial checkpoint
        for f in job.files:
            _copy(src, dst, f.name, f.size, alive, f.digest, f.rel)
    if not alive():
        raise DrainAborted(f"drain of step {job.step} stopped before its commit: the training process is gone")
    commit_checkpoint(dst, man, replace=True, owner=owner, latest=job.folder, data=man_bytes, what=what)


class Drainer:
    """Runs one drain at a time, in a helper process (started on first use, kept) or a
    thread. Owned by the manager of the rank that starts drains."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.job: DrainJob | None = None  # the drain in flight
        self._proc: subprocess.Popen[bytes] | None = None
        self._thread: threading.Thread | None = None
        self._result: DrainResult | None = None

    def start(self, job: DrainJob) -> None:
        assert self.job is None, "one drain at a time: wait() first"
        self.job = job
        if self.mode == "thread":
            self._result = None
            self._thread = threading.Thread(target=self._in_thread, args=(job,), name="shardpoint-drain", daemon=True)
            self._thread.start()
            return
        proc = self._helper()
        assert proc.stdin is not None
        try:
            proc.stdin.write(job.wire().encode() + b"\n")
            proc.stdin.flush()
        except OSError as e:
            self.job, self._proc = None, None
            raise MemoryTierError(f"the drain helper process (pid {proc.pid}) is gone ({e}); step {job.step} "
                                  "was not made durable") from e

    def _in_thread(self, job: DrainJob) -> None:
        try:
            drain_snapshot(job)
            self._result = DrainResult(job.step)
        except Exception as e:  # noqa: BLE001 - reported by poll()/wait()
            self._result = DrainResult(job.step, f"{type(e).__name__}: {e}")

    def _helper(self) -> subprocess.Popen[bytes]:
        if self._proc is not None and self._proc.poll() is None:
            return self._proc
        here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # holds shardpoint/
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([here, *filter(None, [os.environ.get("PYTHONPATH")])]))
        self._proc = subprocess.Popen([sys.executable, "-m", "shardpoint.tiers._helper", str(os.getpid())],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        return self._proc

    def poll(self) -> DrainResult | None:
        """The result of the drain in flight if it has ended (then nothing is in flight)."""
        return self._finish(0.0)

    def wait(self, timeout: float | None = None) -> DrainResult | None:
        """Wait for the drain in flight; its result, or None when none was in flight."""
        return self._finish(timeout)

    def _finish(self, timeout: float | None) -> DrainResult | None:
        job = self.job
        if job is None:
            return None
        if self.mode == "thread":
            assert self._thread is not None
            self._thread.join(timeout)
            if self._thread.is_alive():
                return None
            result = self._result or DrainResult(job.step, "the drain thread ended without a result")
        else:
            proc = self._proc
            assert proc is not None and proc.stdout is not None
            if timeout is not None and not select.select([proc.stdout], [], [], timeout)[0]:
                return None
            line = proc.stdout.readline()
            if not line:
                self._proc = None
                result = DrainResult(job.step, f"the drain helper process (pid {proc.pid}) died "
                                               f"(exit code {proc.wait()})")
            else:
                got = json.loads(line)
                result = DrainResult(int(got["step"]), got.get("error"))
        self.job = None
        return result

    def close(self) -> None:
        """Stop the helper (after the drain in flight, which it finishes first)."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.stdin is not None:
            proc.stdin.close()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _serve(parent: int, lines: IO[bytes], out: IO[bytes]) -> None:
    """The helper's loop: one job a line, one result a line, until the input ends."""

    def alive() -> bool:
        return os.getppid() == parent

    for raw in lines:
        job = DrainJob.from_wire(raw.decode())
        try:
            drain_snapshot(job, alive)
            result: dict[str, Any] = {"step": job.step, "error": None}
        except DrainAborted:
            return
        except Exception as e:  # noqa: BLE001 - reported to the training process
            result = {"step": job.step, "error": f"{type(e).__name__}: {e}"}
        out.write(json.dumps(result).encode() + b"\n")
        out.flush()

def main(argv: list[str]) -> None:
    """The helper process's entry (``python -m shardpoint.tiers._helper PARENT_PID``)."""
    _serve(int(argv[1]), sys.stdin.buffer, sys.stdout.buffer)
