"""Pure planning: boxes, dedup and balance, overlap validation, read plans.

No I/O and no torch.distributed here: given what every rank holds and what a
checkpoint holds, these functions return plans. Arrays, not an object per chunk,
so that planning for thousands of ranks stays fast.
"""

from .boxes import Box, box_runs, intersect
from .read import ReadOp, plan_reads
from .save import (
    ChunkTable,
    Placement,
    PlanError,
    Writers,
    choose_writers,
    nonempty_rows,
    placement,
    validate_partition,
)

__all__ = [
    "Box",
    "box_runs",
    "intersect",
    "ChunkTable",
    "Placement",
    "PlanError",
    "Writers",
    "choose_writers",
    "placement",
    "nonempty_rows",
    "validate_partition",
    "ReadOp",
    "plan_reads",
]
