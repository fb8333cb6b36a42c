"""The chunk table the save planner works on: one row per chunk a rank holds."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(slots=True)
class ChunkTable:
    """One row per chunk held by a rank. ``offsets``/``sizes`` are (n, D) with D the
    largest tensor rank; a tensor of lower rank pads trailing dims with offset 0,
    size 1 (and its shape with 1). ``key``, ``rank`` and ``itemsize`` may be any
    integer type: the coordinator uses the narrowest that holds them (16 million rows
    of int16, int16 and int8 are 80 MB, not 390 MB of fresh memory to fill)."""

    key: np.ndarray  # integer (n,)  index into the key list
    rank: np.ndarray  # integer (n,)
    offsets: np.ndarray  # int64 (n, D)
    sizes: np.ndarray  # int64 (n, D)
    itemsize: np.ndarray  # integer (n,)  bytes per element

    def __len__(self) -> int:
        return int(self.key.shape[0])

    @property
    def nbytes(self) -> np.ndarray:
        return row_prod(self.sizes) * self.itemsize


def row_prod(a: np.ndarray) -> np.ndarray:
    """``np.prod(a, axis=1)`` for a narrow (n, D) array: column by column, several
    times faster than a reduction along the short axis."""
    out = a[:, 0].copy() if a.shape[1] else np.ones(a.shape[0], dtype=a.dtype)
    for d in range(1, a.shape[1]):
        out *= a[:, d]
    return out
