"""What a restore through the tiers did: a :class:`LoadReport` that also says where
the bytes came from."""

from __future__ import annotations

from dataclasses import dataclass, fields

from ..report import LoadReport


@dataclass(slots=True)
class TieredLoadReport(LoadReport):
    """A :class:`~shardpoint.LoadReport` from :meth:`CheckpointManager.restore` when the
    manager has a memory tier.

    Attributes:
        tier: ``"memory"`` (a snapshot in this host's shared memory) or ``"durable"``
            (the manager's root).
        source: the location the bytes were read from.
    """

    tier: str = "durable"
    source: str = ""

    @staticmethod
    def of(report: LoadReport, tier: str, source: str) -> TieredLoadReport:
        """``report`` with its tier and source."""
        return TieredLoadReport(**{f.name: getattr(report, f.name) for f in fields(LoadReport)}, tier=tier,
                                source=source)
