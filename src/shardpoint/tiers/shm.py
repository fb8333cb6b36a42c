"""A job's snapshots in node-local shared memory: one private folder per job
(0700, files 0600), one shardpoint checkpoint per step in it.

A snapshot counts only when its manifest (sealed, written last by the save's commit)
reads and every file it names is there at its size; anything else is torn and never
chosen. Nothing here is collective: each host sees its own folder."""

from __future__ import annotations

import json
import os
import shutil
import stat
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from ..errors import CheckpointNotFoundError, CorruptCheckpointError, MemoryTierError
from ..format.manifest import MANIFEST_NAME, Manifest
from ..format.pointer import STEP_FOLDER
from ..health import HealthRule
from ..load.locate import read_manifest
from ..storage.base import Delegating, Storage
from ..storage.local import LocalStorage
from .config import job_folder
from .hosts import FETCHED, RANGES, REPLICAS, HostInventory, StepHolding, needed

JOB_FILE = "job.json"
#: Folders of freed snapshots whose bytes are being removed (``JobArea.free``).
_FREEING = ".freeing-"


class PrivateStorage(Delegating):
    """A local folder whose files only this user may read: each file is 0600 and its
    folder 0700 once written (the job folder above is 0700 from the start, so no other
    user can open a file in the moment before)."""

    inner: LocalStorage

    def __init__(self, inner: LocalStorage, url: str | None = None) -> None:
        super().__init__(inner)
        if url is not None:
            self.url = url

    def _private(self, name: str) -> None:
        path = os.path.join(self.inner.root, name)
        os.chmod(path, 0o600)
        os.chmod(os.path.dirname(path), 0o700)

    def write_file(self, name: str, parts: Iterable[bytes | memoryview]) -> int:
        n = self.inner.write_file(name, parts)
        self._private(name)
        return n

    def write_atomic(self, name: str, data: bytes) -> None:
        self.inner.write_atomic(name, data)
        self._private(name)

    def child(self, name: str) -> Storage:
        return PrivateStorage(self.inner.child(name))

    def parent(self) -> Storage:
        return PrivateStorage(self.inner.parent())


@dataclass(frozen=True, slots=True)
class Snapshot:
    """A complete snapshot in this host's job folder."""

    step: int
    path: str
    manifest: Manifest


def step_dir(step: int) -> str:
    return f"step-{step:08d}"


def _make_private_dir(path: str) -> None:
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
    except OSError as e:
        raise MemoryTierError(f"cannot create the memory tier's folder {path} ({e.strerror}); give "
                              "MemoryTier(path=...) a directory you can write to") from e
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        raise MemoryTierError(f"{path} is not a directory owned by this user (uid {os.getuid()}); refusing to keep "
                              "snapshots there. Give MemoryTier(path=...) a folder of your own")
    if st.st_mode & 0o077:
        os.chmod(path, 0o700)


