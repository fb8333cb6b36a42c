"""Incremental saves: a chunk whose bytes equal those the previous committed save
of the same :class:`~shardpoint.CheckpointManager` wrote is stored by reference
(:mod:`shardpoint.format.refs`) instead of being written again.

Detection, per chunk a rank is about to write, against the record its last
committed save kept in this process (nothing is cached across processes: a new
process's first save writes everything):

* Different length, or no record: changed.
* **Version proof** (the same storage, which the record keeps alive so its address
  cannot be reused by a new tensor, same data pointer, same ``tensor._version``,
  shape, strides and dtype as when recorded; frozen parameters, and the detached
  views ``state_dict()`` returns of them, qualify): compare
  the chunk's CRC-32 blocks with the recorded ones, stopping at the first that
  differs. The proof only picks this cheaper comparison; it never skips reading
  the bytes, because ``p.data.add_(1)`` (and numpy views, and writes from C
  extensions) change a tensor without bumping ``_version``. Such a write is still
  seen: its bytes differ, so its CRCs differ.
* No proof (the optimizer stepped it, the state was staged to a new buffer):
  first the same CRC comparison (a changed chunk is rejected after its first
  block: a full fine-tune pays about one block per chunk), then, only if every
  CRC matches, a 128-bit digest (SHA-256, truncated) of the whole chunk against
  the recorded one. A chunk with no recorded digest is written (and its digest
  recorded), so bytes are referenced on a 32-bit match only with the version proof.

A reference is flat (it names the data file holding the bytes, with their offset,
length and CRCs) and never points into the folder being written. Before the
manifest is committed, rank 0 checks that every referenced file still exists with
the recorded size (:func:`check_refs`); the loader then checks the bytes' CRCs
like any chunk.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import SaveAbortedError, ShardpointError
from ..format.datafile import CRC_BLOCK, WrittenChunk, crc_count, first_bad_block, tensor_bytes
from ..format.index import Located
from ..format.refs import split_ref
from ..storage import Storage

#: Bytes of SHA-256 kept as a chunk's content digest (128 bits).
DIGEST_BYTES = 16


def _proof(t: torch.Tensor) -> tuple[Any, ...] | None:
    """What must be unchanged for the version proof: the storage itself (its first
    item is the storage object, which the record holds so that no new tensor can be
    allocated at the same place while the record lives), pointer, version counter,
    geometry and dtype of the live tensor (None when it has none)."""
    try:
        st = t.untyped_storage()
        return (st, st._cdata, t.data_ptr(), t._version, tuple(t.shape), tuple(t.stride()), t.dtype, t.device)
    except (RuntimeError, NotImplementedError, AttributeError):  # tensors without storage (some subclasses)
        return None


def _same(a: tuple[Any, ...] | None, b: tuple[Any, ...] | None) -> bool:
    return a is not None and b is not None and a[1:] == b[1:]


def _digest(view: memoryview) -> bytes:
    return hashlib.sha256(view).digest()[:DIGEST_BYTES]


def _crcs_equal(view: memoryview, want: list[int], block: int) -> bool:
    """Whether ``view``'s block CRCs are ``want``, stopping at the first that differs."""
    return len(want) == crc_count(len(view), block) and first_bad_block(view, want, block) is None


@dataclass(slots=True)
class Record:
    """What a committed save wrote for one chunk: the root-relative data file holding
    its bytes (``step-00000003/r00000-....safetensors``) and that file's size, where in
    it, the block CRCs, the content digest when computed, and the version proof."""

    file: str
    file_size: int
    offset: int
    length: int
    crc32: list[int]
    digest: bytes | None
    proof: tuple[Any, ...] | None
    health: int = 0  # health.FINITE, INF or NAN: what its bytes hold (a reference to it carries that on)


@dataclass(slots=True)
class Session:
    """One rank's incremental decisions for one save into step folder ``target``."""

    target: str
    previous: dict[str, Record]
    block: int = CRC_BLOCK
    records: dict[str, Record] = field(default_factory=dict)
    refs: dict[str, dict[str, int]] = field(default_factory=dict)
    #: chunk name -> (proof, digest) of a chunk about to be written
    _pending: dict[str, tuple[Any, bytes | None]] = field(default_factory=dict)

    def decide(self, name: str, live: torch.Tensor, cpu: torch.Tensor) -> Located | None:
        """Where the bytes of chunk ``name`` already lie (a reference), or None to write
        them. ``live`` is the tensor as the state holds it, ``cpu`` its contiguous CPU view."""
        proof = _proof(live)
        rec = self.previous.get(name)
        view = tensor_bytes(cpu)
        same = rec is not None and rec.length == len(view) and rec.file.split("/", 1)[0] != self.target
        digest = None
        if same:
            assert rec is not None
            same = _crcs_equal(view, rec.crc32, self.block)
            if same and not _same(proof, rec.proof):  # no version proof: a 128-bit digest decides
                digest = _digest(view)
                same = rec.digest is not None and digest == rec.digest
        if not same:
            self._pending[name] = (proof, digest)
            return None
        assert rec is not None
        ref = "../" + rec.file
        self.records[name] = Record(rec.file, rec.file_size, rec.offset, rec.length, rec.crc32,
                                    digest or rec.digest, proof, rec.health)
        r = self.refs.setdefault(ref, {"size": rec.file_size, "bytes": 0})
        r["bytes"] += rec.length
        return Located(rec.offset, rec.length, rec.crc32, ref)

    def wrote(self, fname: str, file_size: int, chunks: list[tuple[str, WrittenChunk]], bad: dict[str, int]) -> None:
        """Record the chunks this save wrote to its own data file ``fname`` (those in
        ``bad`` hold an infinity or a NaN: :data:`shardpoint.health.INF`, ``NAN``)."""
        for name, w in chunks:
            proof, digest = self._pending.pop(name, (None, None))
            self.records[name] = Record(f"{self.target}/{fname}", file_size, w.offset, w.length, w.crc32, digest, proof,
                                        bad.get(name, 0))

    def health(self, name: str) -> int:
        """What chunk ``name``, referenced by this save, holds: :data:`shardpoint.health.FINITE`,
        ``INF`` or ``NAN``."""
        rec = self.records.get(name)
        return rec.health if rec is not None else 0


class Tracker:
    """One rank's memory, in this process, of what the last committed save of a
    manager wrote or referenced, chunk by chunk."""

    def __init__(self) -> None:
        self.records: dict[str, Record] = {}

    def begin(self, target: str) -> Session:
        return Session(target=target, previous=self.records)

    def commit(self, session: Session) -> None:
        """The save of ``session`` committed: the next save compares against it."""
        self.records = session.records

    def reset(self) -> None:
        """Forget everything (a save failed): the next save writes every chunk."""
        self.records = {}


def check_refs(storage: Storage, refs: dict[str, dict[str, int]]) -> None:
    """Before a commit (rank 0): every referenced data file exists beside ``storage``
    with the size recorded when its checkpoint was saved. Raises
    :class:`ShardpointError` naming the file otherwise."""
    if not refs:
        return
    parent = storage.parent()
    for ref, info in sorted(refs.items()):
        folder, fname = split_ref(ref)
        try:
            size = parent.child(folder).size(fname)
        except (OSError, ShardpointError):
            size = None
        if size != info["size"]:
            what = "missing" if size is None else f"{size} bytes, not {info['size']}"
            raise SaveAbortedError(
                f"incremental save into {storage.url}: the data file {folder}/{fname} it refers to is {what} "
                "(a step folder was deleted or replaced outside this manager). Nothing was committed; save again: "
                "the next save writes every chunk"
            )
