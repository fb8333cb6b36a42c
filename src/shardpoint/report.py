"""What a load did, key by key."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field

_LISTS = ("loaded", "created", "missing", "skipped", "unexpected", "cast")


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

    def sort(self) -> LoadReport:
        for name in _LISTS:
            setattr(self, name, sorted(set(getattr(self, name))))
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
