"""Save planning: check that the chunks of every tensor tile it, find replicas,
and pick one writer per distinct chunk so that replicated bytes are written once
and the bytes each rank writes are balanced.

Everything is arrays: one row per (rank, chunk). Planning 1,024 ranks x 2,000
sharded tensors (two million rows) takes well under a second.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .boxes import grid_cells

#: Cells a per-tensor grid check may allocate before falling back to a pairwise check.
_GRID_CELL_LIMIT = 1 << 22


class PlanError(ValueError):
    """The chunks do not form a valid layout. ``problems`` maps key id -> reason."""

    def __init__(self, problems: dict[int, str]) -> None:
        super().__init__("; ".join(f"key {k}: {v}" for k, v in sorted(problems.items())))
        self.problems = problems


@dataclass(slots=True)
class ChunkTable:
    """One row per chunk held by a rank. ``offsets``/``sizes`` are (n, D) with D the
    largest tensor rank; a tensor of lower rank pads trailing dims with offset 0,
    size 1 (and its shape with 1)."""

    key: np.ndarray  # int64 (n,)  index into the key list
    rank: np.ndarray  # int64 (n,)
    offsets: np.ndarray  # int64 (n, D)
    sizes: np.ndarray  # int64 (n, D)
    itemsize: np.ndarray  # int64 (n,)  bytes per element

    def __len__(self) -> int:
        return int(self.key.shape[0])

    @property
    def nbytes(self) -> np.ndarray:
        return _row_prod(self.sizes) * self.itemsize


def _row_prod(a: np.ndarray) -> np.ndarray:
    """``np.prod(a, axis=1)`` for a narrow (n, D) array: column by column, several
    times faster than a reduction along the short axis."""
    out = a[:, 0].copy() if a.shape[1] else np.ones(a.shape[0], dtype=a.dtype)
    for d in range(1, a.shape[1]):
        out *= a[:, d]
    return out


@dataclass(slots=True)
class Writers:
    """The result of :func:`choose_writers`."""

    group: np.ndarray  # int64 (n,) distinct-chunk id of each row; rows with one id are replicas
    writer: np.ndarray  # bool (n,) True for the one row of each group that writes its bytes
    replicated: np.ndarray  # bool (n,) True where the row's group has more than one holder
    bytes_per_rank: np.ndarray  # int64 (world,) bytes each rank writes


def _box_codes(t: ChunkTable, shapes: np.ndarray) -> np.ndarray | None:
    """One int64 per row that is equal exactly when two rows of the same key hold
    the same box: offsets and sizes in mixed radix (shape + 1 per digit). None when
    some key's boxes need more than 62 bits (then rows are compared column by column)."""
    radix = shapes + 1
    if np.log2(radix.astype(np.float64)).sum(axis=1).max(initial=0.0) * 2 > 62:
        return None
    r = radix[t.key]
    code = np.zeros(len(t), dtype=np.int64)
    for d in range(t.offsets.shape[1]):
        code = (code * r[:, d] + t.offsets[:, d]) * r[:, d] + t.sizes[:, d]
    return code


