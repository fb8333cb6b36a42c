"""The records a save's stages hand each other, and their wire form.

describe -> :class:`Described` (what this rank holds)
coordinate -> :class:`Planned` (the save id and this rank's :class:`Assignment`)
stage -> :class:`Staged` (the bytes this rank writes, in file order)
write -> :class:`WriteStatus` (its file, its index, its replicas' checksums)

The collective messages are JSON; every record that travels converts itself to
and from that form here (``wire`` / ``from_wire``), nowhere else.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple, TypedDict

import numpy as np
import torch

from ..errors import RankMismatchError
from ..report import SaveStats
from .fence import Owner
from .incremental import Session

#: A JSON object as the collectives carry it.
Wire = dict[str, Any]
#: A plain value as the manifest encodes it: ``[type, payload]``.
Encoded = list[object]


class TensorMeta(TypedDict):
    """A tensor's dtype name, global shape, and whether it was a numpy array."""

    dtype: str
    shape: list[int]
    numpy: bool


class TreeLayout(TypedDict):
    """One tree's layout as the coordinator plans from it: containers, tensors and
    chunk rows (``{"key", "off", "size"}``, or, unpacked from a message, ``"off_flat"``
    and ``"size_flat"`` arrays in place of the nested lists)."""

    containers: dict[str, str]
    tensors: dict[str, TensorMeta]
    chunks: Wire


class RankLayout(TreeLayout):
    """A rank's layout: its top-level tree and each of its per-rank values' trees."""

    per_rank: dict[str, TreeLayout]


class RankValues(TypedDict):
    """A rank's plain values, top level and per per-rank key."""

    values: dict[str, Encoded]
    per_rank: dict[str, dict[str, Encoded]]


@dataclass(frozen=True, slots=True)
class ChunkRows:
    """The chunk rows of one tree on one rank, in the rank's own order: the key each
    belongs to and its box (offsets and sizes in global coordinates)."""

    keys: list[str]
    offsets: list[list[int]]
    sizes: list[list[int]]

    def wire(self) -> Wire:
        return {"key": self.keys, "off": self.offsets, "size": self.sizes}


@dataclass(frozen=True, slots=True)
class Described:
    """What one rank holds of one tree (the state, or one per-rank value): its
    containers, its plain values (encoded), its tensors' dtypes and global shapes,
    its chunk rows and, row by row, the tensor views behind them."""

    containers: dict[str, str]
    values: dict[str, Encoded]
    tensors: dict[str, TensorMeta]
    rows: ChunkRows
    views: list[torch.Tensor]
    per_rank: dict[str, Described]
    #: The state's objects that tell the role of a key under them for health
    #: (``_shardpoint_health_role``: a TrainState's), with their keys (top level only).
    health_owners: tuple[tuple[str, object], ...] = ()

    def layout(self) -> RankLayout:
        """The layout part of the description (what the coordinator plans from):
        structure, tensor shapes and dtypes, chunk boxes, top level and per-rank.
        Values are left out: a step counter changes every save, the layout does not."""
        return {"containers": self.containers, "tensors": self.tensors, "chunks": self.rows.wire(),
                "per_rank": {p: d._tree_layout() for p, d in self.per_rank.items()}}

    def _tree_layout(self) -> TreeLayout:
        return {"containers": self.containers, "tensors": self.tensors, "chunks": self.rows.wire()}

    def value_message(self) -> RankValues:
        """The plain values, top level and per-rank."""
        return {"values": self.values, "per_rank": {p: d.values for p, d in self.per_rank.items()}}


def _ranges(x: Any, what: str) -> tuple[tuple[int, int], ...]:
    try:
        return tuple((int(a), int(b)) for a, b in x)
    except (TypeError, ValueError):
        raise RankMismatchError(f"malformed {what} in the coordinator's reply; every rank must run the same "
                              "shardpoint version") from None


@dataclass(frozen=True, slots=True)
class Assignment:
    """What this rank does with its own chunk rows: the row ranges it ``write``\\ s to
    its file, and those it ``check``\\ s (replicas, whose checksums rank 0 compares)."""

    write: tuple[tuple[int, int], ...]
    check: tuple[tuple[int, int], ...]

    @staticmethod
    def from_wire(m: Wire) -> Assignment:
        return Assignment(_ranges(m["write"], "write ranges"), _ranges(m["check"], "check ranges"))

    def wire(self) -> Wire:
        return {"write": [list(r) for r in self.write], "check": [list(r) for r in self.check]}

    def mask(self, which: str, n: int) -> np.ndarray:
        """``write`` or ``check`` as a boolean mask over ``n`` rows."""
        m = np.zeros(n, dtype=bool)
        for a, b in getattr(self, which):
            m[a:b] = True
        return m

    def written_rows(self, n: int) -> list[int]:
        return np.nonzero(self.mask("write", n))[0].tolist()

    def checked_only(self, n: int) -> list[int]:
        """The replica rows this rank checksums but another rank writes."""
        return np.nonzero(self.mask("check", n) & ~self.mask("write", n))[0].tolist()


