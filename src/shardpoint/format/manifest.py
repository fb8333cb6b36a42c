"""The manifest: one JSON document that describes a whole checkpoint.

Its presence is the commit: a directory without ``manifest.json`` holds no
checkpoint. It is sealed (:mod:`.digest`): :meth:`Manifest.parse` checks its
seal (a CRC-32 in version 3, a SHA-256 in version 2) before reading anything in
it, so a flipped bit anywhere is refused,
never loaded. Then it checks every field it will use, so a hostile manifest
that was sealed on purpose raises :class:`CorruptCheckpointError` instead of
reaching a file outside the checkpoint, a huge allocation or an unexpected
exception. Version-1 manifests carry no seal and are still read.

Pure: :meth:`Manifest.parse` takes the bytes a caller read
(:func:`shardpoint.load.locate.read_manifest` reads them) and makes of either
version's entries one typed model (:class:`Tree`: tensor specs, decoded values,
per-rank sub-trees).
"""

from __future__ import annotations

import base64
import json
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, cast

import msgspec

from ..errors import CorruptCheckpointError, UnsupportedTypeError
from ..runtime import PROCESS
from . import layouts
from .chunks import SavedChunk, TensorSpec
from .datafile import DTYPES, ITEMSIZES, TORCH_DTYPES, crc_count
from .digest import check_seal, is_sealed, seal, seal_algorithm
from .index import is_count
from .model import (
    ContainerType,
    DataFile,
    Document,
    DocumentV3,
    Entry,
    EntryRef,
    Layout,
    PerRankEntry,
    PerRankRef,
    TensorEntry,
    TensorRef,
    TreeDoc,
    TreeRef,
    ValueEntry,
)
from .names import check_name
from .refs import split_ref

