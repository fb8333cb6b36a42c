"""The exceptions shardpoint raises.

Every error is a :class:`ShardpointError`; catch one of its subclasses to handle
a specific failure. A usage error is also a ``ValueError`` (:class:`UsageError`) or
a ``TypeError`` (:class:`UnsupportedTypeError`), so ``except ValueError`` keeps
working. Messages name the key, file or rank involved and say what to do about it.
The classes are listed in docs/errors.md, each with an example.
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
    "RankFailedError",
    "ChannelClosedError",
    "CheckpointReplacedError",
    "UnhealthyCheckpointError",
    "ConversionError",
    "UnsupportedConfigError",
    "StorageError",
    "MemoryTierError",
    "AllocationError",
    "MissingDependencyError",
    "InternalError",
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
    """A converter or an integration met a checkpoint of another format that it does
    not read (a model-parallel DeepSpeed checkpoint, DCP transforms, a file that needs
    pickled code to load, a tensor dtype shardpoint does not know, a file Lightning's
    own ``CheckpointIO`` wrote). The message says what is not supported and what to do
    instead."""


class ConversionError(CorruptCheckpointError):
    """A converter's input, a checkpoint of another format (a DeepSpeed folder, a
    safetensors file), is malformed or incomplete: files missing for some ranks, files
    from different saves, a tensor stored twice. Nothing was written. The message names
    the file and what it lacks."""


class RankFailedError(ShardpointError):
    """A rank failed in a collective call (its own error, a full disk, say), so the
    call failed on every rank; or a transfer with peers failed because one of them died.
    The message carries the failing rank's error; fix it there."""

    def __init__(self, message: str, *, rank: int | None = None, ranks: list[int] | None = None) -> None:
        super().__init__(message)
        #: The rank that failed (None: one of :attr:`ranks`, not known which).
        self.rank = rank
        #: Every rank the error is about: the failed ones, or the peers of a failed transfer.
        self.ranks: list[int] = sorted(ranks if ranks is not None else ([] if rank is None else [rank]))


class ChannelClosedError(ShardpointError):
    """The process is exiting: shardpoint's checkpoint collectives and transfers were
    closed under a call still running on another thread. Nothing was committed by it."""


class CheckpointReplacedError(ShardpointError):
    """The checkpoint a load opened was replaced or removed while the load read it (a
    save with ``overwrite=True`` or retention); nothing is damaged. Load again."""


class UnhealthyCheckpointError(ShardpointError):
    """A manager's restore found no checkpoint fit to resume from: every one holds
    NaN/inf where training needs finite values, or fails ``accept=``. The message lists
    each step and why; ``restore(state, step=N)`` loads one as it is."""


class UnsupportedConfigError(ShardpointError):
    """An integration refuses a framework configuration it cannot checkpoint or resume
    with: a DeepSpeed optimizer wrapper or NVMe offload it does not know, a trainer with
    several optimizers, DeepSpeed or FSDP under the HF Trainer integration, a resume
    whose batch size does not divide the checkpoint's position. The message names the
    setting and what to use instead."""


class StorageError(ShardpointError):
    """The storage refused a request: a checkpoint directory cannot be created, an
    export could not write its destination. The message names the path and the fix."""


class MemoryTierError(ShardpointError):
    """The memory tier (:class:`~shardpoint.MemoryTier`) cannot keep or move its
    snapshots: its folder cannot be made or is not this user's or this job's, a transfer
    of snapshot files between hosts failed, its drain helper process is gone. The
    durable checkpoints are not affected."""


class AllocationError(ShardpointError, MemoryError):
    """A load could not allocate a tensor the checkpoint holds and the state lacks;
    also a ``MemoryError``. Load fewer keys at once (``only=``) or on a larger machine."""


class MissingDependencyError(ShardpointError, ImportError):
    """An optional package a feature needs is not installed (an integration's framework,
    fsspec for object stores); also an ``ImportError``. The message names the extra to
    install."""


class InternalError(ShardpointError):
    """shardpoint found its own state inconsistent: a bug, not something the caller did.
    Nothing was committed; report it with the message (and save again)."""


class ObjectStoreError(StorageError):
    """An object-store request kept failing with transient errors (5xx, SlowDown,
    reset connections, timeouts) until its attempts ran out, or failed for good (access
    denied, no such bucket). The message names the object and the last error."""
