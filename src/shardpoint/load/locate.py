"""Locate: the I/O that finds a checkpoint's description. Reads the manifest and
the indexes a load needs (``format/`` parses the bytes read here), reads through
references into sibling checkpoints, and turns a saved chunk into the typed place
of its bytes (:class:`~shardpoint.format.chunks.ChunkLoc`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import CheckpointNotFoundError, CorruptCheckpointError
from ..format.chunks import ChunkLoc, SavedChunk, TensorSpec
from ..format.index import Index, box_at, chunk_name, parse_index
from ..format.manifest import DAMAGED_FIX, MANIFEST_NAME, Manifest
from ..format.refs import is_ref, split_ref
from ..storage.base import Delegating, Storage

__all__ = ["Locator", "RefView", "committed", "read_index", "read_manifest", "with_refs"]


def read_manifest(storage: Storage) -> Manifest:
    """The committed manifest at ``storage``, read and parsed: the one place that
    does, so every caller sees the same errors. Raises
    :class:`CheckpointNotFoundError` when there is none and
    :class:`CorruptCheckpointError` when it cannot be trusted."""
    where = f"{storage.url}/{MANIFEST_NAME}"
    try:
        there = storage.exists(MANIFEST_NAME)
    except OSError as e:
        raise CorruptCheckpointError(f"{where} cannot be looked up ({e}); check the path and its permissions") from None
    if not there:
        try:
            empty = not storage.list_dirs() and not storage.list()
        except OSError:  # only the message depends on it
            empty = False
        raise CheckpointNotFoundError(
            f"no checkpoint at {storage.url}: " + (
                "nothing is there (check the path)" if empty else
                f"it has no {MANIFEST_NAME}, so no save ever committed there (a save that failed or was killed leaves "
                "no manifest; a CheckpointManager's root holds its checkpoints in step-* folders); check the path"))
    try:
        data = bytes(storage.read(MANIFEST_NAME))
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"no checkpoint at {storage.url}: {MANIFEST_NAME} disappeared while reading it") from None
    except OSError as e:
        raise CorruptCheckpointError(f"{where} cannot be read ({e}); check the path and its permissions") from None
    return Manifest.parse(data, where=where)


def committed(storage: Storage, save_id: str) -> bool:
    """Whether the manifest at ``storage`` is the one of save ``save_id`` (not
    replaced or removed since)."""
    try:
        return storage.exists(MANIFEST_NAME) and read_manifest(storage).save_id == save_id
    except (CheckpointNotFoundError, CorruptCheckpointError, ValueError):  # no (readable) manifest: not committed
        return False


def read_index(storage: Storage, manifest: Manifest, fname: str) -> Index:
    """The verified index of data file ``fname`` (its bytes must have the size and
    digest the manifest committed)."""
    info = manifest.files[fname]
    rec = info.index
    if rec is None:
        raise CorruptCheckpointError(f"{storage.url}: {fname} has no index (a version-1 checkpoint lists its chunks in the "
                                     f"manifest); the manifest is damaged. {DAMAGED_FIX}")
    where = f"{storage.url}/{rec.name}"
    try:
        data = storage.read(rec.name)
    except (CorruptCheckpointError, OSError) as e:
        raise CorruptCheckpointError(
            f"the index {where} of {fname} cannot be read ({e}); the checkpoint is damaged. {DAMAGED_FIX}"
        ) from None
    return parse_index(bytes(data), data_file=fname, expect=rec, file_size=info.size,
                       block=manifest.crc_block, where=where, refs=manifest.refs)


class RefView(Delegating):
    """The checkpoint's storage, where a reference name (``../<folder>/<file>``)
    reads from the sibling folder instead; every other name goes to ``inner``.
    Read-only for references; writes go to ``inner``."""

    def __init__(self, inner: Storage) -> None:
        super().__init__(inner)
        self._own = inner.url.rstrip("/").rsplit("/", 1)[-1]
        self._siblings: dict[str, Storage] = {}

    def _resolve(self, name: str) -> tuple[Storage, str]:
        if not is_ref(name):
            return self.inner, name
        folder, fname = split_ref(name, where=f"{self.url}/{MANIFEST_NAME}")
        if folder == self._own:
            raise CorruptCheckpointError(
                f"{self.url}: reference {name!r} points into the checkpoint's own folder; a reference must name "
                "another checkpoint. The manifest is damaged or hostile"
            )
        s = self._siblings.get(folder)
        if s is None:
            s = self._siblings[folder] = self.inner.parent().child(folder)
        return s, fname

    def read(self, name: str, offset: int = 0, length: int | None = None) -> bytes | bytearray:
        s, n = self._resolve(name)
        try:
            return s.read(n, offset, length)
        except FileNotFoundError:
            raise _missing(self.url, name) from None

    def read_into(self, name: str, offset: int, buf: memoryview) -> None:
        s, n = self._resolve(name)
        try:
            s.read_into(n, offset, buf)
        except FileNotFoundError:
            raise _missing(self.url, name) from None

    def exists(self, name: str) -> bool:
        s, n = self._resolve(name)
        return s.exists(n)

    def size(self, name: str) -> int:
        s, n = self._resolve(name)
        return s.size(n)


def _missing(url: str, name: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"{url}: the referenced data file {name!r} is missing: the checkpoint it belongs to was deleted by hand (retention "
        "never deletes referenced data). Restore that folder, or load another checkpoint"
    )


def with_refs(storage: Storage, manifest: Manifest) -> Storage:
    """``storage`` able to read the manifest's references (as is when it has none)."""
    if not manifest.refs or isinstance(storage, RefView):
        return storage
    return RefView(storage)