def _group_rows(t: ChunkTable, shapes: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Group identical (key, box) rows. Returns (order, group id per row, first row
    of each group). Groups are numbered in (key, box) order, the box ordered by its
    dim-0 offset first."""
    code = _box_codes(t, shapes)
    spans = [math.prod((int(x) + 1) ** 2 for x in shp) for shp in shapes.tolist()] if code is not None else []
    if code is not None and sum(spans) < 1 << 62:  # one sort key: the keys' code ranges one after another
        base = np.concatenate([[0], np.cumsum(np.asarray(spans, dtype=np.int64))])
        cols = [base[t.key] + code]
    elif code is not None:  # two sort keys instead of 1 + 2 x ndim
        cols = [t.key, code]
    else:
        cols = [t.key] + [t.offsets[:, d] for d in range(t.offsets.shape[1])] + [
            t.sizes[:, d] for d in range(t.sizes.shape[1])
        ]
    order = np.argsort(cols[0], kind="stable") if len(cols) == 1 else np.lexsort(cols[::-1])
    n = len(t)
    if n == 0:
        return order, np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    new = np.zeros(n, dtype=bool)
    new[0] = True
    for c in cols:
        cs = c[order]
        new[1:] |= cs[1:] != cs[:-1]
    gid_sorted = np.cumsum(new) - 1
    group = np.empty(n, dtype=np.int64)
    group[order] = gid_sorted
    # lexsort is stable: the first row of a group in sorted order is its lowest row
    return order, group, order[new]


def choose_writers(t: ChunkTable, shapes: np.ndarray, world_size: int) -> Writers:
    """Validate the layout and choose writers.

    Args:
        t: every rank's chunks.
        shapes: (K, D) global shape of each key, padded with 1.
        world_size: number of ranks.

    Raises:
        PlanError: a chunk lies outside its tensor, two different chunks overlap, or
            part of a tensor is held by no rank.
    """
    n = len(t)
    if n:
        lim = shapes[t.key]
        if t.offsets.min() < 0 or t.sizes.min() < 0 or (t.offsets + t.sizes > lim).any():
            bad = np.any((t.offsets < 0) | (t.sizes < 0) | (t.offsets + t.sizes > lim), axis=1)
            raise PlanError({int(k): "a chunk lies outside the tensor's global shape" for k in np.unique(t.key[bad])})
    order, group, first = _group_rows(t, shapes)  # first: one representative row per group, in group order
    counts = np.bincount(group, minlength=len(first))
    replicated = counts[group] > 1
    validate_partition(t.key[first], t.offsets[first], t.sizes[first], shapes)

    nbytes = t.nbytes
    writer = np.zeros(n, dtype=bool)
    single = ~replicated
    writer[single] = True
    load = np.bincount(t.rank[single], weights=nbytes[single], minlength=world_size).astype(np.int64)
    rep_groups = np.unique(group[replicated])
    if rep_groups.size:
        # rows of replicated groups, sorted by group
        rows = order[replicated[order]]  # by group, then row (order is a stable sort)
        g_of_rows = group[rows]
        starts = np.searchsorted(g_of_rows, rep_groups)
        ends = np.searchsorted(g_of_rows, rep_groups, side="right")
        gbytes = nbytes[rows[starts]]
        # largest first onto the least-loaded holder (deterministic: ties to lowest rank);
        # sequential by nature, so on Python lists (a numpy call per group is 10x slower)
        row_l, rank_l = rows.tolist(), t.rank[rows].tolist()
        start_l, end_l, bytes_l = starts.tolist(), ends.tolist(), gbytes.tolist()
        load_l = load.tolist()
        chosen = []
        w = world_size
        for i in np.argsort(-gbytes, kind="stable").tolist():
            a, b = start_l[i], end_l[i]
            holders = rank_l[a:b]
            r = min([load_l[q] * w + q for q in holders]) % w  # least load, then lowest rank
            chosen.append(row_l[a + holders.index(r)])
            load_l[r] += bytes_l[i]
        writer[np.asarray(chosen, dtype=np.int64)] = True
        load = np.asarray(load_l, dtype=np.int64)
    return Writers(group=group, writer=writer, replicated=replicated, bytes_per_rank=load)


def validate_partition(keys: np.ndarray, offsets: np.ndarray, sizes: np.ndarray, shapes: np.ndarray) -> None:
    """Check that the distinct boxes of every key tile its tensor exactly: no gap,
    no overlap. Raises :class:`PlanError` naming the keys that fail."""
    problems: dict[int, str] = {}
    vol = _row_prod(sizes)
    nonempty = vol > 0
    if not nonempty.all():
        keys, offsets, sizes, vol = keys[nonempty], offsets[nonempty], sizes[nonempty], vol[nonempty]
    nkeys = shapes.shape[0]
    want = np.prod(shapes, axis=1)
    have = np.bincount(keys, weights=vol.astype(np.float64), minlength=nkeys)
    for k in np.nonzero(have < want)[0]:
        problems[int(k)] = "part of the tensor is held by no rank (the chunks leave a gap)"
    # fast path, vectorised over all keys: boxes that differ only along dim 0
    full_rest = np.ones(len(keys), dtype=bool)
    for d in range(1, offsets.shape[1]):
        full_rest &= (offsets[:, d] == 0) & (sizes[:, d] == shapes[keys, d])
    row_keys_all = np.bincount(keys, weights=(~full_rest).astype(np.float64), minlength=nkeys) == 0
    rows = row_keys_all[keys]
    if rows.any():
        k, o, s = keys[rows], offsets[rows, 0], sizes[rows, 0]
        # choose_writers passes rows in (key, dim-0 offset) order already: sort only when not
        if not (k.size < 2 or np.all((k[1:] > k[:-1]) | ((k[1:] == k[:-1]) & (o[1:] >= o[:-1])))):
            idx = np.lexsort((o, k))
            k, o, s = k[idx], o[idx], s[idx]
        e = o + s
        same = k[1:] == k[:-1]
        overlap = same & (o[1:] < e[:-1])
        for kk in np.unique(k[1:][overlap]):
            problems.setdefault(int(kk), "two different chunks overlap")
    # general keys: rasterise onto the grid of all cut points (exact), pairwise if huge
    other = np.nonzero(~row_keys_all & (np.bincount(keys, minlength=nkeys) > 0))[0]
    if other.size:
        idx = np.arange(len(keys)) if np.all(keys[1:] >= keys[:-1]) else np.argsort(keys, kind="stable")
        ks = keys[idx]
        for k in other:
            lo, hi = np.searchsorted(ks, k), np.searchsorted(ks, k, side="right")
            sel = idx[lo:hi]
            reason = _check_key(offsets[sel], sizes[sel], shapes[k])
            if reason:
                problems.setdefault(int(k), reason)
    if problems:
        raise PlanError(problems)


def _is_grid(off: np.ndarray, size: np.ndarray, shape: np.ndarray) -> bool:
    """Whether the boxes are exactly the cells of one grid over the whole tensor (the
    common case, DTensor on a 2-D mesh): then they tile it. Cheap: a sort per dim."""
    grid = grid_cells(off, size)
    return grid is not None and all(c[0] == 0 and c[-1] == n for c, n in zip(grid[0], shape.tolist()))


def _check_key(off: np.ndarray, size: np.ndarray, shape: np.ndarray) -> str | None:
    if _is_grid(off, size, shape):
        return None
    end = off + size
    cuts = [np.unique(np.concatenate([off[:, d], end[:, d], [0, shape[d]]])) for d in range(off.shape[1])]
    cells = 1
    for c in cuts:
        cells *= len(c) - 1
    if cells <= _GRID_CELL_LIMIT:
        lo = np.stack([np.searchsorted(cuts[d], off[:, d]) for d in range(off.shape[1])], axis=1)
        hi = np.stack([np.searchsorted(cuts[d], end[:, d]) for d in range(off.shape[1])], axis=1)
        grid_shape = tuple(len(c) for c in cuts)  # one extra cell per dim for the difference array
        nd = off.shape[1]
        # a difference array: +1/-1 at the corners of every box (bincount: far faster than np.add.at)
        flat_idx, signs = [], []
        for corner in range(1 << nd):
            pick = [(corner >> d) & 1 for d in range(nd)]
            coords = tuple(np.where(pick[d], hi[:, d], lo[:, d]) for d in range(nd))
            flat_idx.append(np.ravel_multi_index(coords, grid_shape))
            signs.append(np.full(len(off), -1 if sum(pick) % 2 else 1, dtype=np.int64))
        cells_total = int(np.prod(grid_shape))
        diff = np.bincount(np.concatenate(flat_idx), weights=np.concatenate(signs), minlength=cells_total)
        cover = np.rint(diff).astype(np.int64).reshape(grid_shape)
        for d in range(nd):
            cover = np.cumsum(cover, axis=d)
        cover = cover[tuple(slice(0, len(c) - 1) for c in cuts)]
        if (cover > 1).any():
            return "two different chunks overlap"
        if (cover < 1).any():
            return "part of the tensor is held by no rank (the chunks leave a gap)"
        return None
    # pairwise, in blocks
    n = off.shape[0]
    for i in range(0, n, 1024):
        a_lo, a_hi = off[i : i + 1024, None, :], end[i : i + 1024, None, :]
        inter = np.all((np.maximum(a_lo, off[None]) < np.minimum(a_hi, end[None])), axis=2)
        ii = np.arange(i, min(i + 1024, n))
        inter[np.arange(len(ii)), ii] = False
        if inter.any():
            return "two different chunks overlap"
    return None
