"""The manifest's typed records: one per entry kind, per data file and per index,
decoded and checked by msgspec in C (types, ranges, the entry's ``kind``, a
container's type), so what is left to check in Python is what a schema cannot say
(a layout tiles its shape, a rank is one of the saving job's, a key sits under its
parent). :meth:`shardpoint.format.manifest.Manifest.parse` decodes a manifest into
:class:`Document`; a save builds the same records and writes them
(:meth:`~shardpoint.format.manifest.Manifest.to_bytes`), so the JSON of docs/format.md
has exactly one model in the code.

Field order is the order a save writes (the manifest's bytes are pinned by the
format tests); defaults are left out of what is written.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

__all__ = [
    "COUNT_LIMIT", "Checksum", "Count", "DataFile", "Document", "DocumentV3", "Entry", "EntryRef", "FlatRange", "Grid",
    "Health", "IndexFile", "Layout", "ListedChunk", "PerRankEntry", "PerRankRef", "RankStep", "TensorEntry",
    "TensorRef", "TreeDoc", "TreeRef", "ValueEntry", "kind_of",
]

#: Offsets, lengths and other counts in an index or a manifest lie below this.
COUNT_LIMIT = 1 << 62
#: Most dimensions a tensor entry's shape may have.
MAX_DIMS = 64

Count = Annotated[int, msgspec.Meta(ge=0, lt=COUNT_LIMIT)]
ContainerType = Literal["dict", "list", "tuple"]


class IndexFile(msgspec.Struct, frozen=True, gc=False, omit_defaults=True):
    """The index object beside a data file, as the manifest commits it: its digest is
    a SHA-256 (version 2) or a CRC-32 (version 3); exactly one of the two."""

    name: str
    size: Count
    sha256: Annotated[str, msgspec.Meta(pattern="^[0-9a-f]{64}$")] | None = None
    crc32: Annotated[int, msgspec.Meta(ge=0, lt=1 << 32)] | None = None

    @property
    def digest(self) -> str:
        """The recorded digest, named (:func:`~.digest.content_digest`'s form:
        ``crc32:<8 hex>`` or ``sha256:<64 hex>``); "" when the record has none."""
        if self.crc32 is not None:
            return f"crc32:{self.crc32:08x}"
        return f"sha256:{self.sha256}" if self.sha256 is not None else ""

    @staticmethod
    def of(name: str, size: int, digest: str) -> IndexFile:
        """The record of an index object whose digest is ``digest`` (named, as :attr:`digest` gives it)."""
        alg, _, value = digest.partition(":")
        if alg == "crc32":
            return IndexFile(name, size, crc32=int(value, 16))
        return IndexFile(name, size, sha256=value)


class DataFile(msgspec.Struct, frozen=True, gc=False, omit_defaults=True):
    """A data file of the checkpoint: its size and (version 2) the saving rank that
    wrote it and its index."""

    size: Count
    rank: int | None = None
    index: IndexFile | None = None


class RankStep(msgspec.Struct, frozen=True, gc=False, forbid_unknown_fields=True):
    """A grid's cells in ranks ``first + i * step``."""

    first: int
    step: int


class Grid(msgspec.Struct, frozen=True, gc=False):
    """Chunks that are the cells of a grid (docs/format.md: ``grid``)."""

    cuts: list[int | list[int]]
    """Per dimension, a piece size or the explicit cut points."""
    ranks: list[int] | RankStep
    """The rank whose data file holds each cell, in row-major cell order."""


#: ``[start, stop, rank]``: a range of the tensor's row-major flattening (``flat``).
FlatRange = tuple[int, int, int]


class ListedChunk(msgspec.Struct, frozen=True, gc=False, omit_defaults=True):
    """One chunk of a ``chunks`` layout: its box and the rank whose file holds it
    (version 2), or its box and where its bytes lie (version 1)."""

    offsets: list[int]
    sizes: list[int]
    rank: int | None = None
    file: str | None = None
    offset: Count | None = None
    length: Count | None = None
    crc32: list[Annotated[int, msgspec.Meta(ge=0, lt=1 << 32)]] | None = None


class TensorEntry(msgspec.Struct, tag="tensor", tag_field="kind", frozen=True, gc=False, omit_defaults=True):
    """A tensor: dtype, global shape and exactly one of ``grid``, ``flat``,
    ``chunks`` (version 1: always ``chunks``, each with its place)."""

    dtype: str
    shape: Annotated[list[Count], msgspec.Meta(max_length=MAX_DIMS)]
    numpy: bool = False
    """Saved from a numpy array (restored as one)."""
    grid: Grid | None = None
    flat: list[FlatRange] | None = None
    chunks: list[ListedChunk] | None = None


