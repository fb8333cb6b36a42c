"""The memory tier's knobs, and the job identity that keeps jobs' snapshots apart."""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass

from ..errors import UsageError

#: The base directory of snapshots when none is given: node-local shared memory.
DEFAULT_PATH = "/dev/shm/shardpoint"
DRAIN_MODES = ("process", "thread")


@dataclass(frozen=True, slots=True, kw_only=True)
class MemoryTier:
    """A memory tier for :class:`~shardpoint.CheckpointManager`: steps due only for it
    are saved to node-local shared memory (a process crash loses nothing; a lost host
    loses its own copy, which ``replicas`` copies on other hosts make up for); every
    ``durable_every``-th step is also written to the manager's root, copied from its
    snapshot by a helper process on each host. What survives what and what it costs:
    docs/tiers.md."""

    every: int = 1
    """Snapshot every N steps (``save(state, step)`` with ``step % every == 0``)."""
    durable_every: int | None = None
    """Make every K-th step durable (drained from its snapshot to the root). Required."""
    keep: int = 2
    """Snapshots kept per host (older ones are freed before a new one is written); the
    replicas a host holds for other hosts' ranks are in the same snapshots, so they count."""
    replicas: int = 0
    """Copies of each rank's snapshot files on other hosts (never its own), made in the
    background after each snapshot; more than the other hosts there are is clamped, with
    a warning, to their number."""
    path: str = DEFAULT_PATH
    """Base directory of the snapshots (node-local, e.g. under /dev/shm); each job has a 0700 folder in it."""
    job: str | None = None
    """The job's identity; default: the launcher's ``TORCHELASTIC_RUN_ID``, else derived from the root."""
    drain: str = "process"
    """Where the drain runs: ``"process"`` (a helper process, off the training GIL) or ``"thread"``."""

    def __post_init__(self) -> None:
        if self.durable_every is None:
            raise UsageError("MemoryTier needs durable_every=K: which steps are also written to the durable root "
                             "(a memory snapshot does not survive the loss of its host)")
        for name in ("every", "durable_every", "keep"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise UsageError(f"MemoryTier({name}={v!r}): must be a positive number of steps/snapshots")
        if isinstance(self.replicas, bool) or not isinstance(self.replicas, int) or self.replicas < 0:
            raise UsageError(f"MemoryTier(replicas={self.replicas!r}): the number of copies on other hosts is a "
                             "whole number >= 0 (0: none; a snapshot then does not survive the loss of its host)")
        if not isinstance(self.path, str) or not os.path.isabs(self.path):
            raise UsageError(f"MemoryTier(path={self.path!r}): give an absolute directory on node-local memory, "
                             f"e.g. {DEFAULT_PATH!r}")
        if self.drain not in DRAIN_MODES:
            raise UsageError(f"MemoryTier(drain={self.drain!r}): choose one of {DRAIN_MODES}")
        if self.job is not None and (not isinstance(self.job, str) or not self.job):
            raise UsageError(f"MemoryTier(job={self.job!r}): a job identity is a non-empty string")

    def due(self, step: int) -> tuple[bool, bool]:
        """Whether ``step`` is due for a snapshot, and for durability."""
        assert self.durable_every is not None
        return step % self.every == 0, step % self.durable_every == 0


def job_identity(tier: MemoryTier, root: str) -> str:
    """The identity snapshots are kept under: ``tier.job``, else the launcher's run id
    (``TORCHELASTIC_RUN_ID``, the same across a job's restarts, new for a new job), else
    the manager's root. Always qualified by the root, so two managers of one job differ."""
    run = tier.job or os.environ.get("TORCHELASTIC_RUN_ID", "")
    if run in ("", "none"):  # torchrun's default rendezvous id says nothing about the job
        run = "-"
    return f"run={run}\0root={root}"


def job_folder(identity: str) -> str:
    """The folder name of a job's snapshots under the tier's path."""
    return "job-" + hashlib.sha256(identity.encode()).hexdigest()[:20]
