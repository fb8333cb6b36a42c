"""Chunk tables that are a grid of ranks by keys, and the few layouts their keys share.

At scale every rank of a job holds one piece of every tensor and lists its tensors
in the same order, and the tensors fall into a handful of layouts: two (4096, 4096)
weights sharded alike have their pieces at the same offsets on every rank. 8,192
ranks x 2,000 tensors is 16 million rows but a dozen distinct columns. Planning each
distinct column (a *pattern*) once and spreading the result over the keys that share
it costs a few passes over the rows instead of sorting them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from .table import ChunkTable

#: Ranks the exact column check reads at once (its temporaries stay in cache).
_BLOCK_RANKS = 128
#: Ranks whose boxes propose the patterns (the exact check then reads every rank).
_SAMPLE_RANKS = 64
#: Most patterns per column for which planning by pattern pays (a table of patterns x
#: ranks as large as the table itself costs the row-by-row plan and a detour).
_MAX_PATTERNS_PER_COLUMN = 0.5


@dataclass(slots=True)
class Grid:
    """A chunk table whose row ``r * L + j`` is rank ``r``'s chunk of key ``keys[j]``,
    every key once on every rank, and the pattern of each column."""

    keys: np.ndarray  # (L,) the key of each column
    pattern: np.ndarray  # (L,) the pattern of each column, 0..P-1
    rep_col: np.ndarray  # (P,) the column of each pattern's lowest key (its representative)


def find_grid(t: ChunkTable, shapes: np.ndarray, world: int) -> Grid | None:
    """The grid of ``t`` when it is one (every key of ``shapes`` on every rank, in one
    order), with its patterns: columns of equal global shape whose boxes are equal on
    every rank. None when the table is no such grid, or when most of its columns are
    patterns of their own (then it is planned row by row)."""
    n, nkeys = len(t), shapes.shape[0]
    if world < 1 or n == 0 or n != world * nkeys:
        return None
    keys = t.key[:nkeys]
    if not np.array_equal(np.sort(keys), np.arange(nkeys)):
        return None
    if not ((t.key.reshape(world, nkeys) == keys).all() and (t.itemsize.reshape(world, nkeys) == t.itemsize[:nkeys]).all()
            and (t.rank.reshape(world, nkeys) == np.arange(world)[:, None]).all()):
        return None
    dims = t.offsets.shape[1]
    off, size = t.offsets.reshape(world, nkeys, dims), t.sizes.reshape(world, nkeys, dims)
    found = _patterns(off, size, shapes[keys], keys)
    return None if found is None else Grid(keys=keys, pattern=found[0], rep_col=found[1])


def _patterns(off: np.ndarray, size: np.ndarray, shapes: np.ndarray,
              keys: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """Each column's pattern and each pattern's representative column (that of its
    lowest key); None when there would be more than ``_MAX_PATTERNS_PER_COLUMN`` per
    column. Columns of one global shape whose boxes agree on a sample of ranks are
    proposed as one pattern; each is then compared with the representative on every
    rank, and one that differs somewhere becomes a pattern of its own (never wrong, at
    worst less shared)."""
    world, ncols, _ = off.shape
    sample = np.unique(np.linspace(0, world - 1, min(world, _SAMPLE_RANKS)).round().astype(np.int64))
    ident = np.concatenate([shapes] + [a[sample].transpose(1, 0, 2).reshape(ncols, -1) for a in (off, size)], axis=1)
    seen: dict[bytes, int] = {}
    pattern = np.array([seen.setdefault(row.tobytes(), len(seen)) for row in ident], dtype=np.int64)
    if len(seen) > _MAX_PATTERNS_PER_COLUMN * ncols:
        return None
    rep_col = _lowest(pattern, keys)
    same = _same_columns(off, rep_col[pattern]) & _same_columns(size, rep_col[pattern])
    if not same.all():
        pattern = np.unique(np.where(same, pattern, ncols + np.arange(ncols)), return_inverse=True)[1].astype(np.int64)
        rep_col = _lowest(pattern, keys)
    return (pattern, rep_col) if len(rep_col) <= _MAX_PATTERNS_PER_COLUMN * ncols else None


def _lowest(pattern: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """The column of each pattern's lowest key."""
    lowest = np.full(int(pattern.max()) + 1, np.iinfo(np.int64).max, dtype=np.int64)
    np.minimum.at(lowest, pattern, keys)
    col_of_key = np.empty(len(keys), dtype=np.int64)
    col_of_key[keys] = np.arange(len(keys))
    return col_of_key[lowest]


def _same_columns(a: np.ndarray, source: np.ndarray) -> np.ndarray:
    """Whether column ``j`` of ``a`` (world, L, D) equals column ``source[j]`` on every
    rank; a block of ranks at a time (``take``: fancy indexing is several times slower)."""
    same = np.ones(a.shape[1] * a.shape[2], dtype=bool)
    for r in range(0, a.shape[0], _BLOCK_RANKS):
        b = a[r : r + _BLOCK_RANKS]
        same &= (b == np.take(b, source, axis=1)).reshape(len(b), -1).all(axis=0)
    return np.asarray(same.reshape(a.shape[1], a.shape[2]).all(axis=1))


def spread(per_pattern: np.ndarray, grid: Grid) -> np.ndarray:
    """A (world, P) array of per-pattern values as the (world * L,) column of the table:
    row ``r * L + j`` gets ``per_pattern[r, pattern[j]]``."""
    return np.take(per_pattern, grid.pattern, axis=1).reshape(-1)
