"""The in-memory model of a saved tensor that every format version parses into:
its dtype and shape, its chunks (boxes), and where each chunk's bytes lie.

Version 1 lists each chunk's file, offset, length and CRCs in the manifest;
version 2 names each chunk's rank and keeps the rest in that rank's index
(:mod:`.index`). Parsing a manifest (:meth:`shardpoint.format.manifest.Manifest.parse`) turns
either into :class:`TensorSpec` records, so no reader outside ``format/`` asks
which version it reads: a chunk whose ``loc`` is None is found in the index of
its rank's file.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple, cast

import msgspec
import torch

from ..runtime import PROCESS
from .boxes import Box
from .datafile import dtype_from_name
from .layouts import MEMO_MAX, expand
from .model import ListedChunk, TensorEntry


class ChunkLoc(msgspec.Struct, frozen=True, order=True, gc=False):
    """Where one saved chunk's bytes lie. Sorts by file, then offset. A
    :class:`msgspec.Struct`: a load makes one per chunk it reads, and a Struct is
    made in C in a third of a NamedTuple's time."""

    file: str
    """The data file to read: one of the checkpoint's, or a reference ``../<folder>/<file>``."""
    offset: int
    """Absolute byte offset of the chunk's first byte in ``file``."""
    length: int
    """Bytes of the chunk."""
    crc32: Sequence[int]
    """CRC-32 of each checksum block of the chunk (docs/format.md, section 6)."""


class SavedChunk(NamedTuple):
    """One box a tensor was saved in."""

    box: Box
    rank: int
    """The saving rank whose data file (and its index) holds the chunk; -1 where the manifest lists ``loc``."""
    loc: ChunkLoc | None
    """Where its bytes lie when the manifest says it (version 1); else in the index of ``rank``'s file."""


class TensorSpec(msgspec.Struct, frozen=True, gc=False):
    """A tensor entry of a manifest, checked and typed (its chunks are expanded from
    the layout on demand: :meth:`chunks`). A :class:`msgspec.Struct` (made in C): a
    manifest makes one per tensor, and a load parses every entry."""

    key: str
    dtype_name: str
    itemsize: int
    shape: tuple[int, ...]
    numpy: bool
    """Saved from a numpy array (restore it as one)."""
    version: int
    """The manifest's format version (how ``entry`` describes the chunks)."""
    entry: TensorEntry
    """The manifest's entry (already checked)."""
    layout: bytes | None = None
    """Its layout's :func:`~.layouts.layout_key` (tensors of one layout share their expanded chunks)."""
    torch_dtype: torch.dtype | None = None
    """The torch dtype, where this torch has it (:attr:`dtype` raises otherwise)."""

    @property
    def dtype(self) -> torch.dtype:
        """The torch dtype (raises :class:`~shardpoint.CorruptCheckpointError` naming the key
        when this torch lacks it: only a load that needs the key fails)."""
        d = self.torch_dtype
        return d if d is not None else dtype_from_name(self.dtype_name, key=self.key)

    @property
    def listed(self) -> bool:
        """The chunks are listed one by one (version 1, or the ``chunks`` layout): that
        they tile the tensor without overlap is checked where they are read, not
        implied by the layout."""
        return self.version < 2 or self.entry.chunks is not None

    def chunks(self) -> tuple[SavedChunk, ...]:
        """Every chunk the tensor was saved in, in the manifest's order."""
        e = self.entry
        if self.version < 2:  # every chunk listed with its place
            assert e.chunks is not None  # checked by the parse
            return tuple(SavedChunk(Box(tuple(c.offsets), tuple(c.sizes)), -1, _placed(c)) for c in e.chunks)
        key = self.layout
        # layouts already expanded, by layout text (runtime.PROCESS: immutable tuples of SavedChunk, shared)
        memo = PROCESS.layout_chunks
        known = memo.get(key) if key is not None else None
        if known is not None:
            return cast("tuple[SavedChunk, ...]", known)
        got = tuple(SavedChunk(Box(off, size), rank, None) for off, size, rank in expand(e, self.shape))
        if key is not None:
            if len(memo) >= MEMO_MAX:
                memo.clear()
            memo[key] = got
        return got

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize


def _placed(c: ListedChunk) -> ChunkLoc:
    """Where a version 1 chunk's bytes lie (the parse checked that it says)."""
    assert c.file is not None and c.offset is not None and c.length is not None and c.crc32 is not None
    return ChunkLoc(c.file, c.offset, c.length, c.crc32)
