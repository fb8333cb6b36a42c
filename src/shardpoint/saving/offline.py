"""The save pipeline driven from one process for N simulated ranks (converters).

Each rank's state is described, staged in place and written by the same stages a
collective save runs, one rank at a time (only one rank's state is held at once);
the assignment is decided here instead of by a round trip: a rank writes the
non-empty boxes no earlier rank wrote, and reports the checksums of all of them,
so replicas are compared once every rank was seen. Then the plan, the replica
check and the commit (:func:`.commit.commit_checkpoint`, the one every path uses).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from typing import Any

import numpy as np

from ..errors import UsageError
from ..format.index import index_name
from ..format.manifest import MANIFEST_NAME
from ..plan import placement
from ..storage import Storage
from .commit import commit_checkpoint, exists_error
from .coordinator import build_manifest, check_replicas, make_plan
from .describe import data_file, describe
from .records import Assignment, RankLayout, RankValues, WriteStatus
from .stage import Stage
from .write import write


def save_ranks(rank_states: Iterable[tuple[int, Any]], storage: Storage, *, world_size: int, overwrite: bool = False) -> None:
    """See :func:`shardpoint.api.save_offline`."""
    if not overwrite and storage.exists(MANIFEST_NAME):  # before any data is written
        raise exists_error(storage)
    save_id = uuid.uuid4().hex[:12]
    layouts: list[RankLayout | None] = [None] * world_size
    values: list[RankValues] = [{"values": {}, "per_rank": {}}] * world_size
    statuses: list[WriteStatus | None] = [None] * world_size
    writers: list[np.ndarray] = [np.zeros(0, dtype=bool)] * world_size
    written: list[str] = []
    seen_boxes: set[tuple[str, tuple[int, ...]]] = set()
    try:
        for rank, state in rank_states:
            if not 0 <= rank < world_size or layouts[rank] is not None:
                raise UsageError(f"rank {rank} given twice or outside world_size={world_size}")
            described = describe(state)
            rows = described.rows
            writer = np.zeros(len(rows.keys), dtype=bool)
            nonempty = []
            for i, (k, off, size) in enumerate(zip(rows.keys, rows.offsets, rows.sizes)):
                if all(s > 0 for s in size):
                    nonempty.append((i, i + 1))
                    ident = (k, tuple(off) + tuple(size))
                    if ident not in seen_boxes:
                        seen_boxes.add(ident)
                        writer[i] = True
            assignment = Assignment(tuple((i, i + 1) for i in np.nonzero(writer)[0].tolist()), tuple(nonempty))
            fname = data_file(rank, save_id)
            written += [fname, index_name(fname)]
            statuses[rank] = write(storage, fname, Stage(described, assignment).in_place(), None)
            layouts[rank], values[rank], writers[rank] = described.layout(), described.value_message(), writer
            del described, state
        absent = [r for r, m in enumerate(layouts) if m is None]
        if absent:
            raise UsageError(f"ranks {absent} were never given; give every rank of world_size={world_size} once")
        plan = make_plan([m for m in layouts if m is not None])
        if writers:  # each box written where it was first met: the manifest names those writers
            plan.writer = np.concatenate(writers)
            plan.placement = placement(plan.table, plan.group, plan.writer, len(plan.keys))
        done = [s for s in statuses if s is not None]
        check_replicas(plan, done)
        commit_checkpoint(storage, build_manifest(plan, values, done, save_id), replace=overwrite)
    except BaseException:
        for f in written:
            storage.remove(f)
        raise

