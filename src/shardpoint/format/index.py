"""Per-data-file CRC indexes (format version 2).

Each data file ``rNNNNN-<save_id>.safetensors`` has an index object beside it,
``rNNNNN-<save_id>.index.json``, that says where each chunk lies in the file and
lists its CRC-32 per block. The manifest records each index's size and SHA-256, so
a loader reads only the indexes of the files it needs and trusts none whose bytes
differ from what the manifest committed.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any, NamedTuple, TypeGuard

from ..errors import CorruptCheckpointError
from .datafile import WrittenChunk, crc_count

INDEX_FORMAT = "shardpoint-index"
#: Offsets, lengths and other counts in an index or a manifest lie below this.
COUNT_LIMIT = 1 << 62
_CRC_LIMIT = 1 << 32
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


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
    return json.dumps(doc, separators=(",", ":")).encode()


def digest(data: bytes) -> str:
    """SHA-256 of ``data`` as lowercase hex (what the manifest records for an index)."""
    return hashlib.sha256(data).hexdigest()


class Located(NamedTuple):
    """Where one chunk's bytes lie: byte offset in its file, length, block CRCs."""

    offset: int
    length: int
    crc32: list[int]
    #: The data file holding the bytes when it is another checkpoint's (a reference, ``../<folder>/<file>``).
    ref: str | None = None


def parse_index(data: bytes, *, data_file: str, expect: dict[str, Any], file_size: int, block: int,
                where: str, refs: dict[str, dict[str, int]] | None = None) -> dict[str, Located]:
    """Check an index's bytes against the manifest's record (size and SHA-256) before
    parsing anything, then every entry: offsets inside the data file, one CRC per
    block. Raises :class:`CorruptCheckpointError` naming ``where``."""

    def bad(msg: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(
            f"{where}: {msg}; the checkpoint is damaged. Restore the file from a copy, or load another checkpoint"
        )

    data = bytes(data)
    if len(data) != expect["size"] or digest(data) != expect["sha256"]:
        raise bad(f"its SHA-256 or size ({len(data)} bytes) differs from what the manifest committed")
    try:
        doc = json.loads(data.decode("utf-8"))
    except (ValueError, RecursionError) as e:
        raise bad(f"not valid JSON ({e})") from None
    if not isinstance(doc, dict) or doc.get("format") != INDEX_FORMAT or doc.get("file") != data_file:
        raise bad(f"not the index of {data_file}")
    chunks = doc.get("chunks")
    if not isinstance(chunks, dict):
        raise bad("'chunks' is not an object")
    out: dict[str, Located] = {}
    known = refs or {}
    shape_error = "is not [offset, length, [crc32...]] or [offset, length, [crc32...], reference]"
    for name, rec in chunks.items():  # one pass of plain comparisons: an index lists every chunk of its file
        if type(rec) is not list or not 3 <= len(rec) <= 4:
            raise bad(f"chunk {name!r} {shape_error}")
        off, length, crcs = rec[0], rec[1], rec[2]
        if type(off) is not int or type(length) is not int or type(crcs) is not list \
                or not (0 <= off < COUNT_LIMIT and 0 <= length < COUNT_LIMIT):
            raise bad(f"chunk {name!r} {shape_error}")
        ref = rec[3] if len(rec) == 4 else None
        if ref is not None:
            if not isinstance(ref, str) or ref not in known:
                raise bad(f"chunk {name!r} refers to {str(ref)[:120]!r}, which the manifest's 'refs' does not list")
            if off + length > known[ref]["size"]:
                raise bad(f"chunk {name!r} lies beyond the end of the referenced {ref} "
                          f"({off + length} > {known[ref]['size']} bytes)")
        elif off + length > file_size:
            raise bad(f"chunk {name!r} lies beyond the end of {data_file} ({off + length} > {file_size} bytes)")
        want = crc_count(length, block)
        if len(crcs) != want:
            raise bad(f"chunk {name!r} must list {want} block checksums")
        for c in crcs:
            if type(c) is not int or not 0 <= c < _CRC_LIMIT:
                raise bad(f"chunk {name!r} must list {want} block checksums")
        out[name] = Located(off, length, crcs, ref)
    return out


def check_record(rec: Any) -> bool:
    """Whether a manifest's record of an index (``{"name", "size", "sha256"}``) is well formed."""
    return (isinstance(rec, dict) and isinstance(rec.get("name"), str) and is_count(rec.get("size"))
            and isinstance(rec.get("sha256"), str) and bool(_SHA256.match(rec["sha256"])))


def is_count(x: object) -> TypeGuard[int]:
    """Whether ``x`` is a count the format allows: an int (not a bool) in ``[0, COUNT_LIMIT)``."""
    return isinstance(x, int) and not isinstance(x, bool) and 0 <= x < COUNT_LIMIT
