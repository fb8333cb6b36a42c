"""Save planning: check that the chunks of every tensor tile it, find replicas,
and pick one writer per distinct chunk so that replicated bytes are written once
and the bytes each rank writes are balanced.

Everything is arrays: one row per (rank, chunk). A table that is a grid of ranks by
keys (every rank holds each tensor once: FSDP, HSDP, TP) is planned once per distinct
column and spread over the rows (:mod:`.grid`): a few passes over 16 million rows at
8,192 ranks x 2,000 tensors instead of sorting them. Any other table is planned row
by row. Both give the same plan (``tests/test_plan_grid.py`` holds them to the
sequential definition).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..errors import UsageError
from . import balance
from .boxes import grid_cells
from .grid import Grid, find_grid, spread
from .table import ChunkTable, row_prod

#: Cells a per-tensor grid check may allocate before falling back to a pairwise check.
_GRID_CELL_LIMIT = 1 << 22


class PlanError(UsageError):
    """The chunks do not form a valid layout. ``problems`` maps key id -> reason. A
    :class:`~shardpoint.errors.UsageError` (so a ``ValueError``): the save turns it into
    a message naming the keys; a caller of the pure planners may meet it as it is."""

    def __init__(self, problems: dict[int, str]) -> None:
        super().__init__("; ".join(f"key {k}: {v}" for k, v in sorted(problems.items())))
        self.problems = problems


@dataclass(slots=True)
class Placement:
    """Each distinct non-empty box and the rank that writes it, in (key, box) order:
    what a manifest lists. A key whose list would repeat another's (keys of one pattern
    on a grid: the same shape, boxes and writers) has no rows and names that key in
    ``same_as``."""

    key: np.ndarray  # int64 (m,)
    offsets: np.ndarray  # int64 (m, D)
    sizes: np.ndarray  # int64 (m, D)
    rank: np.ndarray  # int64 (m,) the writer
    same_as: np.ndarray  # int64 (keys,) the key whose rows describe each key (most often itself)


@dataclass(slots=True)
class Writers:
    """The result of :func:`choose_writers`."""

    group: np.ndarray  # int64 (n,) distinct-chunk id of each row; rows with one id are replicas
    writer: np.ndarray  # bool (n,) True for the one row of each group that writes its bytes
    replicated: np.ndarray  # bool (n,) True where the row's group has more than one holder
    bytes_per_rank: np.ndarray  # int64 (world,) bytes each rank writes
    placement: Placement  # the writing rows of non-empty boxes, for the manifest


def placement(t: ChunkTable, group: np.ndarray, writer: np.ndarray, nkeys: int) -> Placement:
    """The :class:`Placement` of the writing rows of ``t`` (one per group), row by row."""
    w = np.nonzero(writer & nonempty_rows(t.sizes))[0]
    pos = np.full(int(group.max(initial=-1)) + 1, -1, dtype=np.int64)
    pos[group[w]] = w
    w = pos[pos >= 0]  # by group: (key, box) order
    return Placement(t.key[w].astype(np.int64), t.offsets[w], t.sizes[w], t.rank[w].astype(np.int64),
                     np.arange(nkeys, dtype=np.int64))


def nonempty_rows(sizes: np.ndarray) -> np.ndarray:
    """Whether each (n, D) box holds an element: column by column (as :func:`_row_prod`)."""
    out = np.ones(sizes.shape[0], dtype=bool)
    for d in range(sizes.shape[1]):
        out &= sizes[:, d] > 0
    return out


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
    """Validate the layout and choose writers: one row of each group of equal (key,
    box) rows writes; replicated groups go largest first to their least-loaded holder
    (ties to the lowest rank), after every rank's unreplicated bytes.

    Args:
        t: every rank's chunks.
        shapes: (K, D) global shape of each key, padded with 1.
        world_size: number of ranks.

    Raises:
        PlanError: a chunk lies outside its tensor, two different chunks overlap, or
            part of a tensor is held by no rank.
    """
    grid = find_grid(t, shapes, world_size)
    return _choose_by_rows(t, shapes, world_size) if grid is None else _choose_on_grid(t, shapes, world_size, grid)


def _outside(keys: np.ndarray, offsets: np.ndarray, sizes: np.ndarray, shapes: np.ndarray) -> list[int]:
    """The keys that have a chunk outside their tensor's global shape."""
    if not len(keys):
        return []
    lim = shapes[keys]
    if offsets.min() >= 0 and sizes.min() >= 0 and not (offsets + sizes > lim).any():
        return []
    bad = np.any((offsets < 0) | (sizes < 0) | (offsets + sizes > lim), axis=1)
    return np.unique(keys[bad]).tolist()


_OUTSIDE = "a chunk lies outside the tensor's global shape"


