"""Commit: the manifest last, and only then is there a checkpoint.

:func:`commit_checkpoint` is the one commit of every path that makes a checkpoint: a
collective save's rank 0 (:func:`commit`, below), the offline converters
(:mod:`.offline`) and the memory tier's drain (:mod:`shardpoint.tiers.drain`). In
order, it refuses a checkpoint in the way, refuses a stale attempt
(:mod:`.fence`), checks that every file the manifest names is there at its size,
writes the manifest (sealed; created only where none is, else replaced atomically),
removes what the replaced checkpoint no longer uses, and points ``latest`` at it
(never back). Retention is the caller's, after it.

:func:`commit` is a collective save's commit round: every rank sends rank 0 its
:class:`~shardpoint.saving.records.WriteStatus` (or the error it hit); rank 0 checks
that replicated bytes agree, builds the manifest and commits it; everyone learns the
outcome. A failure anywhere raises on every rank, which then removes its own files:
no manifest, no checkpoint.
"""

from __future__ import annotations

import warnings
from typing import Any

from ..collective import Comm, coordinate
from ..errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    SaveAbortedError,
    ShardpointError,
)
from ..format.index import index_name
from ..format.manifest import MANIFEST_NAME, Manifest, replaced_files
from ..format.pointer import LATEST, Pointer
from ..load.locate import read_manifest
from ..runtime import PROCESS
from ..storage import Storage
from .coordinator import Coordinator
from .fence import Owner
from .incremental import check_refs
from .records import Planned, SaveOptions, WriteStatus


def exists_error(storage: Storage) -> CheckpointExistsError:
    """The error of every path that finds a checkpoint in its way and may not replace it."""
    return CheckpointExistsError(
        f"a checkpoint already exists at {storage.url}; pass overwrite=True to replace it, or save to a new path")


def commit_checkpoint(storage: Storage, manifest: Manifest, *, replace: bool, owner: Owner | None = None,
                      latest: str | None = None, data: bytes | None = None, what: str = "the commit",
                      check: bool = True) -> None:
    """Make ``manifest`` (its sealed bytes ``data``, else made from it) the checkpoint
    at ``storage``; see the module docstring for the order.

    Args:
        replace: a checkpoint already at ``storage`` may be replaced (its files that the
            new one does not use are removed after the commit); else
            :class:`CheckpointExistsError`. The same checkpoint already committed
            there (the same save id: a drain run again) is left as it is.
        owner: the attempt that owns the manager root holding ``storage``: a newer
            attempt makes this raise :class:`FencedError` before anything is written.
        latest: the step folder (under ``owner.root``) to point ``latest`` at once
            committed; it never moves back to a lower step this same attempt pointed it
            at, nor over a newer attempt's pointer.
        what: how messages name this commit ("the save of step 6").
        check: check the files (off only where they do not all lie at ``storage``:
            a memory snapshot spread over hosts).

    Raises:
        ShardpointError: a file the manifest names is missing or has another size
            (deleted by someone else's retention, say); nothing was committed.
    """
    blob = manifest.to_bytes() if data is None else data
    old: list[str] | None = None  # the replaced checkpoint's files; None: no manifest was there
    if storage.exists(MANIFEST_NAME):
        if not replace:
            raise exists_error(storage)
        there = _replaced(storage)
        if there is not None and there[0] == manifest.save_id:  # committed before: only the pointer
            _point_latest(owner, latest, what)
            return
        old = there[1] if there is not None else []
    PROCESS.seams.fire_phase("before_commit")
    if owner is not None:
        owner.check(what)
    if check:
        check_files(storage, manifest)
    check_refs(storage, manifest.refs)
    if old is not None:
        storage.write_atomic(MANIFEST_NAME, blob)
    elif not storage.create_new(MANIFEST_NAME, blob):  # another writer committed here meanwhile
        if owner is not None:
            owner.check(what)
        raise exists_error(storage)
    PROCESS.seams.fire_phase("committed")
    keep = set(manifest.stored_files())
    for f in old or ():
        if f not in keep:
            try:
                storage.remove(f)
            except Exception:  # noqa: BLE001 - the new checkpoint is committed; a leftover is harmless
                pass
    _point_latest(owner, latest, what)


def _replaced(storage: Storage) -> tuple[str, list[str]] | None:
    """The save id and stored files of the checkpoint at ``storage`` that a commit
    replaces; None when it was removed since the look-up, or is damaged (replaced all
    the same). Its entries are not parsed where the seal vouches for the rest
    (:func:`~shardpoint.format.manifest.replaced_files`)."""
    try:
        data = bytes(storage.read(MANIFEST_NAME))
    except (OSError, ShardpointError):
        return None
    got = replaced_files(data, f"{storage.url}/{MANIFEST_NAME}")
    if got is not None:
        return got
    try:
        there = read_manifest(storage)
    except ShardpointError:
        return None
    return there.save_id, there.stored_files()


