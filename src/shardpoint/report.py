"""What a load did, key by key; and what a save or a load cost (:class:`SaveStats`,
:class:`LoadStats`), the figures shardpoint logs (the ``shardpoint`` logger) and a
manager's ``on_event`` hook receives."""

from __future__ import annotations

import time
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

_LISTS = ("loaded", "created", "missing", "skipped", "unexpected", "cast")


@dataclass(frozen=True, slots=True, kw_only=True)
class SaveStats:
    """What one save cost, as one rank saw it (each rank has its own; rank 0's also
    counts the whole checkpoint)."""

    path: str
    """Where the checkpoint was committed."""
    step: int | None
    """The step, when a :class:`~shardpoint.CheckpointManager` saved it."""
    rank: int
    world_size: int
    bytes_written: int
    """This rank's data file and index."""
    bytes_referenced: int
    """This rank's chunks stored by reference to an earlier checkpoint (incremental saves)."""
    checkpoint_bytes: int | None
    """Rank 0: every rank's data files together; None on the other ranks."""
    wall_s: float
    """Seconds from the call to the commit (every rank returned from it)."""
    stall_s: float
    """Seconds the caller was blocked: ``wall_s`` for a blocking save; until the
    state was staged with ``blocking=False``; until the call returned with ``overlap``."""
    phases: Mapping[str, float] = field(default_factory=dict)
    """Seconds per stage: ``describe``, ``coordinate``, ``stage``, ``write``, ``commit``."""
    when: float = field(default_factory=time.time)
    """When the commit was done (seconds since the epoch)."""

    @property
    def throughput(self) -> float:
        """This rank's bytes written per second of the save's wall time."""
        return self.bytes_written / self.wall_s if self.wall_s > 0 else 0.0


@dataclass(frozen=True, slots=True, kw_only=True)
class LoadStats:
    """What one load cost on one rank."""

    path: str
    step: int | None
    rank: int
    bytes_read: int
    """Bytes this rank read (what its targets need, with neighbouring chunks read together)."""
    wall_s: float
    phases: Mapping[str, float] = field(default_factory=dict)
    """Seconds per stage: ``locate`` (manifest, key check, agreement), ``read`` (reads and placing), ``finish``."""
    tier: str = "durable"
    """Where it was read from: ``durable`` (the path), or ``memory`` (a manager's memory tier)."""

    @property
    def throughput(self) -> float:
        return self.bytes_read / self.wall_s if self.wall_s > 0 else 0.0


def human(n: int | float | None) -> str:
    """Bytes as a person reads them: ``1.2 GB``."""
    if n is None:
        return "-"
    x = float(n)
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(x) < 1000 or unit == "TB":
            return f"{x:.0f} {unit}" if unit == "B" else f"{x:.1f} {unit}"
        x /= 1000
    return f"{x:.1f} PB"  # pragma: no cover - the loop returns


@dataclass(slots=True)
class LoadReport:
    """What :func:`shardpoint.load` did on this rank. Every field lists leaf keys
    (the nested path joined with ``/``), sorted.

    Attributes:
        loaded: keys of the local state filled from the checkpoint (in place).
        created: checkpoint keys that no rank held, created in the local state.
        missing: keys of the local state the checkpoint lacks (``strict`` raises).
        skipped: keys left out by ``only``/``exclude`` (local and checkpoint).
        unexpected: checkpoint keys no rank held that were not created
            (``create=False``, or no container to put them in).
        cast: loaded keys whose dtype differs from the checkpoint's (converted).
        per_rank: for each per-rank value: ``"restored"`` (this rank's own saved value)
            or ``"kept"`` (this rank did not exist at save time; its value is untouched).
            An owner's RNG streams (``.../rng/streams``) say ``"restored"``,
            ``"derived"`` (a new rank, seeded from the base seed) or ``"not in checkpoint"``.
        step: the step, when the load came from a :class:`CheckpointManager`.
        world_size: the number of ranks that saved the checkpoint.
        passed_over: steps :meth:`CheckpointManager.restore` did not restore, newest
            first, each with why (non-finite values, a rejected metric).
        stats: what the load cost on this rank (bytes, seconds per stage).
    """

    loaded: list[str] = field(default_factory=list)
    created: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    cast: list[str] = field(default_factory=list)
    per_rank: dict[str, str] = field(default_factory=dict)
    step: int | None = None
    world_size: int | None = None
    bytes_read: int = 0
    passed_over: dict[int, str] = field(default_factory=dict)
    stats: LoadStats | None = None

    def sort(self) -> LoadReport:
        """Each list sorted, without repeats (sorted first: a list in a walk's order is
        mostly in runs, which a sort takes as they are; a set's order has none)."""
        for name in _LISTS:
            setattr(self, name, list(dict.fromkeys(sorted(getattr(self, name)))))
        return self

    def take(self, prefix: str) -> LoadReport:
        """Remove the keys under ``prefix`` (a key; ``""`` is the root) and return them
        as a report of their own, keyed relative to ``prefix``: what an owner nested at
        ``prefix`` sees of the load. :meth:`put` puts them back."""
        if prefix == "":
            sub = LoadReport(**{n: getattr(self, n) for n in _LISTS}, per_rank=self.per_rank)
            for n in _LISTS:
                setattr(self, n, [])
            self.per_rank = {}
        else:
            head = prefix + "/"
            sub = LoadReport()
            for n in _LISTS:
                keep = []
                for k in getattr(self, n):
                    (getattr(sub, n).append(k[len(head) :]) if k.startswith(head) else keep.append(k))
                setattr(self, n, keep)
            sub.per_rank = {k[len(head) :]: v for k, v in self.per_rank.items() if k.startswith(head)}
            self.per_rank = {k: v for k, v in self.per_rank.items() if not k.startswith(head)}
        sub.step, sub.world_size, sub.bytes_read = self.step, self.world_size, self.bytes_read
        return sub

    def put(self, prefix: str, sub: LoadReport) -> None:
        """Merge back what :meth:`take` took, keys prefixed again."""
        head = prefix + "/" if prefix else ""
        for n in _LISTS:
            getattr(self, n).extend(head + k for k in getattr(sub, n))
        self.per_rank.update({head + k: v for k, v in sub.per_rank.items()})

    def settle_created(self, created: Collection[str], transient: Collection[str]) -> None:
        """The fix-up after an owner created state before the load (optimizer state of
        a never-stepped optimizer), keys relative to the owner: those keys were loaded
        into what the owner created, so they are reported as ``created``. Keys the core
        created under the owner's ``transient`` parts (the dicts its ``state_dict()``
        builds afresh on each call and never reads back, e.g. a parameter this model
        lacks) went nowhere: they are reported as ``unexpected``."""
        mine = set(created) & set(self.loaded)
        self.loaded = [k for k in self.loaded if k not in mine]
        stray = {k for k in self.created if k not in mine and k.split("/", 1)[0] in transient}
        self.created = sorted((set(self.created) - stray) | mine)
        self.unexpected = sorted(set(self.unexpected) | stray)

    def __str__(self) -> str:
        parts = [f"{name}={len(getattr(self, name))}" for name in ("loaded", "created", "missing", "skipped", "unexpected", "cast")]
        head = f"LoadReport(step={self.step}, " if self.step is not None else "LoadReport("
        return head + ", ".join(parts) + ")"
