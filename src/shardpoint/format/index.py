"""Per-data-file CRC indexes (format versions 2 and 3).

Each data file ``rNNNNN-<save_id>.safetensors`` has an index object beside it,
``rNNNNN-<save_id>.index.json``, that says where each chunk lies in the file and
lists its CRC-32 per block. The manifest records each index's size and digest (a
CRC-32 of the whole index in version 3, a SHA-256 in version 2), so
a loader reads only the indexes of the files it needs and trusts none whose bytes
differ from what the manifest committed.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Annotated, Any, NamedTuple, TypeGuard

import msgspec

from ..errors import CorruptCheckpointError
from .chunks import ChunkLoc
from .datafile import WrittenChunk, crc_count, json_bytes
from .digest import content_digest, digest_matches
from .model import COUNT_LIMIT, IndexFile

INDEX_FORMAT = "shardpoint-index"
_CRC_LIMIT = 1 << 32


def index_name(data_file: str) -> str:
    """The index object of ``data_file``: ``r00003-abc.safetensors`` -> ``r00003-abc.index.json``."""
    return data_file.removesuffix(".safetensors") + ".index.json"


def chunk_name(key: str, offsets: Any, per_rank: bool = False, *, at: str | None = None) -> str:
    """The name of a chunk in its data file and index: ``key@o0,o1`` (the offsets
    after the last ``@`` name the box). A per-rank value's chunks are prefixed with
    ``/per_rank/``: no key starts with ``/``, so the names cannot collide. ``at``:
    :func:`box_at` of ``offsets``, where the caller keeps it (many keys share a box)."""
    name = key + (box_at(offsets) if at is None else at)
    return f"/per_rank/{name}" if per_rank else name


def box_at(offsets: Any) -> str:
    """The part of a chunk's name after its key: ``@o0,o1``."""
    return f"@{','.join(map(str, offsets))}"


def index_bytes(data_file: str, chunks: list[tuple[str, WrittenChunk]],
                refs: list[tuple[str, Located, str]] | None = None) -> bytes:
    """Serialise the index of ``data_file``: ``{"format", "file", "chunks": {name: [offset, length, [crc32...]]}}``;
    a chunk stored by reference (``refs``: name, where, reference) has the reference as a fourth item."""
    entries: dict[str, list[Any]] = {name: [w.offset, w.length, w.crc32] for name, w in chunks}
    for name, loc, ref in refs or ():
        entries[name] = [loc.offset, loc.length, loc.crc32, ref]
    doc = {"format": INDEX_FORMAT, "file": data_file, "chunks": entries}
    return json_bytes(doc)


def digest(data: bytes) -> str:
    """The digest a manifest records for an index object written now: its CRC-32,
    named (``crc32:<8 hex>``; :attr:`IndexFile.digest <shardpoint.format.model.IndexFile.digest>`)."""
    return content_digest(data)


class Located(NamedTuple):
    """Where one chunk's bytes lie: byte offset in its file, length, block CRCs."""

    offset: int
    length: int
    crc32: list[int]
    #: The data file holding the bytes when it is another checkpoint's (a reference, ``../<folder>/<file>``).
    ref: str | None = None


_Count = Annotated[int, msgspec.Meta(ge=0, lt=COUNT_LIMIT)]
_Crc = Annotated[int, msgspec.Meta(ge=0, lt=_CRC_LIMIT)]


class _Plain(msgspec.Struct):
    """An index whose every chunk is ``[offset, length, [crc32...]]`` (no references):
    decoded and range-checked in C."""

    format: str
    file: str
    chunks: dict[str, tuple[_Count, _Count, list[_Crc]]]


class _Any(msgspec.Struct):
    """Any index: a chunk's record is checked field by field when it is looked up."""

    format: str
    file: str
    chunks: dict[str, list[Any]]


_PLAIN = msgspec.json.Decoder(_Plain)
_ANY = msgspec.json.Decoder(_Any)
_SHAPE_ERROR = "is not [offset, length, [crc32...]] or [offset, length, [crc32...], reference]"


