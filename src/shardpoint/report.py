"""What a load did, key by key."""

from __future__ import annotations

from dataclasses import dataclass, field


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
        step: the step, when the load came from a :class:`CheckpointManager`.
        world_size: the number of ranks that saved the checkpoint.
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

    def sort(self) -> LoadReport:
        for name in ("loaded", "created", "missing", "skipped", "unexpected", "cast"):
            setattr(self, name, sorted(set(getattr(self, name))))
        return self

    def __str__(self) -> str:
        parts = [f"{name}={len(getattr(self, name))}" for name in ("loaded", "created", "missing", "skipped", "unexpected", "cast")]
        head = f"LoadReport(step={self.step}, " if self.step is not None else "LoadReport("
        return head + ", ".join(parts) + ")"