def _choose_by_rows(t: ChunkTable, shapes: np.ndarray, world_size: int) -> Writers:
    """:func:`choose_writers` for any table: rows grouped by one sort."""
    bad = _outside(t.key, t.offsets, t.sizes, shapes)
    if bad:
        raise PlanError({k: _OUTSIDE for k in bad})
    order, group, first = _group_rows(t, shapes)  # first: one representative row per group, in group order
    replicated = np.bincount(group, minlength=len(first))[group] > 1
    validate_partition(t.key[first], t.offsets[first], t.sizes[first], shapes)
    nbytes = t.nbytes
    writer = ~replicated
    load = np.bincount(t.rank[writer], weights=nbytes[writer], minlength=world_size).astype(np.int64)
    rows = order[replicated[order]]  # rows of replicated groups, by group, then row (order is a stable sort)
    if rows.size:
        g = group[rows]
        starts = np.flatnonzero(np.concatenate([[True], g[1:] != g[:-1], [True]]))
        writer[rows[balance.choose(load, t.rank[rows], starts, nbytes[rows[starts[:-1]]])]] = True
    return Writers(group, writer, replicated, load, placement(t, group, writer, shapes.shape[0]))


def _choose_on_grid(t: ChunkTable, shapes: np.ndarray, world_size: int, grid: Grid) -> Writers:
    """:func:`choose_writers` for a grid: group, validate and weigh one column per
    pattern (a table of patterns x ranks, planned row by row), then number the groups
    key by key, spread them over the rows and choose the replicas' writers."""
    w, ncols, npat = world_size, len(grid.keys), len(grid.rep_col)

    def for_members(problems: dict[int, str]) -> PlanError:
        """The error for the keys of the patterns that have a problem."""
        return PlanError({int(k): problems[int(p)] for k, p in zip(grid.keys, grid.pattern) if int(p) in problems})

    pt = _pattern_table(t, grid, w)
    pshapes = shapes[grid.keys[grid.rep_col]]
    bad = _outside(pt.key, pt.offsets, pt.sizes, pshapes)
    if bad:
        raise for_members({p: _OUTSIDE for p in bad})
    order, pgroup, first = _group_rows(pt, pshapes)  # groups numbered by (pattern, box)
    try:
        validate_partition(pt.key[first], pt.offsets[first], pt.sizes[first], pshapes)
    except PlanError as e:
        raise for_members(e.problems) from None
    counts = np.bincount(pgroup, minlength=len(first))
    ndist = np.bincount(pt.key[first], minlength=npat)
    keys = _GridKeys.of(grid, t.itemsize[:ncols], ndist)
    local = pgroup - np.concatenate([[0], np.cumsum(ndist)[:-1]]).astype(np.int64)[pt.key]
    group = spread(local.reshape(npat, w).T, grid).reshape(w, ncols)
    group += keys.first_group[grid.keys]
    single = (counts[pgroup] == 1).reshape(npat, w).T  # (world, patterns)
    vol = row_prod(pt.sizes).reshape(npat, w).T
    itemsize_sum = np.zeros(npat, dtype=np.int64)
    np.add.at(itemsize_sum, grid.pattern, t.itemsize[:ncols])
    load = (np.where(single, vol, 0) * itemsize_sum).sum(axis=1)
    writer = spread(single, grid)
    replicated = ~writer
    chosen = _grid_replica_writers(pt, order, pgroup, first, counts, keys, load)
    writer[chosen.rank * ncols + keys.col[chosen.key]] = True
    return Writers(group.reshape(-1), writer, replicated, load, _grid_placement(pt, first, counts, chosen, keys))


@dataclass(slots=True)
class _GridKeys:
    """Per key of a grid: its column, pattern, item size and first group number
    (groups are numbered key by key, each key's as many as its pattern's); per
    pattern: its lowest key."""

    col: np.ndarray
    pattern: np.ndarray
    itemsize: np.ndarray
    first_group: np.ndarray
    pattern_key: np.ndarray

    @staticmethod
    def of(grid: Grid, col_itemsize: np.ndarray, ndist: np.ndarray) -> _GridKeys:
        n = len(grid.keys)
        col, pattern, itemsize = (np.empty(n, dtype=np.int64) for _ in range(3))
        col[grid.keys], pattern[grid.keys], itemsize[grid.keys] = np.arange(n), grid.pattern, col_itemsize
        first_group = np.concatenate([[0], np.cumsum(ndist[pattern])[:-1]]).astype(np.int64)
        return _GridKeys(col, pattern, itemsize, first_group, grid.keys[grid.rep_col])


def _pattern_table(t: ChunkTable, grid: Grid, world: int) -> ChunkTable:
    """Each pattern's representative column on every rank, pattern after pattern (the
    key of a row is its pattern)."""
    npat, ncols, dims = len(grid.rep_col), len(grid.keys), t.offsets.shape[1]

    def column(a: np.ndarray) -> np.ndarray:
        return a.reshape(world, ncols, dims)[:, grid.rep_col].transpose(1, 0, 2).reshape(npat * world, dims)

    return ChunkTable(key=np.repeat(np.arange(npat, dtype=np.int64), world),
                      rank=np.tile(np.arange(world, dtype=np.int64), npat), offsets=column(t.offsets),
                      sizes=column(t.sizes), itemsize=np.repeat(t.itemsize[grid.rep_col], world))


