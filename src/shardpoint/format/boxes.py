"""Boxes: axis-aligned regions of a global tensor, as (offsets, sizes). Pure; the
format's layouts (grid, flat ranges) are made of them and the planner uses them."""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np


class Box(NamedTuple):
    """A region of a global tensor: ``offsets[d] <= i_d < offsets[d] + sizes[d]``.
    A NamedTuple (made, hashed and compared in C): a load makes and looks up a few per
    tensor."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    @property
    def numel(self) -> int:
        n = 1
        for s in self.sizes:
            n *= s
        return n

    def within(self, shape: tuple[int, ...]) -> bool:
        return len(shape) == len(self.offsets) and all(
            o >= 0 and s >= 0 and o + s <= d for o, s, d in zip(self.offsets, self.sizes, shape)
        )


def intersect(a: Box, b: Box) -> Box | None:
    """The overlap of two boxes of the same tensor, or None when it is empty."""
    offs, sizes = [], []
    for ao, as_, bo, bs in zip(a.offsets, a.sizes, b.offsets, b.sizes):
        lo, hi = max(ao, bo), min(ao + as_, bo + bs)
        if hi <= lo:
            return None
        offs.append(lo)
        sizes.append(hi - lo)
    return Box(tuple(offs), tuple(sizes))


def box_runs(region: Box, within: Box) -> tuple[int, int, int, int]:
    """Describe where ``region`` lies in the row-major layout of ``within``.

    Returns ``(first, last, run, count)`` in elements: the element offset of the first
    and one past the last element of ``region`` inside ``within``, the length of a
    contiguous run, and the number of runs. When ``count == 1`` the region is one
    contiguous range.
    """
    nd = len(within.sizes)
    if nd == 0:
        return 0, 1, 1, 1
    rel = [r - w for r, w in zip(region.offsets, within.offsets)]
    strides = [1] * nd
    for d in range(nd - 2, -1, -1):
        strides[d] = strides[d + 1] * within.sizes[d + 1]
    first = sum(o * s for o, s in zip(rel, strides))
    last = sum((o + n - 1) * s for o, n, s in zip(rel, region.sizes, strides)) + 1
    # the innermost dims that the region spans completely merge into one run
    run = 1
    d = nd - 1
    while d >= 0 and region.sizes[d] == within.sizes[d]:
        run *= within.sizes[d]
        d -= 1
    if d >= 0:
        run *= region.sizes[d]
    count = region.numel // run if run else 0
    return first, last, run, count


def flat_range_boxes(shape: tuple[int, ...], start: int, stop: int) -> list[Box]:
    """Split the element range ``[start, stop)`` of the row-major flattening of a
    tensor of ``shape`` into the few boxes it is made of (at most 2 per dimension
    plus one), in order. Used for ZeRO-style flat partitions."""
    nd = len(shape)
    if stop <= start:
        return []
    if nd == 0:
        return [Box((), ())]
    out: list[Box] = []

    def rec(prefix: tuple[int, ...], dim: int, lo: int, hi: int) -> None:
        # [lo, hi) is relative to the sub-tensor at `prefix` (shape[dim:])
        ones = (1,) * len(prefix)
        inner = 1
        for s in shape[dim + 1 :]:
            inner *= s
        if dim == nd - 1:
            out.append(Box(prefix + (lo,), ones + (hi - lo,)))
            return
        first_row, last_row = lo // inner, (hi - 1) // inner
        tail = tuple(0 for _ in shape[dim + 1 :])
        full = tuple(shape[dim + 1 :])
        if lo % inner == 0 and hi % inner == 0:
            out.append(Box(prefix + (first_row,) + tail, ones + (last_row - first_row + 1,) + full))
            return
        if first_row == last_row:
            rec(prefix + (first_row,), dim + 1, lo - first_row * inner, hi - first_row * inner)
            return
        mid_lo = first_row
        if lo % inner:
            rec(prefix + (first_row,), dim + 1, lo - first_row * inner, inner)
            mid_lo = first_row + 1
        mid_hi = last_row + 1 if hi % inner == 0 else last_row
        if mid_hi > mid_lo:
            out.append(Box(prefix + (mid_lo,) + tail, ones + (mid_hi - mid_lo,) + full))
        if hi % inner:
            rec(prefix + (last_row,), dim + 1, 0, hi - last_row * inner)

    rec((), 0, start, stop)
    return out


def grid_cells(offsets: np.ndarray, sizes: np.ndarray) -> tuple[list[np.ndarray], np.ndarray] | None:
    """When the ``m`` boxes (``(m, ndim)`` arrays) are exactly the cells of one grid,
    whose cuts are each dimension's box starts and its largest end: the cuts of each
    dimension and each box's row-major cell number; else None. Each box must end at
    the next cut, and ``m`` boxes must fill ``m`` distinct cells."""
    m, nd = offsets.shape
    cuts, idx, counts = [], [], []
    for d in range(nd):
        o, s = offsets[:, d], sizes[:, d]
        if o.any():
            srt = np.sort(o)
            c = np.append(srt[np.concatenate(([True], srt[1:] != srt[:-1]))], (o + s).max())
        else:
            c = np.array([0, s.max()], dtype=np.int64)
        i = np.searchsorted(c, o)
        if not np.array_equal(c[i + 1] - c[i], s):  # each box ends at the next cut
            return None
        cuts.append(c)
        idx.append(i)
        counts.append(len(c) - 1)
    if math.prod(counts) != m:
        return None
    cell = np.ravel_multi_index(idx, counts) if nd else np.zeros(m, dtype=np.int64)
    seen = np.zeros(m, dtype=bool)
    seen[cell] = True
    return (cuts, cell) if seen.all() else None