def check_files(storage: Storage, manifest: Manifest) -> None:
    """Every data file and index ``manifest`` names is at ``storage`` with the size its
    writer reported (one listing); else raise naming the first that is not."""
    names = [(n, f.size) for n, f in manifest.files.items()]
    names += [(f.index.name, f.index.size) for f in manifest.files.values() if f.index is not None]
    if not names:
        return
    there = storage.sizes()
    for name, size in sorted(names):
        got = there.get(name)
        if got != size:
            state = "is missing" if got is None else f"has {got} bytes, not the {size} its writer wrote"
            raise SaveAbortedError(
                f"{storage.url}/{name} {state}, so the checkpoint was not committed (nothing was written). "
                "Something removed or changed it after it was written: another job or attempt saving into the "
                "same folder (its retention), or a clean-up outside shardpoint. Save again")


def _point_latest(owner: Owner | None, folder: str | None, what: str) -> None:
    """Point ``latest`` under ``owner.root`` at ``folder``: checked against a newer
    attempt first, and never moved back to a lower step this attempt pointed it at."""
    if owner is None or folder is None:
        return
    owner.check(f"pointing latest at {folder} after {what}")
    new = Pointer(folder, owner.generation)
    root = owner.root
    try:
        cur: Pointer | None = Pointer.parse(bytes(root.read(LATEST)), f"{root.url}/{LATEST}", fix="")
    except (CorruptCheckpointError, OSError):
        cur = None  # none yet (a missing file reads as such), or damaged: replaced
    if cur is not None and cur.generation == owner.generation and cur.step > new.step:
        warnings.warn(f"shardpoint: {what} committed {folder}, but {root.url}/{LATEST} stays at {cur.folder}, a "
                      "newer step this attempt saved (latest never moves back within one attempt; restore() "
                      "the step to go back to, which starts a new attempt)", stacklevel=3)
        return
    root.write_atomic(LATEST, new.to_bytes())


def commit(comm: Comm, storage: Storage, planned: Planned, coord: Coordinator | None, fname: str,
           status: WriteStatus | None, error: BaseException | None, options: SaveOptions) -> int | None:
    """The commit round (collective). Raises on every rank if any rank failed (its
    ``error``) or the commit did; a rank's own files are then removed, unless the
    manifest naming them was written (a failure pointing ``latest``). The manifest
    records what any rank found non-finite and rank 0's metrics. Returns, on rank 0,
    the bytes of the checkpoint's own data files (None elsewhere)."""
    total: list[int] = []

    def decide(statuses: list[Any]) -> list[None]:
        assert coord is not None
        records = [WriteStatus.from_wire(s, r) for r, s in enumerate(statuses)]
        manifest = coord.manifest(records)
        for st in records:
            for ref, info in (st.refs or {}).items():
                r = manifest.refs.setdefault(ref, {"size": info["size"], "bytes": 0})
                r["bytes"] += info["bytes"]
        manifest.metrics = {str(k): float(v) for k, v in (options.metrics or {}).items()}
        owner = options.owner() if options.owner is not None else None
        commit_checkpoint(storage, manifest, replace=options.overwrite, owner=owner, latest=options.latest,
                          what=options.what, check=options.check_files)
        total.append(manifest.own_bytes())
        return [None] * comm.world

    def explain() -> BaseException | None:
        """A rank failed: if a newer attempt owns the root, that is why (its retention
        removed this save's folder, say), and what every rank is told."""
        try:
            owner = options.owner() if options.owner is not None else None
            return owner.fenced(options.what) if owner is not None and owner.newer() else None
        except Exception:  # noqa: BLE001 - the ranks' own errors stay
            return None

    try:
        coordinate(comm, status.wire() if status is not None else None, error, decide, explain)
    except BaseException:
        # a failure after the manifest was written (pointing latest) leaves a committed
        # checkpoint: its data must stay
        if _surely_uncommitted(storage, planned.save_id):
            for name in (fname, index_name(fname)):
                try:
                    storage.remove(name)
                except Exception as e:  # noqa: BLE001 - the save's own error is what the caller needs
                    warnings.warn(f"shardpoint: the failed save left {storage.url}/{name} behind ({e}); "
                                  "it is not part of any checkpoint and can be deleted", stacklevel=2)
        raise
    return total[0] if total else None


def _surely_uncommitted(storage: Storage, save_id: str) -> bool:
    """Whether no manifest of save ``save_id`` is at ``storage``: none there, or another
    save's. A manifest that cannot be read now (an object store still failing) might be
    this save's: then its files stay (a leftover is harmless, lost data is not)."""
    try:
        return read_manifest(storage).save_id != save_id
    except CheckpointNotFoundError:
        return True
    except ShardpointError:
        return False
