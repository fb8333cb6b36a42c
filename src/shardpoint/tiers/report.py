"""What a restore through the tiers did: a :class:`LoadReport` that also says where
the bytes came from."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from ..report import LoadReport


@dataclass(slots=True)
class TieredLoadReport(LoadReport):
    """A :class:`~shardpoint.LoadReport` from :meth:`CheckpointManager.restore` when the
    manager has a memory tier.

    Attributes:
        tier: ``"memory"`` (a snapshot in the hosts' shared memory) or ``"durable"``
            (the manager's root).
        source: the location this rank read from (its host's snapshot folder, or the
            durable step folder).
        pieces: (memory) each checkpoint file this rank read, with where its bytes
            came from on this rank's host: ``"own"`` (written there by the save),
            ``"replica"`` (a copy replication put there for a rank of another host) or
            ``"fetched"`` (copied from another host's memory by this restore), or
            ``"durable"`` (on no present host: read from the durable root's checkpoint
            of the same step and save). Empty for a durable restore: every byte came
            from the root.
        received: (memory) the bytes this rank received from other hosts' memory for
            this restore: the byte ranges of data files its host lacked that its
            host's ranks read, and the manifest or indexes when its host lacked them.
        host_needed: (memory) the bytes of the data files its host lacked that the
            loads of its host's ranks need (each byte once, before rounding to
            checksum blocks): what the ranges received by the host's ranks carry, at
            least.
        durable_read: (memory) the bytes this rank read from the durable root: of the
            files no present host held, the byte ranges its load read (rounded to
            checksum blocks, as any read) and the indexes it needed whole.
        host_durable_needed: (memory, over several hosts) the bytes of those files
            that the loads of its host's ranks need (each byte once, before rounding).
    """

    tier: str = "durable"
    source: str = ""
    pieces: dict[str, str] = field(default_factory=dict)
    received: int = 0
    host_needed: int = 0
    durable_read: int = 0
    host_durable_needed: int = 0

    @staticmethod
    def of(report: LoadReport, tier: str, source: str, pieces: dict[str, str] | None = None, *,
           received: int = 0, host_needed: int = 0, durable_read: int = 0,
           host_durable_needed: int = 0) -> TieredLoadReport:
        """``report`` with its tier, source, pieces and bytes received."""
        return TieredLoadReport(**{f.name: getattr(report, f.name) for f in fields(LoadReport)}, tier=tier,
                                source=source, pieces=dict(pieces or {}), received=received,
                                host_needed=host_needed, durable_read=durable_read,
                                host_durable_needed=host_durable_needed)
