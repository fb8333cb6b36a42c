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


#: Saved chunks from which a target is intersected with all of them at once, in arrays
#: (below it, box by box in Python is faster than making the arrays).
ARRAY_MIN = 32


def plan_reads(saved: list[Box], targets: list[Box]) -> list[ReadOp]:
    """Intersect every target box with every saved chunk box of one tensor (with many
    chunks, a target against all of them in one array operation: only the chunks it
    overlaps cost Python work). The operations of a target follow the saved order.

    Raises :class:`~shardpoint.plan.save.PlanError` (a ``ValueError``) when part of a target is covered by no saved chunk (the
    caller turns that into a named error)."""
    ops: list[ReadOp] = []
    same = {b: i for i, b in enumerate(saved)} if len(saved) > 1 else {}
    arrays = _arrays(saved) if len(saved) >= ARRAY_MIN else None
    for ti, t in enumerate(targets):
        if t.numel == 0:
            continue
        si = same.get(t, 0 if len(saved) == 1 and saved[0] == t else -1)
        if si >= 0:  # the target is a saved chunk: all of it, one range (same world size, same layout)
            ops.append(ReadOp(si, ti, t, 0, t.numel, 1))
            continue
        if arrays is not None and t.offsets:
            got = _overlaps(t, arrays)
            ops += [ReadOp(si, ti, r, first, last, count) for si, r, first, last, count in got]
            covered = sum(r.numel for _si, r, _f, _l, _c in got)
        else:
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


class _Saved(NamedTuple):
    """Saved boxes as arrays, ``(n, ndim)`` each: first corners, one-past-last corners,
    sizes, and each box's row-major strides."""

    lo: np.ndarray
    hi: np.ndarray
    sizes: np.ndarray
    strides: np.ndarray


def _arrays(boxes: list[Box]) -> _Saved:
    lo = np.array([b.offsets for b in boxes], dtype=np.int64).reshape(len(boxes), -1)
    sizes = np.array([b.sizes for b in boxes], dtype=np.int64).reshape(len(boxes), -1)
    strides = np.ones_like(sizes)
    if sizes.shape[1] > 1:
        strides[:, :-1] = np.cumprod(sizes[:, :0:-1], axis=1)[:, ::-1]
    return _Saved(lo, lo + sizes, sizes, strides)


def _overlaps(t: Box, saved: _Saved) -> list[tuple[int, Box, int, int, int]]:
    """``(index, overlap, first, last, runs)`` of every saved box that overlaps ``t``,
    in the saved order: what :func:`~shardpoint.format.boxes.box_runs` says of each
    overlap, computed for all of them at once."""
    t_lo = np.array(t.offsets, dtype=np.int64)
    lo = np.maximum(saved.lo, t_lo)
    hi = np.minimum(saved.hi, t_lo + np.array(t.sizes, dtype=np.int64))
    hit = np.flatnonzero((hi > lo).all(axis=1))
    lo, n = lo[hit], hi[hit] - lo[hit]
    size, strides = saved.sizes[hit], saved.strides[hit]
    rel = lo - saved.lo[hit]
    first = (rel * strides).sum(axis=1)
    last = ((rel + n - 1) * strides).sum(axis=1) + 1
    # a contiguous run: the innermost dims the overlap spans whole, times the next one's extent
    run = np.ones(len(hit), dtype=np.int64)
    going = np.ones(len(hit), dtype=bool)
    for d in range(n.shape[1] - 1, -1, -1):
        run = np.where(going, run * n[:, d], run)
        going &= n[:, d] == size[:, d]
    count = n.prod(axis=1) // run
    return [(si, Box(tuple(o), tuple(k)), f, e, c) for si, o, k, f, e, c in
            zip(hit.tolist(), lo.tolist(), n.tolist(), first.tolist(), last.tolist(), count.tolist())]


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