@dataclass(slots=True)
class Locator:
    """Finds where saved chunks' bytes lie: in the manifest (version 1) or in their
    data file's index, read (once, verified against the manifest's digest) only for
    the files the chunks asked about are in."""

    storage: Storage
    manifest: Manifest
    _indexes: dict[str, Index] = field(default_factory=dict)
    _files: dict[int, tuple[str, Index]] = field(default_factory=dict)  # saving rank -> its file, index
    indexes: dict[int, Index] = field(default_factory=dict)
    """The indexes read so far, by saving rank (:meth:`find` reads the others)."""
    _boxes: dict[tuple[int, ...], str] = field(default_factory=dict)  # a box's offsets -> their part of a chunk name

    def __post_init__(self) -> None:
        self.storage = with_refs(self.storage, self.manifest)  # a reference reads from its sibling folder

    def locate(self, spec: TensorSpec, chunk: SavedChunk, per_rank: bool, *, check_length: bool = True) -> ChunkLoc:
        """Where ``chunk`` of tensor ``spec`` lies (``per_rank``: of a per-rank value,
        whose chunks are named apart). Raises :class:`CorruptCheckpointError` naming
        the key when the index lacks it or (``check_length``) its length contradicts
        its box."""
        box = chunk.box
        loc = chunk.loc
        if loc is None:
            at = self._boxes.get(box.offsets)
            if at is None:
                at = self._boxes[box.offsets] = box_at(box.offsets)
            loc = self.find(spec.key, chunk.rank, chunk_name(spec.key, box.offsets, per_rank, at=at))
        if check_length and loc.length != box.numel * spec.itemsize:
            raise self.wrong_length(spec, loc, box.numel)
        return loc

    def find(self, key: str, rank: int, name: str) -> ChunkLoc:
        """Where the chunk ``name`` of tensor ``key`` that saving rank ``rank`` wrote
        lies, from that rank's index (read once)."""
        idx = self._files.get(rank)
        if idx is None:
            idx = self._index_of(rank, key)
        loc = idx[1].locate(name)
        if loc is None:
            raise CorruptCheckpointError(
                f"key {key!r}: chunk {name!r} is not in the index of {idx[0]}; the checkpoint is damaged. {DAMAGED_FIX}"
            )
        return loc

    @staticmethod
    def wrong_length(spec: TensorSpec, loc: ChunkLoc, numel: int) -> CorruptCheckpointError:
        return CorruptCheckpointError(
            f"key {spec.key!r}: a chunk in {loc.file} is {loc.length} bytes but its box holds "
            f"{numel} x {spec.itemsize} bytes; the manifest is damaged. {DAMAGED_FIX}"
        )

    def _index_of(self, rank: int, key: str) -> tuple[str, Index]:
        """The data file of saving rank ``rank`` and its index, read once."""
        fname = self.manifest.file_of_rank(rank)
        if fname is None:
            raise CorruptCheckpointError(
                f"key {key!r}: the manifest places a chunk in the file of rank {rank}, which it does not list; "
                f"the manifest is damaged. {DAMAGED_FIX}"
            )
        idx = self._indexes.get(fname)
        if idx is None:
            idx = self._indexes[fname] = read_index(self.storage, self.manifest, fname)
        at = self._files[rank] = (fname, idx)
        self.indexes[rank] = idx
        return at

    def check_holds(self, spec: TensorSpec) -> None:
        """That the files of ``spec``'s chunks are long enough to hold them (before a
        large allocation: a manifest's shape is only a claim)."""
        ends: dict[str, int] = {}
        for c in spec.chunks():
            f, end = self.manifest.file_end(c, spec.key)
            ends[f] = max(ends.get(f, 0), end)
        for fname, end in sorted(ends.items()):
            try:
                size = self.storage.size(fname)
            except (OSError, CorruptCheckpointError) as err:
                raise CorruptCheckpointError(f"key {spec.key!r}: data file {fname} cannot be read ({err})") from None
            if end > size:
                raise CorruptCheckpointError(
                    f"key {spec.key!r}: the manifest places its bytes up to byte {end} of {fname}, "
                    f"which has {size}; the file is truncated or the manifest is damaged"
                )