class ValueEntry(msgspec.Struct, tag="value", tag_field="kind", frozen=True, gc=False):
    """A plain value, encoded ``[type, payload]`` (:func:`~shardpoint.format.manifest.encode_value`)."""

    value: list[Any]


class PerRankEntry(msgspec.Struct, tag="per_rank", tag_field="kind", frozen=True, gc=False):
    """A value each saving rank saved its own of: one sub-tree per rank."""

    ranks: dict[str, TreeDoc]


class TreeDoc(msgspec.Struct, frozen=True, gc=False):
    """The keys of a (sub)tree as written: container types and leaf entries."""

    containers: dict[str, ContainerType]
    entries: dict[str, Entry]


Entry = TensorEntry | ValueEntry | PerRankEntry


class Layout(msgspec.Struct, frozen=True, gc=False, omit_defaults=True, forbid_unknown_fields=True):
    """A row of a version-3 manifest's ``layouts`` table: a shape and exactly one of
    ``grid``, ``flat``, ``chunks`` (what a version-2 tensor entry says besides its
    dtype), shared by every tensor entry that names the row."""

    shape: Annotated[list[Count], msgspec.Meta(max_length=MAX_DIMS)]
    grid: Grid | None = None
    flat: list[FlatRange] | None = None
    chunks: list[ListedChunk] | None = None


class TensorRef(msgspec.Struct, tag="tensor", tag_field="kind", frozen=True, gc=False, omit_defaults=True,
                forbid_unknown_fields=True):
    """A tensor entry of a version-3 manifest: its dtype and the row of ``layouts``
    that holds its shape and layout. The parse makes of it the :class:`TensorEntry`
    a version-2 manifest spells out, so nothing after the parse tells them apart."""

    dtype: str
    layout: Annotated[int, msgspec.Meta(ge=0, lt=COUNT_LIMIT)]
    numpy: bool = False


class PerRankRef(msgspec.Struct, tag="per_rank", tag_field="kind", frozen=True, gc=False):
    """A per-rank value of a version-3 manifest (its sub-trees' tensors name rows too)."""

    ranks: dict[str, TreeRef]


class TreeRef(msgspec.Struct, frozen=True, gc=False):
    """The keys of a (sub)tree of a version-3 manifest."""

    containers: dict[str, ContainerType]
    entries: dict[str, EntryRef]


EntryRef = TensorRef | ValueEntry | PerRankRef


def kind_of(e: Entry) -> str:
    """An entry's ``kind`` as the manifest writes it (``tensor``, ``value``, ``per_rank``)."""
    return str(e.__struct_config__.tag)


class Checksum(msgspec.Struct, frozen=True, gc=False):
    algorithm: Literal["crc32"]
    block_size: Annotated[int, msgspec.Meta(ge=1, le=1 << 40)]


class Health(msgspec.Struct, frozen=True, gc=False, omit_defaults=True):
    """What the save found non-finite, and the caller's metrics (``shardpoint.health``)."""

    nonfinite: list[str] = []
    nan: list[str] | None = None
    roles: dict[str, str] = {}
    metrics: dict[str, float | str] = {}


class _Members(msgspec.Struct, frozen=True, gc=False, kw_only=True, omit_defaults=True):
    """The members every sealed or unsealed manifest has besides its tree's entries
    (docs/format.md, section 3): :class:`Document` and :class:`DocumentV3` add those."""

    seal: str | None = None
    """The seal member (read, never written from here: :func:`~.digest.seal` puts it first)."""
    format: str
    version: int
    library_version: str = ""
    created: float = 0.0
    world_size: Annotated[int, msgspec.Meta(ge=1, le=1 << 24)]
    save_id: str = ""
    checksum: Checksum
    files: dict[str, DataFile]
    containers: dict[str, ContainerType]
    refs: dict[str, dict[str, Count]] = {}
    health: Health | None = None


class Document(_Members, frozen=True, gc=False, kw_only=True, omit_defaults=True):
    """A whole manifest of version 1 or 2 as written: each tensor entry spells out its shape and layout."""

    entries: dict[str, Entry]


class DocumentV3(_Members, frozen=True, gc=False, kw_only=True, omit_defaults=True):
    """A whole manifest of version 3 as written: tensor entries name rows of ``layouts``."""

    layouts: list[Layout] = []
    entries: dict[str, EntryRef]
