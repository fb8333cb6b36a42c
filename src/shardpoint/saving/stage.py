"""Stage: what this rank writes, in file order, ready for the writer.

Only what this rank's assignment gives it to write (and its per-rank values) is
touched; a replica another rank writes is checksummed where it lies, never copied
whole. A blocking save stages in place (the writer streams the tensors' own
memory, device tensors through the pool of :mod:`.buffers`); an asynchronous save
copies into the reused staging buffer before returning, or, overlapped, in the
background under the version guard (docs/async.md).
"""

from __future__ import annotations

from typing import Any

import torch

from ..format.index import box_at, chunk_name
from .buffers import block_crcs_of, check_versions, copy_into, mark, pool, staging, versions
from .records import Assignment, Described, Staged


class Stage:
    """Staging by need for one save on this rank: the rows its assignment gives it to
    write (and its per-rank values' chunks), in file order, and the replica rows it
    only checksums (another rank writes them).

    :meth:`in_place` (a blocking save) leaves the bytes where they are, for the writer
    to stream (device tensors through the pool). :meth:`copy` (an asynchronous save)
    copies them into the reused staging buffer; after :meth:`guard` (an overlapped
    save) the copy fails if a tensor changed since the guard was taken. Replica rows
    another rank writes are checksummed where they are, never copied whole."""

    def __init__(self, described: Described, assignment: Assignment) -> None:
        self.described = described
        n = len(described.views)
        self.check: list[bool] = assignment.mask("check", n).tolist()
        mine = assignment.written_rows(n)
        rows = described.rows
        self.rows: list[int | None] = list(mine)
        at: dict[tuple[int, ...], str] = {}  # a box's part of a name: a model's chunks share a few boxes
        every = len(mine) == n  # often: this rank writes all of its rows
        keys = rows.keys if every else [rows.keys[i] for i in mine]
        names: list[str] = []
        self.names = names
        for key, off in zip(keys, rows.offsets if every else [rows.offsets[i] for i in mine]):
            box = tuple(off)
            a = at.get(box)
            if a is None:
                a = at[box] = box_at(box)
            names.append(key + a)  # chunk_name(key, box, at=a), inline: one a chunk
        self.views = list(described.views) if every else [described.views[i] for i in mine]
        # a per-rank chunk's key is what a message names
        self.keys = list(keys)
        for pkey, sub in described.per_rank.items():
            for i, v in enumerate(sub.views):
                if v.numel():
                    self.rows.append(None)
                    self.names.append(chunk_name(sub.rows.keys[i], sub.rows.offsets[i], per_rank=True))
                    self.views.append(v)
                    self.keys.append(pkey)
        self.others = assignment.checked_only(n)
        self.keys += [rows.keys[i] for i in self.others]
        # what the guard watches: the rows copied and the replica rows checksummed in place
        self.watched = self.views + [described.views[i] for i in self.others]
        self.before: list[int | None] | None = None
        self.after: dict[torch.device, Any] = {}

    def in_place(self) -> Staged:
        """The bytes as they are (a blocking save), with the replica rows' checksums."""
        return Staged(self.rows, self.names, self.views, self.check, self._checked(self.watched[len(self.views):]))

    def guard(self) -> None:
        """Before returning to the caller (overlap): take the version counters and
        mark the caller's streams, so the background copy reads the state as of now
        and fails if it changed."""
        self.before = versions(self.watched)
        self.after = mark(self.watched)

    def copy(self) -> Staged:
        """Copy what this rank writes into the staging buffer (an asynchronous save)."""
        after = self.after or mark(self.views)
        dsts = staging().allocate(self.views)
        copy_into(dsts, self.views, after)
        checked = self._checked(self.watched[len(self.views):])
        if self.before is not None:
            check_versions(self.keys, self.watched, self.before)
        return Staged(self.rows, self.names, dsts, self.check, checked)

    def _checked(self, others: list[torch.Tensor]) -> dict[int, list[int]]:
        return dict(zip(self.others, block_crcs_of(others, pool())))


def optimizers(obj: Any, depth: int = 0, out: list[torch.optim.Optimizer] | None = None) -> list[torch.optim.Optimizer]:
    """The torch optimizers in a state: in its containers, and a TrainState's (or any
    owner's) ``optimizer``; the overlapped save holds their next step until its copy
    is taken."""
    out = [] if out is None else out
    if depth > 6:
        return out
    if isinstance(obj, torch.optim.Optimizer):
        if not any(o is obj for o in out):
            out.append(obj)
        return out
    if isinstance(obj, dict):
        for v in obj.values():
            optimizers(v, depth + 1, out)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            optimizers(v, depth + 1, out)
    else:
        opt = getattr(obj, "optimizer", None)
        if opt is not None:
            optimizers(opt, depth + 1, out)
        extra = getattr(obj, "extra", None)
        if isinstance(extra, dict):
            optimizers(extra, depth + 1, out)
    return out