class JobArea:
    """The folder of one job's snapshots on this host: ``<path>/job-<digest>/``."""

    def __init__(self, base: str, identity: str) -> None:
        self.base, self.identity = base, identity
        self.dir = os.path.join(base, job_folder(identity))
        #: The thread removing freed snapshots (``free(..., background=True)``).
        self._freeing: threading.Thread | None = None

    def open(self) -> None:
        """Create the job's folder (0700) and its identity file, or check them. Any rank
        may call it at the same time as others."""
        if not os.path.isdir(self.base):
            _make_private_dir(self.base)
        _make_private_dir(self.dir)
        path = os.path.join(self.dir, JOB_FILE)
        # written whole under a name of this process's own, then linked into place: the
        # link fails if the file exists, and a rank that finds it never reads it half-written
        tmp = os.path.join(self.dir, f".{JOB_FILE}.{os.getpid()}.{os.urandom(4).hex()}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(json.dumps({"identity": self.identity}).encode())
        try:
            os.link(tmp, path)
        except FileExistsError:
            if not self.owned():
                raise MemoryTierError(f"{path} names another job; its snapshots are not this job's. Remove "
                                      f"{self.dir} or give MemoryTier(job=...) another identity") from None
        finally:
            os.unlink(tmp)

    def owned(self) -> bool:
        """Whether the folder is this job's: ours, private, and its identity file names this job."""
        try:
            st = os.lstat(self.dir)
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
                return False
            with open(os.path.join(self.dir, JOB_FILE), "rb") as f:
                return bool(json.loads(f.read()).get("identity") == self.identity)
        except (OSError, ValueError, AttributeError):
            return False

    def storage(self, step: int) -> PrivateStorage:
        """The snapshot folder of ``step`` on this host. Its ``url`` names it the same
        on every host (``memory://job-<digest>/step-<8 digits>``: the base folder may
        differ between hosts, and a collective save or load checks that every rank
        names one path); ``.inner.root`` is the folder itself."""
        return PrivateStorage(LocalStorage(os.path.join(self.dir, step_dir(step))),
                              url=f"memory://{os.path.basename(self.dir)}/{step_dir(step)}")

    def path(self, step: int) -> str:
        """The snapshot folder of ``step`` on this host."""
        return os.path.join(self.dir, step_dir(step))

    def steps(self) -> list[int]:
        """Every step folder present (complete or not), oldest first."""
        try:
            names = os.listdir(self.dir)
        except FileNotFoundError:
            return []
        return sorted(int(m.group(1)) for n in names if (m := STEP_FOLDER.match(n)))

    def complete(self) -> list[Snapshot]:
        """The complete snapshots on this host, oldest first (none when the folder is
        not this job's)."""
        if not self.owned():
            return []
        out = []
        for step in self.steps():
            snap = self.check(step)
            if snap is not None:
                out.append(snap)
        return out

    def check(self, step: int) -> Snapshot | None:
        """The snapshot of ``step`` if it is complete: a sealed manifest and every file
        it names present at its size."""
        st = self.storage(step)
        try:
            man = read_manifest(st)
        except (CheckpointNotFoundError, CorruptCheckpointError, OSError):
            return None
        for name, entry in man.files.items():
            sizes: list[tuple[str, Any]] = [(name, entry.size)]
            if entry.index is not None:
                sizes.append((entry.index.name, entry.index.size))
            for n, size in sizes:
                try:
                    if os.path.getsize(os.path.join(st.inner.root, n)) != size:
                        return None
                except OSError:
                    return None
        return Snapshot(step, st.inner.root, man)

    def sealed(self) -> list[int]:
        """The steps whose manifest this host holds (sealed, readable), oldest first:
        the snapshots this host keeps, whether it holds all of their files or not
        (over several hosts each holds its own ranks' files and replicas of others')."""
        if not self.owned():
            return []
        out = []
        for step in self.steps():
            try:
                read_manifest(self.storage(step))
            except (CheckpointNotFoundError, CorruptCheckpointError, OSError):
                continue
            out.append(step)
        return out

    def free(self, keep: int, protect: set[int], *, background: bool = False) -> list[int]:
        """Remove all but the newest ``keep`` sealed snapshots (never a step in
        ``protect``: one being drained) and torn folders older than the newest sealed
        one. Replicas live in their step's folder, so ``keep`` bounds them too. Returns
        the steps removed.

        ``background``: each removed snapshot loses its manifest (it is no longer a
        snapshot) and its folder is renamed out of the way at once; its bytes are
        freed by a thread, beside the next snapshot's staging copy. Only when the
        shared memory has room for one more snapshot of the newest one's size besides
        them: else they are freed before this returns, so the memory bound holds."""
        self.settle()
        done = self.sealed()
        kept = set(done[-keep:]) if keep > 0 else set()
        newest = done[-1] if done else None
        gone = [step for step in self.steps()
                if step not in kept and step not in protect and (step in done or (newest is not None and step < newest))]
        if background and gone and newest is not None and self._room() >= self._bytes(newest):
            trash = []
            for step in gone:
                path = os.path.join(self.dir, step_dir(step))
                try:
                    os.unlink(os.path.join(path, MANIFEST_NAME))
                except OSError:
                    pass
                spare = os.path.join(self.dir, f"{_FREEING}{step}-{os.getpid()}")
                try:
                    os.rename(path, spare)
                    trash.append(spare)
                except OSError:
                    self.remove(step)
            self._freeing = threading.Thread(target=_remove_all, args=(trash,), name="shardpoint-free", daemon=True)
            self._freeing.start()
            return gone
        for step in gone:
            self.remove(step)
        return gone

    def settle(self) -> None:
        """Wait for the snapshots being freed in the background; remove what a process
        that died while freeing left behind."""
        t, self._freeing = self._freeing, None
        if t is not None:
            t.join()
        try:
            names = os.listdir(self.dir)
        except OSError:
            return
        _remove_all([os.path.join(self.dir, n) for n in names if n.startswith(_FREEING)])

    def _room(self) -> int:
        try:
            st = os.statvfs(self.dir)
        except OSError:
            return 0
        return st.f_bavail * st.f_frsize

    def _bytes(self, step: int) -> int:
        total = 0
        for dirpath, _dirs, files in os.walk(os.path.join(self.dir, step_dir(step))):
            for f in files:
                try:
                    total += os.lstat(os.path.join(dirpath, f)).st_size
                except OSError:
                    continue
        return total

    def inventory(self) -> HostInventory:
        """What this host holds, for the restore ladder over hosts: a
        :class:`~.hosts.StepHolding` per step folder (the manifest's record empty
        without a readable manifest). Temporary (half-written) files are never listed."""
        out: HostInventory = {}
        if not self.owned():
            return out
        for step in self.steps():
            st = self.storage(step)
            record: dict[str, Any] = {}
            try:
                man = read_manifest(st)
                record = dict(save_id=man.save_id, healthy=not HealthRule().unfit(man.nonfinite, man.nan, man.roles),
                              nonfinite=list(man.nonfinite or []), nan=man.nan, roles=dict(man.roles),
                              metrics=dict(man.metrics), created=man.created, world_size=man.world_size,
                              manifest=os.path.getsize(os.path.join(st.inner.root, MANIFEST_NAME)),
                              need=needed(man.files), data=sorted(man.files),
                              sha={f.index.name: f.index.digest for f in man.files.values() if f.index is not None})
            except (CheckpointNotFoundError, CorruptCheckpointError, OSError):
                pass
            have: dict[str, tuple[int, str]] = {}
            for rel in (FETCHED, REPLICAS, ""):
                folder = os.path.join(st.inner.root, rel)
                try:
                    names = os.listdir(folder)
                except OSError:
                    continue
                for n in names:
                    path = os.path.join(folder, n)
                    if n.startswith(".") or n == MANIFEST_NAME or not os.path.isfile(path):
                        continue
                    try:
                        have[n] = (os.path.getsize(path), f"{rel}/{n}" if rel else n)
                    except OSError:
                        continue
            out[str(step)] = StepHolding(**record, have=have, ranges=held_ranges(st.inner.root))
        return out

    def place(self, step: int, names: Iterable[str]) -> None:
        """Make every file of ``names`` present in the step folder itself (where a load
        reads it): a replica or a fetched copy is hard-linked there (no bytes copied)."""
        root = os.path.join(self.dir, step_dir(step))
        for n in names:
            here = os.path.join(root, n)
            if os.path.exists(here):
                continue
            for rel in (REPLICAS, FETCHED):
                there = os.path.join(root, rel, n)
                if os.path.exists(there):
                    os.link(there, here)
                    break

    def origin(self, step: int, name: str) -> str:
        """Where the bytes of file ``name`` of snapshot ``step`` on this host came from:
        ``"replica"`` (copied here by replication), ``"fetched"`` (from another host, by
        a restore: the file whole, or the byte ranges this host's ranks read) or
        ``"own"`` (written on this host by the save)."""
        root = os.path.join(self.dir, step_dir(step))
        if not os.path.exists(os.path.join(root, name)) and os.path.isdir(os.path.join(root, RANGES, name)):
            return "fetched"
        for rel, what in ((REPLICAS, "replica"), (FETCHED, "fetched")):
            try:
                if os.path.samefile(os.path.join(root, rel, name), os.path.join(root, name)):
                    return what
            except OSError:
                continue
        return "own"

    def remove(self, step: int) -> None:
        """Remove a snapshot, manifest first (a half-removed folder is never complete)."""
        path = os.path.join(self.dir, step_dir(step))
        try:
            os.unlink(os.path.join(path, MANIFEST_NAME))
        except OSError:
            pass
        shutil.rmtree(path, ignore_errors=True)


def held_ranges(root: str) -> dict[str, list[tuple[int, int, str]]]:
    """The byte ranges of data files under ``root/ranges/`` (a step folder): name ->
    ``[(start, stop, relpath), ...]`` by offset; a file counts only at its full size
    (``<start>-<stop>`` long), temporary ones never."""
    out: dict[str, list[tuple[int, int, str]]] = {}
    top = os.path.join(root, RANGES)
    try:
        names = os.listdir(top)
    except OSError:
        return out
    for name in names:
        try:
            pieces = os.listdir(os.path.join(top, name))
        except OSError:
            continue
        for p in pieces:
            a, _, b = p.partition("-")
            if p.startswith(".") or not (a.isdigit() and b.isdigit()):
                continue
            try:
                if os.path.getsize(os.path.join(top, name, p)) != int(b) - int(a):
                    continue
            except OSError:
                continue
            out.setdefault(name, []).append((int(a), int(b), f"{RANGES}/{name}/{p}"))
    for v in out.values():
        v.sort()
    return out


def _remove_all(paths: list[str]) -> None:
    for path in paths:
        shutil.rmtree(path, ignore_errors=True)


def list_jobs(base: str) -> list[JobArea]:
    """The job folders of this user under ``base`` (for ``shardpoint ls``)."""
    out = []
    try:
        names = sorted(os.listdir(base))
    except OSError:
        return []
    for n in names:
        try:
            with open(os.path.join(base, n, JOB_FILE), "rb") as f:
                identity = json.loads(f.read())["identity"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        area = JobArea(base, str(identity))
        if os.path.basename(area.dir) == n and area.owned():
            out.append(area)
    return out


def snapshot_rows(root: str, base: str) -> list[dict[str, Any]]:
    """``shardpoint ls`` rows for this user's memory snapshots (on this host, under
    ``base``) of the jobs whose manager root is ``root``: complete ones and torn ones."""
    from datetime import datetime, timezone

    rows: list[dict[str, Any]] = []
    for area in list_jobs(base):
        if area.identity.rsplit("\0root=", 1)[-1] != root:
            continue
        run = area.identity.split("\0", 1)[0].removeprefix("run=")
        done = {s.step: s for s in area.complete()}
        for step in area.steps():
            snap = done.get(step)
            m = snap.manifest if snap is not None else None
            rows.append({
                "step": step, "path": os.path.join(area.dir, step_dir(step)), "tier": f"memory (run {run})",
                "time": datetime.fromtimestamp(m.created, tz=timezone.utc).strftime("%Y-%m-%d %H:%M:%S") if m else None,
                "size": m.own_bytes() if m else None, "referenced": 0 if m else None,
                "world_size": m.world_size if m else None, "status": "committed" if m else "incomplete",
                "latest": False, "nonfinite": m.nonfinite if m else None,
                "unfit": list(HealthRule().unfit(m.nonfinite, m.nan, m.roles)) if m else None,
                "metrics": dict(m.metrics) if m else None})
    return rows