class Index:
    """A data file's verified index: its chunks by name, each checked where it is
    looked up (:meth:`get`: inside the file, one CRC per block, a reference the
    manifest lists), so a load pays for the chunks it reads, not for every chunk of
    the file. Made by :func:`parse_index`."""

    __slots__ = ("_bad", "_block", "_chunks", "_data_file", "_file_size", "_refs")

    def __init__(self, chunks: Mapping[str, Sequence[Any]], data_file: str, file_size: int, block: int,
                 refs: Mapping[str, Mapping[str, int]], bad: Callable[[str], CorruptCheckpointError]) -> None:
        self._chunks, self._data_file, self._file_size = chunks, data_file, file_size
        self._block, self._refs, self._bad = block, refs, bad

    def __len__(self) -> int:
        return len(self._chunks)

    def names(self) -> list[str]:
        return list(self._chunks)

    def get(self, name: str) -> Located | None:
        """Where chunk ``name`` lies, checked; None when the index lacks it. Raises
        :class:`CorruptCheckpointError` when its record is malformed."""
        rec = self._record(name)
        return None if rec is None else Located(*rec)

    def locate(self, name: str) -> ChunkLoc | None:
        """:meth:`get` as the place a reader reads: the file is the data file, or the
        reference that holds the bytes."""
        rec = self._chunks.get(name)
        if type(rec) is tuple:  # [count, count, [crc...]], its types and ranges checked by the decoder
            off, length, crcs = rec
            if off + length > self._file_size or len(crcs) != (-(-length // self._block) or 1):
                self._record(name)  # raises, naming what is wrong
            return ChunkLoc(self._data_file, off, length, crcs)
        got = self._record(name)
        return None if got is None else ChunkLoc(got[3] or self._data_file, got[0], got[1], got[2])

    def _record(self, name: str) -> tuple[int, int, list[int], str | None] | None:
        rec = self._chunks.get(name)
        if rec is None:
            return None
        if len(rec) == 3 and type(rec) is tuple:  # decoded as [count, count, [crc...]] already
            off, length, crcs = rec
            ref = None
        else:
            if not 3 <= len(rec) <= 4:
                raise self._bad(f"chunk {name!r} {_SHAPE_ERROR}")
            off, length, crcs = rec[0], rec[1], rec[2]
            if type(off) is not int or type(length) is not int or type(crcs) is not list \
                    or not (0 <= off < COUNT_LIMIT and 0 <= length < COUNT_LIMIT):
                raise self._bad(f"chunk {name!r} {_SHAPE_ERROR}")
            for c in crcs:
                if type(c) is not int or not 0 <= c < _CRC_LIMIT:
                    raise self._bad(f"chunk {name!r} must list {crc_count(length, self._block)} block checksums")
            ref = rec[3] if len(rec) == 4 else None
        if ref is not None:
            known = self._refs
            if not isinstance(ref, str) or ref not in known:
                raise self._bad(f"chunk {name!r} refers to {str(ref)[:120]!r}, which the manifest's 'refs' does not list")
            if off + length > known[ref]["size"]:
                raise self._bad(f"chunk {name!r} lies beyond the end of the referenced {ref} "
                                f"({off + length} > {known[ref]['size']} bytes)")
        elif off + length > self._file_size:
            raise self._bad(f"chunk {name!r} lies beyond the end of {self._data_file} ({off + length} > "
                            f"{self._file_size} bytes)")
        if len(crcs) != (-(-length // self._block) or 1):
            raise self._bad(f"chunk {name!r} must list {crc_count(length, self._block)} block checksums")
        return off, length, crcs, ref

    def items(self) -> list[tuple[str, Located]]:
        """Every chunk, checked."""
        out = []
        for name in self._chunks:
            loc = self.get(name)
            assert loc is not None
            out.append((name, loc))
        return out


def parse_index(data: bytes, *, data_file: str, expect: IndexFile, file_size: int, block: int,
                where: str, refs: Mapping[str, Mapping[str, int]] | None = None) -> Index:
    """Check an index's bytes against the manifest's record (size and SHA-256) before
    parsing anything, then its structure; each entry (offsets inside the data file,
    one CRC per block) is checked when it is looked up (:meth:`Index.get`). Raises
    :class:`CorruptCheckpointError` naming ``where``."""

    def bad(msg: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(
            f"{where}: {msg}; the checkpoint is damaged. Restore the file from a copy, or load another checkpoint"
        )

    data = bytes(data)
    named = expect.digest
    if len(data) != expect.size or not digest_matches(named, data):
        what = "CRC-32" if named.startswith("crc32:") else "SHA-256"
        raise bad(f"its {what} or size ({len(data)} bytes) differs from what the manifest committed")
    doc: _Plain | _Any
    try:
        doc = _PLAIN.decode(data)
    except msgspec.ValidationError:  # a reference, or a malformed record: checked where it is looked up
        try:
            doc = _ANY.decode(data)
        except msgspec.ValidationError as e:
            raise bad(f"not the index of {data_file} ({e})") from None
        except (msgspec.DecodeError, RecursionError) as e:
            raise bad(f"not valid JSON ({e})") from None
    except (msgspec.DecodeError, RecursionError) as e:
        raise bad(f"not valid JSON ({e})") from None
    if doc.format != INDEX_FORMAT or doc.file != data_file:
        raise bad(f"not the index of {data_file}")
    return Index(doc.chunks, data_file, file_size, block, refs or {}, bad)


def is_count(x: object) -> TypeGuard[int]:
    """Whether ``x`` is a count the format allows: an int (not a bool) in ``[0, COUNT_LIMIT)``."""
    return isinstance(x, int) and not isinstance(x, bool) and 0 <= x < COUNT_LIMIT