FORMAT_NAME = "shardpoint"
#: Version 3: the manifest's seal and its indexes' digests are CRC-32s; version 2
#: (SHA-256s) and version 1 (no seal, no indexes) are still read.
FORMAT_VERSION = 3
#: The algorithm that seals a manifest of each sealed version, and digests its indexes.
SEALS = {2: "sha256", 3: "crc32"}
#: The one version whose manifests have no seal (read, never written).
UNSEALED_VERSION = 1
MANIFEST_NAME = "manifest.json"
CONTAINER_TYPES = ("dict", "list", "tuple")
#: Longest integer key segment: far below Python's int/str conversion limit (at least 640 digits).
_MAX_INT_DIGITS = 600
_INT_SEG = re.compile(r"^-?[0-9]+$")
#: dtypes that ``Tensor.numpy()`` cannot represent, so an entry marked ``numpy`` never has them.
_NOT_NUMPY = ("bfloat16", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
#: What to do about a damaged manifest, appended to the error.
DAMAGED_FIX = (
    "Restore this checkpoint's directory from a copy, or resume from the previous committed checkpoint "
    "(CheckpointManager: restore(state, fallback=True), or restore(state, step=N) with N from list()); "
    "`shardpoint verify PATH` reports what else is damaged."
)


#: A plain value as a checkpoint stores it (:func:`encode_value`, :func:`decode_value`).
PlainValue = bool | int | float | str | bytes | None


def encode_value(v: object) -> list[object]:
    """A plain value as a JSON array ``[type, payload]``. Raises ``TypeError`` for
    anything that is not None, bool, int, float, str or bytes."""
    if v is None:
        return ["none"]
    if isinstance(v, bool):
        return ["bool", v]
    if isinstance(v, int):
        return ["int", str(int(v))]
    if isinstance(v, float):
        return ["float", float.hex(v)]
    if isinstance(v, str):
        return ["str", v]
    if isinstance(v, (bytes, bytearray)):
        return ["bytes", base64.b64encode(bytes(v)).decode()]
    raise UnsupportedTypeError(f"{type(v).__name__} is not a plain value (None, bool, int, float, str or bytes)")


def decode_value(e: Any, key: str | None = None) -> PlainValue:  # Any: the manifest's JSON, checked here
    """Inverse of :func:`encode_value`. ``key``: the entry's, for the error."""
    try:
        kind = e[0]
        if len(e) == 2:
            p = e[1]
            if kind == "str" and type(p) is str:  # the commonest (a param group's parameter names)
                return p
        elif kind == "none" and len(e) == 1:
            return None
        if len(e) != 2:
            raise ValueError
        if kind == "bool" and isinstance(p, bool):
            return p
        if kind == "int" and isinstance(p, str) and len(p) < 5000:
            return int(p)
        if kind == "float" and isinstance(p, str):
            return float.fromhex(p)
        if kind == "str" and isinstance(p, str):
            return p
        if kind == "bytes" and isinstance(p, str):
            return base64.b64decode(p, validate=True)
    except (TypeError, ValueError, IndexError, KeyError, OverflowError):
        pass
    where = "value" if key is None else f"entry {key!r}"
    raise CorruptCheckpointError(f"manifest: {where} is not a valid encoded value: {str(e)[:80]}")


@dataclass(slots=True)
class Tree:
    """The keys of a (sub)tree: container types and leaf entries, keyed by encoded key
    relative to the tree's root (the root container has key ``""``)."""

    containers: dict[str, str] = field(default_factory=dict)
    entries: dict[str, Entry] = field(default_factory=dict)
    """Each leaf's entry (what a writer builds and the owners' load hooks read)."""
    # what parsing makes of ``entries``, the same for every format version:
    tensors: dict[str, TensorSpec] = field(default_factory=dict)
    """The tensor entries, typed."""
    values: dict[str, PlainValue] = field(default_factory=dict)
    """The plain values, decoded."""
    per_rank: dict[str, dict[int, Tree]] = field(default_factory=dict)
    """Each per-rank value's sub-tree of each saving rank that held it."""

    def doc(self) -> TreeDoc:
        """The tree as written (a per-rank value's sub-tree in its entry)."""
        return TreeDoc(self.containers, self.entries)  # type: ignore[arg-type]  # container types checked where parsed


@dataclass(slots=True)
class RowsMemo:
    """The ``layouts`` rows of a version-3 manifest's top-level tensor entries, kept
    for the next manifest of the same entries (a save's cached plan makes its tensor
    entries once and shares them): their rows and entries are not made again."""

    table: list[Layout] = field(default_factory=list)
    """The rows of the entries in ``refs``, in order."""
    rows: dict[bytes, int] = field(default_factory=dict)
    """A row's index by its encoded layout."""
    refs: dict[str, tuple[TensorEntry, TensorRef]] = field(default_factory=dict)
    """By key: the tensor entry (compared by identity) and what a manifest writes of it."""


@dataclass(slots=True)
class Manifest:
    """A parsed manifest. ``tree`` holds the top-level keys; a per-rank value's
    entry has kind ``per_rank`` with one sub-tree per saving rank."""

    world_size: int
    created: float
    save_id: str
    tree: Tree
    files: dict[str, DataFile]
    crc_block: int
    library_version: str = ""
    version: int = FORMAT_VERSION
    #: Whether the bytes this was parsed from carried a seal that matched (False for version 1).
    sealed: bool = False
    #: The algorithm of that seal (``crc32``, ``sha256``), or None (version 1; a manifest made, not parsed).
    seal_algorithm: str | None = None
    #: Data files of sibling checkpoints whose bytes this one uses (incremental saves,
    #: :mod:`.refs`): ``"../<folder>/<file>" -> {"size": bytes}``; empty for a self-contained checkpoint.
    refs: dict[str, dict[str, int]] = field(default_factory=dict)
    #: The keys whose saved tensors hold a NaN or an infinity (found while their bytes
    #: were checksummed). None when the saver did not record health (older checkpoints).
    nonfinite: list[str] | None = None
    #: Of ``nonfinite``, the keys that held a NaN (the others an infinity); None when
    #: not recorded (saved before roles were): every one counts as a NaN.
    nan: list[str] | None = None
    #: Each key of ``nonfinite``'s role (``shardpoint.health``: param, buffer, optimizer,
    #: extra, state); a key not in it is ``state``.
    roles: dict[str, str] = field(default_factory=dict)
    #: The caller's numbers for this step (``CheckpointManager.save(..., metrics=)``).
    metrics: dict[str, float] = field(default_factory=dict)
    _by_rank: dict[int, str] | None = field(default=None, repr=False, compare=False)
    #: Rows of the layouts table kept from an earlier manifest of the same tensor entries (version 3).
    rows_memo: RowsMemo | None = field(default=None, repr=False, compare=False)

    def file_of_rank(self, rank: int) -> str | None:
        """The data file the saving rank ``rank`` wrote (version 2), or None."""
        m = self._by_rank
        if m is None:
            m = self._by_rank = {f.rank: name for name, f in self.files.items() if f.rank is not None}
        return m.get(rank)

    def file_end(self, chunk: SavedChunk, key: str) -> tuple[str, int]:
        """``(file, end)``: the data file holding ``chunk`` and the byte it must reach
        (the chunk's end when the manifest places it, else the file's recorded size)."""
        if chunk.loc is not None:
            return chunk.loc.file, chunk.loc.offset + chunk.loc.length
        f = self.file_of_rank(chunk.rank)
        if f is None:
            raise CorruptCheckpointError(
                f"key {key!r}: the manifest places a chunk in the file of rank {chunk.rank}, which it does not list; "
                f"the manifest is damaged. {DAMAGED_FIX}"
            )
        return f, self.files[f].size

    def stored_files(self) -> list[str]:
        """Every file the checkpoint consists of besides the manifest: data files and
        (version 2) their indexes."""
        out = list(self.files)
        out += [f.index.name for f in self.files.values() if f.index is not None]
        return out

    def own_bytes(self) -> int:
        """Bytes of the checkpoint's own data files."""
        return sum(f.size for f in self.files.values())

    def referenced_bytes(self) -> int:
        """Bytes of the chunks it stores by reference in other checkpoints' data files."""
        return sum(r.get("bytes", 0) for r in self.refs.values())

    def to_bytes(self) -> bytes:
        """The sealed manifest file's bytes (sealed as its version is: :data:`SEALS`)."""
        return seal(self._body(), SEALS.get(self.version, "sha256"))

    def _body(self) -> bytes:
        """The manifest's JSON before its seal: the bytes ``json.dumps(doc,
        separators=(",", ":"), allow_nan=False)`` writes (every save before wrote them;
        the format tests pin them), made by msgspec in C. The two differ only in
        floats (msgspec writes ``1e16`` where ``repr`` writes ``1e+16``), non-ASCII
        characters and DEL (msgspec writes them as they are, json escapes them) and a
        non-finite float (json refuses it, msgspec writes ``null``): the document's
        floats (``created``, the metrics) go in as ``repr`` already (``msgspec.Raw``),
        and any other output, or a value msgspec refuses, is made by the json module."""
        created: object = self.created
        health: dict[str, object] | None = None
        if self.nonfinite is not None:
            health = {"nonfinite": self.nonfinite}
            if self.nonfinite:  # what each finding is (a healthy checkpoint's record stays as it was)
                health["nan"] = sorted(self.nan or [])
                health["roles"] = {k: self.roles.get(k, "state") for k in self.nonfinite}
            health["metrics"] = {k: _number_out(v) for k, v in sorted(self.metrics.items())}
        floats_ok = True
        if isinstance(self.created, float):
            floats_ok = math.isfinite(self.created)
            if floats_ok:
                created = msgspec.Raw(float.__repr__(self.created).encode())
        if health is not None:
            metrics = cast("dict[str, object]", health["metrics"])
            for k, v in metrics.items():
                if isinstance(v, float):
                    if not math.isfinite(v):
                        floats_ok = False
                        break
                    metrics[k] = msgspec.Raw(float.__repr__(v).encode())
        if floats_ok:
            try:
                out = _ENCODE(self._doc(created, health))
            except (msgspec.EncodeError, TypeError, ValueError, OverflowError):
                out = None
            if out is not None and out.isascii() and b"\x7f" not in out:
                return out
        if health is not None:
            health["metrics"] = {k: _number_out(v) for k, v in sorted(self.metrics.items())}
        # the json module, each record made JSON values in C as the encoder meets it
        return json.dumps(self._doc(self.created, health), default=msgspec.to_builtins, separators=(",", ":"),
                          allow_nan=False).encode()

    def _doc(self, created: object, health: dict[str, object] | None) -> dict[str, object]:
        """The manifest's members as written, in order (the seal aside)."""
        doc: dict[str, object] = {
            "format": FORMAT_NAME,
            "version": self.version,
            "library_version": self.library_version,
            "created": created,
            "world_size": self.world_size,
            "save_id": self.save_id,
            "checksum": {"algorithm": "crc32", "block_size": self.crc_block},
            "files": self.files,
            "containers": self.tree.containers,
        }
        if self.version >= 3:  # each distinct shape and layout once, in a table its tensor entries name
            memo = self.rows_memo if self.rows_memo is not None else RowsMemo()
            table, entries = _with_rows(self.tree.entries, memo)
            doc["layouts"] = table
            doc["entries"] = entries
        else:
            doc["entries"] = self.tree.entries
        if self.refs:
            doc["refs"] = self.refs
        if health is not None:
            doc["health"] = health
        return doc

    @classmethod
    def parse(cls, data: bytes, where: str = MANIFEST_NAME) -> Manifest:
        """Check the seal, then parse and validate; raises :class:`CorruptCheckpointError`
        naming ``where``.

        A sealed manifest is trusted only after its seal matches (its CRC-32, or the
        SHA-256 of version 2; either seal is accepted on any sealed version). An unsealed one
        is read only as version 1 (written before seals existed): a sealed manifest
        whose seal a flipped bit broke still says version 2 and is refused, so damage
        can never downgrade a manifest to the unchecked path."""
        data = bytes(data)
        alg = seal_algorithm(data)
        sealed = alg is not None
        start = 1
        if sealed:  # its seal checked where it lies; then the sealed document is decoded whole (a JSON object too)
            start = check_seal(data, where, fix=DAMAGED_FIX)

        def bad(msg: str) -> CorruptCheckpointError:
            return CorruptCheckpointError(f"{where}: {msg}; the checkpoint is damaged or not a shardpoint checkpoint")

        v3 = False
        doc: Document | DocumentV3
        try:
            # the decoder of the manifest's version (3: its tensor entries name rows of a table), as
            # the head a writer puts first says, else as its 'version' member says
            v3 = data.startswith(_V3_HEAD, start) or (not data.startswith(_V2_HEAD, start) and _raw_version(data) == 3)
            # in C: strict UTF-8 JSON (no NaN/Infinity literals, no number beyond a double), every
            # field's type and range, each entry's kind (docs/format.md); what no schema says, below
            doc = (_DOC3 if v3 else _DOC).decode(data)
        except msgspec.ValidationError as e:
            raise _explain(data, e, sealed, where, bad, v3) from None
        except (msgspec.DecodeError, ValueError, RecursionError) as e:
            raise bad(f"not valid JSON ({e})") from None
        _check_head(doc.format, doc.version, doc.seal is not None, sealed, where, bad)
        if v3 != (doc.version == 3):  # a 'version' member twice, say
            raise bad(f"'version' is {doc.version}, and its entries are written as version "
                      f"{'3' if v3 else '1 or 2'}'s")
        version, ws, block, files = doc.version, doc.world_size, doc.checksum.block_size, doc.files
        ranks_seen: set[int] = set()
        for name, info in files.items():
            check_name(name)
            if version >= 2:
                r = info.rank
                if r is None or not 0 <= r < ws or r in ranks_seen:
                    raise bad(f"files[{name!r}]: 'rank' is not a rank of the saving job, or two files name one rank")
                ranks_seen.add(r)
                idx = info.index
                if idx is None or (idx.sha256 is None) == (idx.crc32 is None) or \
                        (idx.crc32 is None) != (version == 2):
                    raise bad(f"files[{name!r}]: 'index' must be {_index_fields(version)}")
                check_name(idx.name)
        created = doc.created
        try:
            datetime.fromtimestamp(created, tz=timezone.utc)
        except (OverflowError, ValueError, OSError):
            raise bad(f"'created' ({created!r}) is not a time") from None
        refs = doc.refs
        if version < 2 and refs:
            raise bad("'refs' needs format version 2")
        for name, ref in refs.items():
            split_ref(name, where=where)
            if "size" not in ref:
                raise bad(f"refs[{name!r}] has no valid 'size' (and optional 'bytes')")
        nonfinite, nan, roles, metrics = _parse_health(doc, bad)
        if type(doc) is DocumentV3:
            tree = _parse_tree_v3(doc.containers, doc.entries, doc.layouts, files, block, bad, ws, {}, depth=0)
        else:
            assert type(doc) is Document
            tree = _parse_tree(doc.containers, doc.entries, files, block, bad, ws, depth=0, version=version)
        return cls(
            world_size=ws, created=float(created), save_id=doc.save_id, tree=tree, files=files, crc_block=block,
            library_version=doc.library_version, version=version, sealed=sealed, seal_algorithm=alg, refs=refs, nonfinite=nonfinite,
            nan=nan, roles=roles, metrics=metrics,
        )


class _Replaced(msgspec.Struct, frozen=True, gc=False):
    """What a commit needs of the manifest it replaces (the rest is skipped in C)."""

    format: str
    version: int
    save_id: str = ""
    files: dict[str, DataFile] = {}


_REPLACED = msgspec.json.Decoder(_Replaced)


def replaced_files(data: bytes, where: str = MANIFEST_NAME) -> tuple[str, list[str]] | None:
    """The save id and :meth:`Manifest.stored_files` of the manifest ``data`` that a
    commit replaces, without parsing its entries (a commit over a checkpoint of
    20,000 tensors parsed all of them for these). Only a sealed manifest of format
    version 2 or later whose seal matches and whose files each name a rank and an
    index, all names plain; None for anything else, which the caller parses whole
    (and so treats exactly as before)."""
    if not is_sealed(data):
        return None
    try:
        check_seal(data, where, fix=DAMAGED_FIX)  # then decoded whole, as Manifest.parse does (the seal is skipped)
        doc = _REPLACED.decode(data)
        if doc.format != FORMAT_NAME or doc.version < 2:
            return None
        out = [check_name(name) for name in doc.files]
        for info in doc.files.values():
            if info.rank is None or info.index is None:
                return None
            out.append(check_name(info.index.name))
    except (CorruptCheckpointError, msgspec.DecodeError, ValueError, RecursionError):
        return None
    return doc.save_id, out


_Bad = Callable[[str], CorruptCheckpointError]
_JSON = msgspec.json.Decoder()
_ENCODE = msgspec.json.Encoder().encode
_DOC = msgspec.json.Decoder(Document)
_DOC3 = msgspec.json.Decoder(DocumentV3)
#: How a version-3 (version-2) manifest's members begin, as a writer puts them (after the seal).
_V3_HEAD = b'"format":"shardpoint","version":3,'
_V2_HEAD = b'"format":"shardpoint","version":2,'

_NON_FINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


def _check_head(fmt: object, version: object, has_seal: bool, sealed: bool, where: str, bad: _Bad) -> None:
    """What a manifest is (shardpoint's, a version this reads, sealed where its version
    must be), checked before anything else it says."""
    if fmt != FORMAT_NAME:
        raise bad("missing 'format': 'shardpoint'")
    if not isinstance(version, int) or isinstance(version, bool):
        raise bad("'version' is not an integer")
    if version > FORMAT_VERSION:
        raise CorruptCheckpointError(
            f"{where}: format version {version} is newer than this shardpoint reads ({FORMAT_VERSION}); "
            "upgrade shardpoint to load this checkpoint"
        )
    if not sealed and (version != UNSEALED_VERSION or has_seal):
        raise CorruptCheckpointError(
            f"{where}: has no valid seal, which a version-{version} manifest must have (only version "
            f"{UNSEALED_VERSION} has none): the file is damaged and nothing in it was used. {DAMAGED_FIX}"
        )


def _raw_version(data: bytes) -> object:
    """The ``version`` member of the JSON object ``data`` (None when there is none)."""
    raw = _JSON.decode(data)
    return raw.get("version") if isinstance(raw, dict) else None


def _explain(data: bytes, err: msgspec.ValidationError, sealed: bool, where: str, bad: _Bad,
             v3: bool = False) -> CorruptCheckpointError:
    """The error for a manifest the typed decoder refused, naming the field as the
    hand-written checks did (``entry 'x': shape[1]: Expected `int`, got `str```): the
    document is decoded again untyped, its head checked first (a manifest of a newer
    version is reported as that), then each part decoded alone to find the key."""
    try:
        raw = _JSON.decode(data)
    except (msgspec.DecodeError, ValueError, RecursionError) as e:
        return bad(f"not valid JSON ({e})")
    if not isinstance(raw, dict):
        return bad("missing 'format': 'shardpoint'")
    try:
        _check_head(raw.get("format"), raw.get("version"), "seal" in raw, sealed, where, bad)
    except CorruptCheckpointError as e:
        return e
    for name, info in (raw.get("files") or {}).items() if isinstance(raw.get("files"), dict) else ():
        why = _why(info, DataFile)
        if why is not None:
            if why[0].startswith("index"):
                v = raw.get("version")
                return bad(f"files[{name!r}]: 'index' must be {_index_fields(v if isinstance(v, int) else 3)} "
                           f"({why[0]}: {why[1]})")
            return bad(f"files[{name!r}]: '{why[0]}': {why[1]}")
    if isinstance(raw.get("containers"), dict) and isinstance(raw.get("entries"), dict):
        found = _tree_problem(raw["containers"], raw["entries"], entry=EntryRef if v3 else Entry)
        if found is not None:
            return bad(found)
    reason, _, at = str(err).partition(" - at `$")
    field = at.rstrip("`").lstrip(".") or "the document"
    if field in ("files", "entries", "containers") and not isinstance(raw.get(field), dict):
        return bad(f"'{field}' is not an object")
    return bad(f"'{field}': {reason}")


def _index_fields(version: int) -> str:
    """The members of a file's ``index`` record in a manifest of ``version``."""
    return "{'name', 'size', 'sha256'}" if version == 2 else "{'name', 'size', 'crc32'}"


def _why(value: object, typ: Any) -> tuple[str, str] | None:
    """``(field, reason)`` when ``value`` (decoded JSON) is not a ``typ``, else None."""
    try:
        msgspec.convert(value, typ)
    except msgspec.ValidationError as e:
        reason, _, at = str(e).partition(" - at `$")
        return at.rstrip("`").lstrip(".") or "the value", reason
    return None


def _tree_problem(containers: dict[str, Any], entries: dict[str, Any], depth: int = 0, entry: Any = Entry) -> str | None:
    """What is wrong in a (sub)tree the typed decoder refused, naming the key (a
    per-rank value's sub-trees one level down; a per-rank value inside one is refused
    as the parse refuses it, however deep a hostile manifest nests them)."""
    for k, v in containers.items():
        if v not in CONTAINER_TYPES:
            return f"container {k!r} has unknown type {v!r}"
    for k, e in entries.items():
        if not isinstance(e, dict):
            return f"entry {k!r} is not an object"
        kind = e.get("kind")
        if kind not in ("tensor", "value", "per_rank"):
            return f"entry {k!r} has unknown kind {kind!r}"
        if kind == "per_rank" and depth > 0:
            return f"entry {k!r} has unknown kind 'per_rank' (a per-rank value inside a per-rank value)"
        if kind == "per_rank" and isinstance(e.get("ranks"), dict):
            for r, sub in e["ranks"].items():
                if not isinstance(sub, dict) or not isinstance(sub.get("containers"), dict) \
                        or not isinstance(sub.get("entries"), dict):
                    return f"entry {k!r}: rank {r!r}: 'containers' and 'entries' must be objects"
                found = _tree_problem(sub["containers"], sub["entries"], depth + 1, entry)
                if found is not None:
                    return found
        why = _why(e, entry)
        if why is not None:
            return f"entry {k!r}: '{why[0]}': {why[1]}"
    return None


def _number_out(v: float) -> float | str:
    """A metric as JSON: a finite number as itself, NaN and infinities by name."""
    return v if math.isfinite(v) else ("nan" if math.isnan(v) else "inf" if v > 0 else "-inf")


def _parse_health(doc: Document | DocumentV3, bad: _Bad) -> tuple[list[str] | None, list[str] | None, dict[str, str], dict[str, float]]:
    h = doc.health
    if h is None:
        return None, None, {}, {}
    out: dict[str, float] = {}
    for k, v in h.metrics.items():
        if isinstance(v, str) and v in _NON_FINITE:
            out[k] = _NON_FINITE[v]
        elif isinstance(v, float) and abs(v) < 1e308:
            out[k] = v
        else:
            raise bad(f"'health.metrics[{k!r}]' is not a number")
    return h.nonfinite, h.nan, h.roles, out


#: What :data:`~shardpoint.runtime.Process.layout_checks` gives for a layout not checked yet.
_UNCHECKED = "unchecked"


def _parse_tree(containers: dict[str, ContainerType], entries: dict[str, Entry], files: dict[str, DataFile], block: int,
                bad: _Bad, ws: int, depth: int, under: str | None = None, version: int = FORMAT_VERSION) -> Tree:
    """The typed tree of decoded ``containers`` and ``entries`` (their types checked
    by the decoder), with what no schema says checked: the keys form a tree, each
    layout tiles its shape in ranks of the job, values decode."""
    _check_keys(containers, entries, bad, under)
    tree = Tree(containers=cast("dict[str, str]", containers), entries=entries)
    tensors, values = tree.tensors, tree.values
    checked = PROCESS.layout_checks  # layouts.check's memo: most entries share a layout checked before
    encode_layout = layouts.KEY_ENCODER.encode
    for key, e in entries.items():
        if type(e) is TensorEntry:
            name = e.dtype
            layout: bytes | None
            if version >= 2 and e.chunks is None and not e.numpy and name in DTYPES:  # the commonest entry, inline
                layout = encode_layout((e.grid, e.flat, e.shape, ws))  # layouts.layout_key
                why = checked.get(layout, _UNCHECKED)
                if why is _UNCHECKED:
                    why = layouts.check(e, ws, layout)
                if why is not None:
                    raise bad(f"entry {key!r}: {why}")
            else:
                layout = _check_tensor(key, e, files, block, bad, ws, version)
            tensors[key] = TensorSpec(key, name, ITEMSIZES[name], tuple(e.shape), e.numpy, version, e, layout,
                                      TORCH_DTYPES.get(name))
        elif type(e) is ValueEntry:
            values[key] = decode_value(e.value, key)
        elif type(e) is PerRankEntry and depth == 0:
            subs = tree.per_rank[key] = {}
            for r, sub in e.ranks.items():
                if not (r.isascii() and r.isdigit() and len(r) <= 9) or int(r) >= ws:
                    raise bad(f"entry {key!r}: rank {r!r} is not a rank of the saving job")
                subs[int(r)] = _parse_tree(sub.containers, sub.entries, files, block, bad, ws, depth + 1, under=key,
                                           version=version)
        else:
            raise bad(f"entry {key!r} has unknown kind 'per_rank' (a per-rank value inside a per-rank value)")
    return tree


#: A version-3 tensor entry resolved (:func:`_resolve`): its typed entry, layout key, item size, shape, torch dtype.
_Resolved = tuple[TensorEntry, "bytes | None", int, tuple[int, ...], Any]


def _parse_tree_v3(containers: dict[str, ContainerType], entries: dict[str, EntryRef], rows: list[Layout],
                   files: dict[str, DataFile], block: int, bad: _Bad, ws: int,
                   resolved: dict[tuple[int, str, bool], _Resolved], depth: int, under: str | None = None) -> Tree:
    """:func:`_parse_tree` of a version-3 (sub)tree: each tensor entry's row of
    ``rows`` and dtype made the :class:`TensorEntry` a version-2 manifest spells out,
    checked once per row, dtype and ``numpy`` (``resolved``, shared by the sub-trees)."""
    _check_keys(containers, entries, bad, under)
    out: dict[str, Entry] = {}
    tree = Tree(containers=cast("dict[str, str]", containers), entries=out)
    tensors, values = tree.tensors, tree.values
    for key, e in entries.items():
        if type(e) is TensorRef:
            got = resolved.get((e.layout, e.dtype, e.numpy))
            if got is None:
                got = resolved[(e.layout, e.dtype, e.numpy)] = _resolve(key, e, rows, files, block, bad, ws)
            te, layout, size, shape, tdtype = got
            out[key] = te
            tensors[key] = TensorSpec(key, e.dtype, size, shape, e.numpy, 3, te, layout, tdtype)
        elif type(e) is ValueEntry:
            out[key] = e
            values[key] = decode_value(e.value, key)
        elif type(e) is PerRankRef and depth == 0:
            subs = tree.per_rank[key] = {}
            docs: dict[str, TreeDoc] = {}
            for r, sub in e.ranks.items():
                if not (r.isascii() and r.isdigit() and len(r) <= 9) or int(r) >= ws:
                    raise bad(f"entry {key!r}: rank {r!r} is not a rank of the saving job")
                t = subs[int(r)] = _parse_tree_v3(sub.containers, sub.entries, rows, files, block, bad, ws, resolved,
                                                  depth + 1, under=key)
                docs[r] = t.doc()
            out[key] = PerRankEntry(docs)
        else:
            raise bad(f"entry {key!r} has unknown kind 'per_rank' (a per-rank value inside a per-rank value)")
    return tree


def _resolve(key: str, e: TensorRef, rows: list[Layout], files: dict[str, DataFile], block: int, bad: _Bad,
             ws: int) -> _Resolved:
    """The :class:`TensorEntry` of a version-3 tensor entry (its row and dtype),
    checked as a version-2 entry is, and what a :class:`TensorSpec` takes of it."""
    if e.layout >= len(rows):
        raise bad(f"entry {key!r}: 'layout' {e.layout} is not a row of 'layouts' ({len(rows)} rows)")
    row = rows[e.layout]
    if (row.grid is not None) + (row.flat is not None) + (row.chunks is not None) != 1:
        raise bad(f"entry {key!r}: layouts[{e.layout}] must have exactly one of 'grid', 'flat', 'chunks'")
    te = TensorEntry(e.dtype, row.shape, e.numpy, row.grid, row.flat, row.chunks)
    layout = _check_tensor(key, te, files, block, bad, ws, 3)
    return te, layout, ITEMSIZES[e.dtype], tuple(row.shape), TORCH_DTYPES.get(e.dtype)


def _with_rows(entries: Mapping[str, Entry], memo: RowsMemo) -> tuple[list[Layout], dict[str, EntryRef]]:
    """``entries`` as a version-3 manifest writes them, and its ``layouts`` table: each
    tensor entry's shape and layout a row of the table (tensors of one layout share it),
    the entry its dtype and row. The top-level tensor entries' rows come first and are
    kept in ``memo`` (an entry seen before, the same object, is not made again); a
    per-rank value's rows follow, in this manifest's table alone."""
    out: dict[str, EntryRef] = {}
    later: list[tuple[str, PerRankEntry]] = []
    refs, table, rows = memo.refs, memo.table, memo.rows
    for k, e in entries.items():
        if type(e) is TensorEntry:
            got = refs.get(k)
            if got is not None and got[0] is e:
                out[k] = got[1]
                continue
            ref = out[k] = TensorRef(e.dtype, _row(e, rows, table), e.numpy)
            refs[k] = (e, ref)
        elif type(e) is PerRankEntry:
            out[k] = cast("EntryRef", e)  # a placeholder keeping its place in the order: made below
            later.append((k, e))
        else:
            out[k] = cast("ValueEntry", e)
    if later:  # rows of the per-rank values' tensors: in a copy of the table, never in the memo's
        table, rows = list(table), dict(rows)
        for k, e in later:
            out[k] = PerRankRef({r: TreeRef(sub.containers, _sub_rows(sub.entries, rows, table))
                                 for r, sub in e.ranks.items()})
    return table, out


def _sub_rows(entries: Mapping[str, Entry], rows: dict[bytes, int], table: list[Layout]) -> dict[str, EntryRef]:
    """A per-rank value's sub-tree as a version-3 manifest writes it (:func:`_with_rows`)."""
    return {k: TensorRef(e.dtype, _row(e, rows, table), e.numpy) if type(e) is TensorEntry else cast("ValueEntry", e)
            for k, e in entries.items()}


def _row(e: TensorEntry, rows: dict[bytes, int], table: list[Layout]) -> int:
    """The row of ``table`` that holds ``e``'s shape and layout, added when new."""
    code = layouts.KEY_ENCODER.encode((e.shape, e.grid, e.flat, e.chunks))
    i = rows.get(code)
    if i is None:
        i = rows[code] = len(table)
        table.append(Layout(e.shape, e.grid, e.flat, e.chunks))
    return i


def _check_tensor(key: str, e: TensorEntry, files: dict[str, DataFile], block: int, bad: _Bad, ws: int,
                  version: int) -> bytes | None:
    """Check a tensor entry; returns its layout's key (version 2)."""
    dtype, shape = e.dtype, e.shape
    if dtype not in DTYPES:
        raise bad(f"entry {key!r}: unknown dtype {dtype!r}")
    if e.numpy and dtype in _NOT_NUMPY:
        raise bad(f"entry {key!r}: 'numpy' must be true or false, and numpy has no {dtype}")
    if version >= 2:  # the shape's size and the layout, checked once per layout (layouts.check)
        layout = layouts.layout_key(e, ws)
        why = layouts.check(e, ws, layout)
        if why is not None:
            raise bad(f"entry {key!r}: {why}")
        return layout
    numel = math.prod(shape)
    if numel > layouts.MAX_NUMEL:
        raise bad(f"entry {key!r}: shape {shape} is implausibly large")
    chunks = e.chunks
    if chunks is None:
        raise bad(f"entry {key!r}: 'chunks' is not a list")
    covered = 0
    for c in chunks:
        off, size = c.offsets, c.sizes
        if not len(off) == len(size) == len(shape):
            raise bad(f"entry {key!r}: chunk offsets/sizes do not match the shape's rank")
        if not all(is_count(o) and is_count(s) and o + s <= d for o, s, d in zip(off, size, shape)):
            raise bad(f"entry {key!r}: a chunk lies outside the shape {shape}")
        fname = c.file
        if fname is None or fname not in files:
            raise bad(f"entry {key!r}: chunk file {fname!r} is not listed in 'files'")
        check_name(fname)
        length, offset = c.length, c.offset
        if length is None or offset is None:
            raise bad(f"entry {key!r}: chunk offset/length are not non-negative integers")
        if offset + length > files[fname].size:
            raise bad(f"entry {key!r}: chunk bytes {offset}..{offset + length} lie beyond the end of {fname}")
        crc = c.crc32
        want = crc_count(length, block)
        if crc is None or len(crc) != want:
            raise bad(f"entry {key!r}: chunk 'crc32' must list {want} block checksums")
        covered += math.prod(size)
    if covered != numel:
        raise bad(f"entry {key!r}: chunks cover {covered} elements, the shape {shape} has {numel}")
    return None


def _check_keys(containers: Mapping[str, str], entries: Mapping[str, object], bad: _Bad, under: str | None) -> None:
    """The keys form a tree a save could have written: no leaf has children or is
    also a container, list and tuple children are indexed by integers, integer
    segments are of sane length, and a per-rank value's keys lie under its own key
    (``under``)."""
    for k in entries.keys() & containers.keys():
        raise bad(f"key {k!r} is both a leaf and a container")
    keys = [*containers, *entries]
    if max(map(len, keys), default=0) > _MAX_INT_DIGITS:  # only a key this long can hold a segment this long
        for k in keys:
            for seg in k.split("/") if len(k) > _MAX_INT_DIGITS else ():
                if len(seg) > _MAX_INT_DIGITS and _INT_SEG.match(seg):
                    raise bad(f"key {k[:80]!r}...: an integer segment of {len(seg)} digits")
    if under is not None and under != "":
        inside = under + "/"
        for k in keys:
            if k != under and not k.startswith(inside):
                raise bad(f"per-rank key {k!r} does not lie under its value's key {under!r}")
    # each key's parent and its segment below it, in C-speed comprehensions (a load checks
    # every key); a parent that is no container of its own is walked up from (:func:`_check_up`)
    parts = [k.rpartition("/") for k in keys if k != ""]
    parents = {t[0] for t in parts}
    for p in parents & entries.keys():
        raise bad(f"key {next(k for k in keys if k.rpartition('/')[0] == p)!r} lies under the leaf {p!r}")
    sequences = {c for c, kind in containers.items() if kind != "dict"}
    for p, _, seg in [t for t in parts if t[0] in sequences] if sequences & parents else ():
        if not (seg.isascii() and seg.isdigit()):
            raise bad(f"key {p + '/' + seg if p else seg!r}: a {containers[p]} is indexed by {seg!r}, not by an integer")
    for p in parents:
        if p not in containers:
            _check_up(p, containers, entries, bad)


def _check_up(k: str, containers: Mapping[str, str], entries: Mapping[str, object], bad: _Bad) -> None:
    """The parents of ``k`` (a key's parent that is no container itself) up to the
    nearest container: none is a leaf, and a list or tuple among them is indexed by
    an integer."""
    end = len(k)
    while True:
        cut = k.rfind("/", 0, end)
        parent = k[:cut] if cut > 0 else ""
        if parent in entries:
            raise bad(f"key {k!r} lies under the leaf {parent!r}")
        kind = containers.get(parent)
        if kind == "list" or kind == "tuple":
            seg = k[cut + 1 : end]
            if not (seg.isascii() and seg.isdigit()):
                raise bad(f"key {k!r}: a {kind} is indexed by {seg!r}, not by an integer")
        if kind is not None or cut < 0:
            break
        end = cut
