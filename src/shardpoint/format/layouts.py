"""Compact descriptions of how a tensor's chunks were saved (format version 2).

A tensor entry of a version 2 manifest carries one of:

* ``"grid"``: the chunks are the cells of a grid (DTensor ``Shard``/``Replicate`` on
  1-D and 2-D meshes, uneven last shards included). ``cuts`` has one item per
  dimension, either a piece size ``c`` (cuts at ``0, c, 2c, ...`` and the dimension's
  size) or the explicit list of cut points; ``ranks`` names the rank whose data file
  holds each cell, in row-major cell order, as a list or as ``{"first": a, "step": b}``
  (cell ``i`` in rank ``a + i * b``).
* ``"flat"``: ranges ``[start, stop, rank]`` of the tensor's row-major flattening
  (ZeRO-style flat partitions); each range is the boxes
  :func:`~shardpoint.format.boxes.flat_range_boxes` makes of it.
* ``"chunks"``: any other layout, one ``{"offsets", "sizes", "rank"}`` per chunk.

Its size depends on the layout, not on the world size: a tensor sharded over 8,192
ranks is a few dozen bytes. Where each chunk's bytes lie is in the data file's index
(:mod:`shardpoint.format.index`).
"""

from __future__ import annotations

import itertools
import math

import msgspec
import numpy as np

from ..runtime import PROCESS
from .boxes import flat_range_boxes, grid_cells
from .model import FlatRange, Grid, ListedChunk, RankStep, TensorEntry

#: Most chunks one tensor entry may describe (a damaged manifest cannot ask for more).
MAX_CELLS = 1 << 22
#: Most elements a tensor entry's shape may have.
MAX_NUMEL = 1 << 50

Chunk = tuple[tuple[int, ...], tuple[int, ...], int]  # offsets, sizes, rank


