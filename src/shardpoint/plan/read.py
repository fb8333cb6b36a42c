"""Read planning: which byte ranges of which saved chunks a rank needs to fill
its target boxes."""

from __future__ import annotations

from dataclasses import dataclass

from .boxes import Box, box_runs, intersect


@dataclass(frozen=True, slots=True)
class ReadOp:
    """Copy ``region`` (global coordinates) from saved chunk ``source`` into target
    ``target``. ``first``/``last`` are the element offsets of the region's span in the
    saved chunk's row-major layout."""

    source: int
    target: int
    region: Box
    first: int
    last: int


def plan_reads(saved: list[Box], targets: list[Box]) -> list[ReadOp]:
    """Intersect every target box with every saved chunk box of one tensor.

    Raises ``ValueError`` when part of a target is covered by no saved chunk (the
    caller turns that into a named error)."""
    ops: list[ReadOp] = []
    for ti, t in enumerate(targets):
        covered = 0
        for si, s in enumerate(saved):
            r = intersect(s, t)
            if r is None or r.numel == 0:
                continue
            first, last, _run, _count = box_runs(r, s)
            ops.append(ReadOp(si, ti, r, first, last))
            covered += r.numel
        if covered < t.numel:
            raise ValueError(f"target box {t} is only partly covered by the saved chunks")
    return ops
