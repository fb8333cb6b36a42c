"""Commit: rank 0 checks the replicas, writes the manifest last, and only then is
there a checkpoint.

Every rank sends rank 0 its :class:`~shardpoint.saving.records.WriteStatus` (or the
error it hit). Rank 0 checks that replicated bytes agree, checks the earlier data
files an incremental save refers to, writes the manifest (temporary name, rename,
directory fsync), removes the files of the checkpoint it replaced, runs the
caller's ``on_commit`` (the manager's ``latest``), and tells everyone. A failure
anywhere raises on every rank, which then removes its own files: no manifest, no
checkpoint.
"""

from __future__ import annotations

import warnings
from typing import Any

from ..collective import Comm, coordinate
from ..errors import CheckpointNotFoundError, ShardpointError
from ..format.index import index_name
from ..format.manifest import MANIFEST_NAME
from ..load.locate import read_manifest
from ..runtime import PROCESS
from ..storage import Storage
from .coordinator import Coordinator
from .incremental import check_refs
from .records import Planned, SaveOptions, WriteStatus


def commit(comm: Comm, storage: Storage, planned: Planned, coord: Coordinator | None, fname: str,
           status: WriteStatus | None, error: BaseException | None, options: SaveOptions) -> None:
    """The commit round (collective). Raises on every rank if any rank failed (its
    ``error``) or the commit did; a rank's own files are then removed, unless the
    manifest naming them was written (a failure in ``options.on_commit``). The
    manifest records the keys any rank found non-finite and rank 0's metrics."""

    def decide(statuses: list[Any]) -> list[None]:
        assert coord is not None
        records = [WriteStatus.from_wire(s, r) for r, s in enumerate(statuses)]
        old: list[str] = []
        if planned.existed:
            try:
                old = read_manifest(storage).stored_files()
            except ShardpointError:
                old = []
        manifest = coord.manifest(records)
        for st in records:
            for ref, info in (st.refs or {}).items():
                r = manifest.refs.setdefault(ref, {"size": info["size"], "bytes": 0})
                r["bytes"] += info["bytes"]
        check_refs(storage, manifest.refs)
        manifest.nonfinite = sorted({k for st in records for k in st.nonfinite})
        manifest.metrics = {str(k): float(v) for k, v in (options.metrics or {}).items()}
        PROCESS.seams.fire_phase("before_commit")
        storage.write_atomic(MANIFEST_NAME, manifest.to_bytes())
        PROCESS.seams.fire_phase("committed")
        keep = set(manifest.stored_files())
        for f in old:
            if f not in keep:
                try:
                    storage.remove(f)
                except Exception:  # noqa: BLE001 - the new checkpoint is committed; a leftover is harmless
                    pass
        if options.on_commit is not None:
            options.on_commit()
        return [None] * comm.world

    try:
        coordinate(comm, status.wire() if status is not None else None, error, decide)
    except BaseException:
        # a failure after the manifest was written (in on_commit) leaves a committed
        # checkpoint: its data must stay
        if _surely_uncommitted(storage, planned.save_id):
            for name in (fname, index_name(fname)):
                try:
                    storage.remove(name)
                except Exception as e:  # noqa: BLE001 - the save's own error is what the caller needs
                    warnings.warn(f"shardpoint: the failed save left {storage.url}/{name} behind ({e}); "
                                  "it is not part of any checkpoint and can be deleted", stacklevel=2)
        raise


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
