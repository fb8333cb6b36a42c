"""The exceptions shardpoint raises.

Every error is a :class:`ShardpointError`; catch one of its subclasses to handle
a specific failure. A usage error is also a ``ValueError`` (:class:`UsageError`) or
a ``TypeError`` (:class:`UnsupportedTypeError`), so ``except ValueError`` keeps
working. Messages name the key, file or rank involved and say what to do about it.
The classes are listed in docs/errors.md.
"""

from __future__ import annotations

__all__ = [
    "ShardpointError",
    "CheckpointNotFoundError",
    "CorruptCheckpointError",
    "KeyMismatchError",
    "CollectiveMismatchError",
    "UsageError",
    "UnsupportedTypeError",
    "SaveTimeoutError",
    "ObjectStoreError",
    "CheckpointExistsError",
    "FencedError",
    "RankMismatchError",
    "SaveAbortedError",
    "UnsupportedCheckpointError",
]


class ShardpointError(Exception):
    """Base class of every error shardpoint raises."""


class CheckpointNotFoundError(ShardpointError, FileNotFoundError):
    """No committed checkpoint (no manifest) exists at the given path."""


class CorruptCheckpointError(ShardpointError):
    """A checkpoint's manifest or data does not match what was written: a bad
    checksum, a truncated or missing file, or a manifest that contradicts itself."""


class KeyMismatchError(ShardpointError, KeyError):
    """The keys of the local state and of the checkpoint do not agree (strict
    load), or a value cannot be placed into its target (shape, layout)."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0]) if self.args else ""


class CollectiveMismatchError(ShardpointError):
    """The ranks of a collective save or load did not all arrive, or arrived with
    different arguments, or one of them failed while the others went on."""

    def __init__(self, message: str, *, ranks: list[int] | None = None) -> None:
        super().__init__(message)
        #: The ranks the error is about (absent, disagreeing or failed ranks).
        self.ranks: list[int] = sorted(ranks or [])


class UsageError(ShardpointError, ValueError):
    """An argument or a state that shardpoint cannot take (a bad option, a value it
    cannot save); also a ``ValueError``, so ``except ValueError`` keeps working."""


class CheckpointExistsError(UsageError, FileExistsError):
    """A committed checkpoint is already at the path a save (or a converter) writes
    to, and it was not asked to replace it (``overwrite=True``). Raised alike by a
    collective save, the offline converters and the memory tier's drain."""

    def __str__(self) -> str:  # OSError would format its args as (errno, strerror)
        return str(self.args[0]) if self.args else ""


class FencedError(ShardpointError):
    """A newer attempt of the job took ownership of the checkpoint root (it restored
    from it, or saved into it, after this one): this attempt's commit, ``latest``
    update or retention was refused and nothing was written. The message names the
    root, both generations and what to do. See docs/guarantees.md ("one writer")."""

    def __init__(self, message: str, *, root: str = "", generation: int = 0, newer: int = 0) -> None:
        super().__init__(message)
        #: The manager root.
        self.root = root
        #: This attempt's generation, and the newer one that took the root.
        self.generation, self.newer = generation, newer


class UnsupportedTypeError(ShardpointError, TypeError):
    """The state holds an object shardpoint cannot save (the message names its key
    and what to use instead); also a ``TypeError``."""


class SaveTimeoutError(ShardpointError, TimeoutError):
    """A wait on an asynchronous save's handle ran out of time; the save goes on."""


class RankMismatchError(ShardpointError):
    """The ranks' states disagree where they must agree: a key is a tensor on one rank
    and a value on another, a tensor's global shape or dtype differs, a replicated
    value or tensor holds different bytes (a diverged run), or the ranks run different
    shardpoint versions. The message names the key and the ranks."""


class SaveAbortedError(ShardpointError):
    """A save was abandoned and committed nothing because what it was writing changed
    under it: a file it wrote (or one an incremental save refers to) was removed or
    replaced before the commit, or a saved tensor changed during an overlapped copy.
    Earlier checkpoints are untouched; save again."""


class UnsupportedCheckpointError(ShardpointError):
    """A converter met a checkpoint of another format that it does not read (a
    model-parallel DeepSpeed checkpoint, DCP transforms, a file that needs pickled code
    to load). The message says what is not supported and what to do instead."""


class ObjectStoreError(ShardpointError):
    """An object-store request kept failing with transient errors (5xx, SlowDown,
    reset connections, timeouts) until its attempts ran out, or failed for good (access
    denied, no such bucket). The message names the object and the last error."""
