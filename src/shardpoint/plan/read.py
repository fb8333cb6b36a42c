"""Read planning: which byte ranges of which saved chunks a rank needs to fill
its target boxes. Pure: boxes in, typed read operations out."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ..format.boxes import Box, box_runs, intersect
from .save import PlanError, validate_partition


class ReadOp(NamedTuple):
    """Copy ``region`` (global coordinates) from saved chunk ``source`` into target
    ``target``. ``first``/``last`` are the element offsets of the region's span in the
    saved chunk's row-major layout; ``runs`` is how many contiguous runs the region
    is there (1: one byte range)."""

    source: int
    target: int
    region: Box
    first: int
    last: int
    runs: int


def plan_reads(saved: list[Box], targets: list[Box]) -> list[ReadOp]:
    """Intersect every target box with every saved chunk box of one tensor.

    Raises :class:`~shardpoint.plan.save.PlanError` (a ``ValueError``) when part of a target is covered by no saved chunk (the
    caller turns that into a named error)."""
    ops: list[ReadOp] = []
    same = {b: i for i, b in enumerate(saved)} if len(saved) > 1 else {}
    for ti, t in enumerate(targets):
        if t.numel == 0:
            continue
        si = same.get(t, 0 if len(saved) == 1 and saved[0] == t else -1)
        if si >= 0:  # the target is a saved chunk: all of it, one range (same world size, same layout)
            ops.append(ReadOp(si, ti, t, 0, t.numel, 1))
            continue
        covered = 0
        for si, s in enumerate(saved):
            r = intersect(s, t)
            if r is None or r.numel == 0:
                continue
            first, last, _run, count = box_runs(r, s)
            ops.append(ReadOp(si, ti, r, first, last, count))
            covered += r.numel
        if covered < t.numel:
            raise PlanError({ti: f"target box {t} is only partly covered by the saved chunks"})
    return ops


def tiling_problem(boxes: list[Box], shape: tuple[int, ...]) -> str | None:
    """Why ``boxes`` do not tile a tensor of ``shape`` exactly (overlap, gap, outside
    it), or None when they do."""
    if len(boxes) <= 1:
        return None
    nd = max(len(shape), 1)

    def pad(x: tuple[int, ...], v: int) -> list[int]:
        return list(x) + [v] * (nd - len(x))

    try:
        validate_partition(
            np.zeros(len(boxes), dtype=np.int64),
            np.array([pad(b.offsets, 0) for b in boxes], dtype=np.int64),
            np.array([pad(b.sizes, 1) for b in boxes], dtype=np.int64),
            np.array([pad(shape, 1)], dtype=np.int64),
        )
    except PlanError as e:
        return str(e.problems[0])
    return None
