"""Writing a checkpoint from one process as if N ranks had saved it (converters)."""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from typing import Any

import numpy as np

from ._save import _Plan, build_manifest, check_replicas, describe, write_rank
from .errors import ShardpointError
from .format.manifest import MANIFEST_NAME
from .plan import ChunkTable
from .storage import Storage


def save_offline(rank_states: Iterable[tuple[int, Any]], storage: Storage, *, world_size: int, overwrite: bool = False) -> None:
    """See :func:`shardpoint.api.save_offline`."""
    if storage.exists(MANIFEST_NAME) and not overwrite:
        raise ShardpointError(f"a checkpoint already exists at {storage.url}; pass overwrite=True to replace it")
    save_id = uuid.uuid4().hex[:12]
    metas: list[dict[str, Any] | None] = [None] * world_size
    statuses: list[dict[str, Any] | None] = [None] * world_size
    written: list[str] = []
    seen_boxes: set[tuple[str, tuple[int, ...]]] = set()
    try:
        for rank, state in rank_states:
            if not 0 <= rank < world_size or metas[rank] is not None:
                raise ShardpointError(f"rank {rank} given twice or outside world_size={world_size}")
            local = describe(state, rank)
            rows = local.meta["chunks"]
            n = len(rows["key"])
            # this rank writes the boxes no earlier rank wrote
            writer = np.zeros(n, dtype=bool)
            for i, (k, off) in enumerate(zip(rows["key"], rows["off"])):
                ident = (k, tuple(off) + tuple(rows["size"][i]))
                if ident not in seen_boxes:
                    seen_boxes.add(ident)
                    writer[i] = True
            # every row's CRCs are recorded (the writer's too): whether a later rank holds the
            # same box is not known yet, and check_replicas compares all holders of each box
            plan = _Plan([], {}, {}, {}, [0], ChunkTable(*(np.zeros(0, dtype=np.int64),) * 5), np.arange(n), writer,
                         np.ones(n, dtype=bool))
            fname = f"r{rank:05d}-{save_id}.safetensors"
            st = write_rank(storage, fname, local, plan, 0)
            if st["file"]:
                written.append(fname)
            metas[rank], statuses[rank] = local.meta, st
            del local, state
        if any(m is None for m in metas):
            raise ShardpointError(f"ranks {[r for r, m in enumerate(metas) if m is None]} were never given")
        from ._save import make_plan

        full = make_plan(metas)  # type: ignore[arg-type]
        check_replicas(full, statuses)  # the bytes of every replicated box, compared across its holders  # type: ignore[arg-type]
        manifest = build_manifest(full, metas, statuses, save_id)  # type: ignore[arg-type]
        storage.write_atomic(MANIFEST_NAME, manifest.to_bytes())
    except BaseException:
        for f in written:
            storage.remove(f)
        raise