class HeldAssignment(NamedTuple):
    """This rank's memory of its last save in a process group: its layout digest,
    the id of the plan that answered it, and its assignment in that plan."""

    digest: str
    plan_id: str
    assignment: Assignment


@dataclass(frozen=True, slots=True)
class Planned:
    """What coordination left for the rest of a save on this rank."""

    save_id: str
    assignment: Assignment


class Staged(NamedTuple):
    """What this rank writes, in file order: each chunk's row (None for a per-rank
    value's chunk), name and bytes (a live view, or its staged copy); which of this
    rank's rows are replicas whose checksums rank 0 compares; and the block checksums
    of the replica rows another rank writes, by row."""

    rows: list[int | None]
    names: list[str]
    views: list[torch.Tensor]
    check: list[bool]
    checked: dict[int, list[int]]


@dataclass(frozen=True, slots=True)
class IndexRecord:
    """The index object written beside a data file, as the manifest commits it."""

    name: str
    size: int
    digest: str
    """Named (``crc32:<8 hex>``: :func:`shardpoint.format.index.digest`)."""

    def wire(self) -> Wire:
        return {"name": self.name, "size": self.size, "digest": self.digest}


@dataclass(frozen=True, slots=True)
class WriteStatus:
    """What one rank wrote: its data file (None when it wrote nothing), the file's
    size and index, the checksum digests of its replica rows, the earlier data files
    it refers to (incremental saves: ref -> {"size", "bytes"}), and the keys of the
    chunks it wrote or referred to that hold a NaN or an infinity, which of them a
    NaN, and each one's role (:mod:`shardpoint.health`)."""

    file: str | None
    size: int = 0
    index: IndexRecord | None = None
    replica_rows: tuple[int, ...] = ()
    replica_digests: tuple[int, ...] = ()
    refs: dict[str, dict[str, int]] | None = None
    nonfinite: tuple[str, ...] = ()
    nan: tuple[str, ...] = ()  # those of ``nonfinite`` with a NaN (the others hold an infinity)
    roles: dict[str, str] | None = None  # each of ``nonfinite``'s role (shardpoint.health)

    def wire(self) -> Wire:
        out: Wire = {"file": self.file, "replicas": [list(self.replica_rows), list(self.replica_digests)]}
        if self.nonfinite:
            out["nonfinite"] = list(self.nonfinite)
            out["nan"] = list(self.nan)
            out["roles"] = dict(self.roles or {})
        if self.file is not None:
            assert self.index is not None
            out["size"] = self.size
            out["index"] = self.index.wire()
        if self.refs:
            out["refs"] = self.refs
        return out

    @staticmethod
    def from_wire(m: Wire, rank: int) -> WriteStatus:
        try:
            rows, digests = m["replicas"]
            index = m.get("index")
            return WriteStatus(
                file=m["file"], size=int(m.get("size", 0)),
                index=IndexRecord(str(index["name"]), int(index["size"]), str(index["digest"])) if index else None,
                replica_rows=tuple(int(r) for r in rows), replica_digests=tuple(int(d) for d in digests),
                refs=m.get("refs"), nonfinite=tuple(str(k) for k in m.get("nonfinite", ())),
                nan=tuple(str(k) for k in m.get("nan", ())),
                roles={str(k): str(v) for k, v in (m.get("roles") or {}).items()})
        except (KeyError, TypeError, ValueError):
            raise RankMismatchError(f"malformed write status from rank {rank}; every rank must run the same "
                                  "shardpoint version") from None


@dataclass(frozen=True, slots=True, kw_only=True)
class SaveOptions:
    """How a save runs, beyond the state and the path."""

    #: Replace a checkpoint already at the path (atomically); else refuse.
    overwrite: bool = False
    #: Rank 0: the attempt's claim on the manager root the path lies in (claimed on
    #: first use; :mod:`.fence`): checked while planning and at the commit.
    owner: Callable[[], Owner] | None = None
    #: The step folder ``latest`` (under the owner's root) points at once committed.
    latest: str | None = None
    #: How messages name this save ("the save of step 6").
    what: str = "the save"
    #: Check before the commit that every file is at the path at its size; off for the
    #: memory tier's snapshots, whose files each lie on their own host's memory.
    check_files: bool = True
    #: The training step (a manager's save), for the save's stats and log line.
    step: int | None = None
    #: Every rank, after the commit: what the save cost on this rank (a manager's event hook).
    on_stats: Callable[[SaveStats], None] | None = None
    #: Rank 0, after every rank returned from the commit (retention); a failure is a warning.
    after_commit: Callable[[], None] | None = None
    #: This rank's incremental session: chunks it finds unchanged are referenced, not written.
    incremental: Session | None = None
    #: The caller's numbers for this step (rank 0's are recorded in the manifest).
    metrics: Mapping[str, float] | None = None
