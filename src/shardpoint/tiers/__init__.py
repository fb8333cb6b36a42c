"""Checkpoint tiers (issue 23, "a recovery ladder"): a memory tier on each host that
outlives the training process but not the node, drained to the durable root, and a
restore that takes the newest step it can load in full from either.

``CheckpointManager(root, keep_last=3, memory=MemoryTier(every=1, keep=2, durable_every=5))``;
see docs/tiers.md. A memory snapshot is a shardpoint checkpoint in node-local shared
memory, written by the same save pipeline; the durable checkpoint of a step is a copy
of its snapshot's files, made by a helper process.
"""

from __future__ import annotations

from .config import MemoryTier
from .report import TieredLoadReport

__all__ = ["MemoryTier", "TieredLoadReport"]
