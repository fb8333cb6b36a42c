"""Writing a checkpoint from one process as if N ranks had saved it (converters)."""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from typing import Any

import numpy as np

from ._coordinator import build_manifest, check_replicas, layout_of, make_plan, values_of
from ._save import _Local, data_file, describe, write_rank
from .errors import ShardpointError
from .format.index import index_name
from .format.manifest import MANIFEST_NAME
from .storage import Storage


def save_offline(rank_states: Iterable[tuple[int, Any]], storage: Storage, *, world_size: int, overwrite: bool = False) -> None:
    """See :func:`shardpoint.api.save_offline`."""
    if storage.exists(MANIFEST_NAME) and not overwrite:
        raise ShardpointError(f"a checkpoint already exists at {storage.url}; pass overwrite=True to replace it")
    save_id = uuid.uuid4().hex[:12]
    metas: list[dict[str, Any] | None] = [None] * world_size
    statuses: list[dict[str, Any] | None] = [None] * world_size
    writers: list[np.ndarray | None] = [None] * world_size
    written: list[str] = []
    seen_boxes: set[tuple[str, tuple[int, ...]]] = set()
    try:
        for rank, state in rank_states:
            if not 0 <= rank < world_size or metas[rank] is not None:
                raise ShardpointError(f"rank {rank} given twice or outside world_size={world_size}")
            local: _Local | None = describe(state, rank)
            assert local is not None
            rows = local.meta["chunks"]
            n = len(rows["key"])
            # this rank writes the non-empty boxes no earlier rank wrote, and reports the
            # checksums of every box so that replicas are compared once all ranks are seen
            writer = np.zeros(n, dtype=bool)
            for i, (k, off, size) in enumerate(zip(rows["key"], rows["off"], rows["size"])):
                ident = (k, tuple(off) + tuple(size))
                if all(s > 0 for s in size) and ident not in seen_boxes:
                    seen_boxes.add(ident)
                    writer[i] = True
            nonempty = [[i, i + 1] for i, size in enumerate(rows["size"]) if all(s > 0 for s in size)]
            fname = data_file(rank, save_id)
            written += [fname, index_name(fname)]
            st = write_rank(storage, fname, local, {"write": [[i, i + 1] for i in np.nonzero(writer)[0].tolist()],
                                                     "check": nonempty})
            metas[rank], statuses[rank], writers[rank] = local.meta, st, writer
            del local, state
        if any(m is None for m in metas):
            raise ShardpointError(f"ranks {[r for r, m in enumerate(metas) if m is None]} were never given")
        plan = make_plan([layout_of(m) for m in metas])  # type: ignore[arg-type]
        plan.writer = np.concatenate(writers) if writers else plan.writer  # type: ignore[arg-type]
        check_replicas(plan, statuses)  # type: ignore[arg-type]
        manifest = build_manifest(plan, [values_of(m) for m in metas], statuses, save_id)  # type: ignore[arg-type, misc]
        storage.write_atomic(MANIFEST_NAME, manifest.to_bytes())
    except BaseException:
        for f in written:
            storage.remove(f)
        raise
