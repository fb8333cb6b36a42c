"""shardpoint: save the whole state of a PyTorch training run from any number of
processes and resume it on any other number, with no conversion step and no
silent loss."""

from __future__ import annotations

__version__ = "0.1.0"

import atexit as _atexit  # noqa: E402

from . import _exit  # noqa: E402

if _exit.SETTLE > 0:  # torch's gloo workers drop their last tensor references before finalisation (_exit.py)
    _atexit.register(_exit.settle_gloo_workers)

from .api import load, load_full, metadata, save  # noqa: E402
from .errors import (  # noqa: E402
    CheckpointNotFoundError,
    CollectiveMismatchError,
    CorruptCheckpointError,
    FencedError,
    KeyMismatchError,
    ShardpointError,
    UsageError,
)
from .manager import CheckpointInfo, CheckpointManager  # noqa: E402
from .report import LoadReport  # noqa: E402
from .saving.handle import SaveHandle  # noqa: E402
from .state import TrainState  # noqa: E402
from .storage import Storage  # noqa: E402
from .tiers import MemoryTier  # noqa: E402
from .tree import PerRank  # noqa: E402

__all__ = [
    "save",
    "load",
    "load_full",
    "metadata",
    "PerRank",
    "TrainState",
    "CheckpointManager",
    "CheckpointInfo",
    "MemoryTier",
    "LoadReport",
    "SaveHandle",
    "Storage",
    "ShardpointError",
    "CheckpointNotFoundError",
    "CorruptCheckpointError",
    "KeyMismatchError",
    "CollectiveMismatchError",
    "FencedError",
    "UsageError",
]