@dataclass(slots=True)
class _Chosen:
    """The writers of a grid's replicated groups, key by key: each group's key,
    pattern group and chosen rank."""

    key: np.ndarray
    pgroup: np.ndarray
    rank: np.ndarray


def _grid_replica_writers(pt: ChunkTable, order: np.ndarray, pgroup: np.ndarray, first: np.ndarray,
                          counts: np.ndarray, keys: _GridKeys, load: np.ndarray) -> _Chosen:
    """The writers of every key's replicated groups (its pattern's), by
    :func:`balance.choose`; ``load`` gains their bytes. Groups with bytes are weighed
    key by key with the key's item size, in key then box order (the order of their
    group numbers). Empty boxes come last and change no load, so all keys of a pattern
    choose alike: each pattern's empty groups are chosen once, after the rest."""
    rows = order[(counts[pgroup] > 1)[order]]  # pattern rows of replicated groups, by group then rank
    if not rows.size:
        return _Chosen(*(np.zeros(0, dtype=np.int64) for _ in range(3)))
    g = pgroup[rows]
    hstart = np.flatnonzero(np.concatenate([[True], g[1:] != g[:-1], [True]]))
    rep = g[hstart[:-1]]  # the replicated pattern groups, ascending: pattern by pattern
    vol = row_prod(pt.sizes[first[rep]])
    heavy, empty = np.flatnonzero(vol > 0), np.flatnonzero(vol == 0)
    holders = pt.rank[rows]  # list i (rep[i]'s holders): holders[hstart[i] : hstart[i + 1]]
    sel, key_of = _for_keys(pt.key[first[rep[heavy]]], keys)
    rank = holders[balance.choose(load, holders, hstart, vol[heavy[sel]] * keys.itemsize[key_of], heavy[sel])]
    empty_rank = holders[balance.choose(load, holders, hstart, np.zeros(len(empty), dtype=np.int64), empty)]
    esel, ekey_of = _for_keys(pt.key[first[rep[empty]]], keys)
    return _Chosen(np.concatenate([key_of, ekey_of]), np.concatenate([rep[heavy[sel]], rep[empty[esel]]]),
                   np.concatenate([rank, empty_rank[esel]]))


def _for_keys(group_pattern: np.ndarray, keys: _GridKeys) -> tuple[np.ndarray, np.ndarray]:
    """For groups listed pattern by pattern (``group_pattern``, ascending), every
    (group, key) pair of a key of the group's pattern, key by key and group by group:
    each group's index and each pair's key."""
    lo = np.searchsorted(group_pattern, np.arange(len(keys.pattern_key) + 1))
    per_key = np.diff(lo)[keys.pattern]
    listed = np.flatnonzero(per_key)
    sel, _ = balance.ranges(lo[keys.pattern[listed]], per_key[listed])
    return sel, np.repeat(listed, per_key[listed])


def _grid_placement(pt: ChunkTable, first: np.ndarray, counts: np.ndarray, chosen: _Chosen,
                    keys: _GridKeys) -> Placement:
    """The :class:`Placement` of a grid: each pattern's non-empty boxes with their
    single holders as writers, listed once for a pattern without replicas (its lowest
    key; the others point to it) and for every key of a pattern with replicas, whose
    writers differ from key to key."""
    nonempty = np.flatnonzero(nonempty_rows(pt.sizes[first]))  # pattern groups, ascending
    npat = len(keys.pattern_key)
    lo = np.searchsorted(pt.key[first[nonempty]], np.arange(npat + 1))
    replicas = np.bincount(pt.key[first[nonempty]], weights=counts[nonempty] > 1, minlength=npat) > 0
    same_as = np.where(replicas[keys.pattern], np.arange(len(keys.col)), keys.pattern_key[keys.pattern])
    listed = np.flatnonzero(same_as == np.arange(len(keys.col)))
    sel, kfirst = balance.ranges(lo[keys.pattern[listed]], np.diff(lo)[keys.pattern[listed]])
    rows = first[nonempty[sel]]
    rank = pt.rank[rows]  # the single holder; replicated groups get their key's chosen writer
    at = np.full(len(keys.col), -1, dtype=np.int64)
    at[listed] = kfirst[:-1]
    box = np.full(len(first), -1, dtype=np.int64)
    box[nonempty] = np.arange(len(nonempty))
    box = box[chosen.pgroup]  # where each chosen group is among the non-empty ones (-1: an empty box)
    ok = box >= 0
    ckey = chosen.key[ok]
    rank[at[ckey] + box[ok] - lo[keys.pattern[ckey]]] = chosen.rank[ok]
    return Placement(np.repeat(listed, np.diff(kfirst)), pt.offsets[rows], pt.sizes[rows], rank, same_as)


def validate_partition(keys: np.ndarray, offsets: np.ndarray, sizes: np.ndarray, shapes: np.ndarray) -> None:
    """Check that the distinct boxes of every key tile its tensor exactly: no gap,
    no overlap. Raises :class:`PlanError` naming the keys that fail."""
    keys = keys.astype(np.int64, copy=False)  # a narrower array would be widened by every searchsorted below
    problems: dict[int, str] = {}
    vol = row_prod(sizes)
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