def _cuts_of(spec: int | list[int], n: int) -> list[int] | None:
    """The cut points of one dimension of size ``n`` (None if ``spec`` is malformed)."""
    if isinstance(spec, int):
        if spec < 1 or n < 1 or -(-n // spec) > MAX_CELLS:
            return None
        return list(range(0, n, spec)) + [n]
    if 2 <= len(spec) <= MAX_CELLS + 1:
        if spec[0] != 0 or spec[-1] != n or any(b <= a for a, b in zip(spec, spec[1:])):
            return None
        return spec
    return None


#: Most layouts remembered as checked (a model's tensors share a handful of layouts: the
#: 20,000 tensor entries of a manifest are checked in a few hundred distinct calls).
MEMO_MAX = 1 << 14


#: Encodes a layout's key (:func:`layout_key`; a manifest's parse inlines it).
KEY_ENCODER = msgspec.json.Encoder()


class Layout(msgspec.Struct, frozen=True, gc=False, omit_defaults=True):
    """A tensor entry's layout alone (what :func:`encode` makes; a save puts it into
    its :class:`~.model.TensorEntry`): exactly one of the three is set."""

    grid: Grid | None = None
    flat: list[FlatRange] | None = None
    chunks: list[ListedChunk] | None = None


def layout_key(entry: TensorEntry, world_size: int) -> bytes | None:
    """Bytes that equal grid or flat layouts (of equal shapes, in jobs of ``world_size``)
    share, to remember work on one; None for a chunk list (rarely shared). Encoded in
    C (msgspec): a load makes one per tensor entry."""
    if entry.chunks is not None:
        return None
    return KEY_ENCODER.encode((entry.grid, entry.flat, entry.shape, world_size))


def check(entry: TensorEntry, world_size: int, key: bytes | None = None) -> str | None:
    """Why a version 2 tensor entry's shape or layout is malformed (None when they are
    sound): the shape is of plausible size, the pieces tile it exactly and every rank
    is one of the saving job's. ``key``:
    the entry's :func:`layout_key`, where the caller has it."""
    key = key or layout_key(entry, world_size)
    checked = PROCESS.layout_checks
    if key is not None and key in checked:
        return checked[key]
    why = _check(entry, entry.shape, world_size)
    if key is not None:
        if len(checked) >= MEMO_MAX:
            checked.clear()
        checked[key] = why
    return why


def _check(entry: TensorEntry, shape: list[int], world_size: int) -> str | None:
    numel = math.prod(shape)
    if numel > MAX_NUMEL:
        return f"shape {shape} is implausibly large"
    if (entry.grid is not None) + (entry.flat is not None) + (entry.chunks is not None) != 1:
        return "must have exactly one of 'grid', 'flat', 'chunks'"

    def is_rank(r: int | None) -> bool:
        return r is not None and 0 <= r < world_size

    if entry.grid is not None:
        g = entry.grid
        if len(g.cuts) != len(shape):
            return "'grid' must be {'cuts': [one per dimension], 'ranks': ...}"
        if numel == 0:
            return "a tensor with no elements has no grid"
        cells = 1
        for spec, n in zip(g.cuts, shape):
            cuts = _cuts_of(spec, n)
            if cuts is None:
                return f"grid cuts {str(spec)[:60]} do not split a dimension of size {n}"
            cells *= len(cuts) - 1
            if cells > MAX_CELLS:
                return "the grid has implausibly many cells"
        ranks = g.ranks
        if isinstance(ranks, RankStep):
            if not is_rank(ranks.first) or not is_rank(ranks.first + ranks.step * (cells - 1)):
                return "grid 'ranks' must be {'first': rank, 'step': int} naming ranks of the saving job"
        elif not (len(ranks) == cells and all(is_rank(r) for r in ranks)):
            return f"grid 'ranks' must list {cells} ranks of the saving job"
        return None
    if entry.flat is not None:
        f = entry.flat
        if not 1 <= len(f) <= MAX_CELLS:
            return "'flat' must be a non-empty list of [start, stop, rank]"
        pos = 0
        for r in f:
            if r[0] != pos or r[1] <= r[0] or not is_rank(r[2]):
                return "'flat' ranges must follow each other from 0 and name ranks of the saving job"
            pos = r[1]
        if pos != numel:
            return f"'flat' ranges cover {pos} elements, the shape {shape} has {numel}"
        return None
    chunks = entry.chunks
    assert chunks is not None
    if len(chunks) > MAX_CELLS:
        return "'chunks' is not a list"
    covered = 0
    for c in chunks:
        off, size = c.offsets, c.sizes
        if not len(off) == len(size) == len(shape):
            return "chunk offsets/sizes do not match the shape's rank"
        if not all(0 <= o and 0 < s and o + s <= d for o, s, d in zip(off, size, shape)):
            return f"a chunk lies outside the shape {shape}"
        if not is_rank(c.rank):
            return "a chunk's 'rank' is not a rank of the saving job"
        covered += math.prod(size)
    if covered != numel:
        return f"chunks cover {covered} elements, the shape {shape} has {numel}"
    return None


def expand(entry: TensorEntry, shape: tuple[int, ...]) -> list[Chunk]:
    """Every chunk of a version 2 tensor entry (already :func:`check` ed), in order."""
    if entry.chunks is not None:
        return [(tuple(c.offsets), tuple(c.sizes), c.rank if c.rank is not None else -1) for c in entry.chunks]
    if entry.flat is not None:
        out: list[Chunk] = []
        for start, stop, rank in entry.flat:
            out += [(b.offsets, b.sizes, rank) for b in flat_range_boxes(shape, start, stop)]
        return out
    g = entry.grid
    assert g is not None  # check() accepted the entry
    pieces = []
    for spec, n in zip(g.cuts, shape):
        cuts = _cuts_of(spec, n)
        assert cuts is not None
        pieces.append([(a, b - a) for a, b in zip(cuts[:-1], cuts[1:])])
    ranks = g.ranks
    rank_list: list[int] | range
    if isinstance(ranks, RankStep):
        first, step = ranks.first, ranks.step
        rank_list = range(first, first + step * math.prod(len(p) for p in pieces), step) \
            if step else [first] * math.prod(len(p) for p in pieces)
    else:
        rank_list = ranks
    return [(tuple(o for o, _ in cell), tuple(n for _, n in cell), int(r))
            for cell, r in zip(itertools.product(*pieces), rank_list, strict=True)]


def encode(shape: tuple[int, ...], offsets: np.ndarray, sizes: np.ndarray, ranks: np.ndarray) -> Layout:
    """The most compact description of a tensor's saved (non-empty) chunks: ``grid``
    when they are the cells of a grid, ``flat`` when each is a row-major range,
    else the chunk list. ``offsets``/``sizes`` are (m, ndim) arrays, ``ranks`` (m,)."""
    m, nd = offsets.shape[0], len(shape)
    if m == 0:
        return Layout(chunks=[])
    offsets, sizes = offsets[:, :nd], sizes[:, :nd]
    grid = _grid(offsets, sizes, ranks)
    if grid is not None:
        return Layout(grid=grid)
    if nd > 1:
        flat = _flat(shape, offsets, sizes, ranks)
        if flat is not None:
            return Layout(flat=flat)
    order = np.lexsort(offsets.T[::-1]) if nd else np.arange(m)
    return Layout(chunks=[ListedChunk(offsets[i].tolist(), sizes[i].tolist(), int(ranks[i])) for i in order])


def _grid(offsets: np.ndarray, sizes: np.ndarray, ranks: np.ndarray) -> Grid | None:
    m, nd = offsets.shape
    grid = grid_cells(offsets, sizes)
    if grid is None:
        return None
    cuts, cell = grid
    specs: list[int | list[int]] = []
    rank_of_cell = np.empty(m, dtype=np.int64)
    rank_of_cell[cell] = ranks
    for d in range(nd):
        step = np.diff(cuts[d])
        c0 = int(step[0])
        if np.all(step[:-1] == c0) and step[-1] <= c0:
            specs.append(c0)
        else:
            specs.append(cuts[d].tolist())
    rs: list[int] | RankStep
    if m == 1:
        rs = [int(rank_of_cell[0])]
    else:
        st = np.diff(rank_of_cell)
        rs = RankStep(int(rank_of_cell[0]), int(st[0])) if np.all(st == st[0]) else rank_of_cell.tolist()
    return Grid(specs, rs)


def _flat(shape: tuple[int, ...], offsets: np.ndarray, sizes: np.ndarray, ranks: np.ndarray) -> list[FlatRange] | None:
    """Ranges of the flattening, when every rank's boxes are what ``flat_range_boxes``
    makes of one range (a ZeRO partition)."""
    strides = np.array([math.prod(shape[d + 1:]) for d in range(len(shape))], dtype=np.int64)
    start = offsets @ strides
    numel = np.prod(sizes, axis=1)
    order = np.argsort(start, kind="stable")
    start, numel, r = start[order], numel[order], ranks[order]
    if start[0] != 0 or np.any(start[1:] != start[:-1] + numel[:-1]):
        return None
    # runs of one rank
    new = np.ones(len(start), dtype=bool)
    new[1:] = r[1:] != r[:-1]
    firsts = np.nonzero(new)[0]
    out = []
    for a, b in zip(firsts, list(firsts[1:]) + [len(start)]):
        lo, hi = int(start[a]), int(start[b - 1] + numel[b - 1])
        boxes = flat_range_boxes(shape, lo, hi)
        if len(boxes) != b - a:
            return None
        for k, box in zip(range(a, b), boxes):
            i = order[k]
            if tuple(offsets[i].tolist()) != box.offsets or tuple(sizes[i].tolist()) != box.sizes:
                return None
        out.append((lo, hi, int(r[a])))
    return out
