"""Replica placement for the memory tier: which hosts keep the copies of each rank's
snapshot files. Pure: host and rank numbers in, placements out.

The tier today (``tiers.hosts.Hosts.targets``) sends replica ``j`` (1..k) of every
rank of host ``h`` to host ``(h + j) mod H``: the ring. It survives the loss of any
``k`` hosts, but when host ``h`` is lost, host ``h + 1`` alone holds all of ``h``'s
files and serves all of them to the restore, besides its own: twice the bytes of any
other host. :func:`replica_hosts` spreads them: the files of the rank at position
``i`` on host ``h`` go to hosts ``h + 1 + ((i mod w) + j w) mod (H - 1)``, ``j < k``,
with ``w`` (the width) the ranks of the host by default. With ``replicas=1`` the eight
files of a host of eight ranks lie on the eight next hosts, one each: a lost host's
bytes are served by eight hosts, each 1/8 of a host's share more than the others.
Every host still keeps exactly ``k`` replicas per rank position (the same memory as
the ring), and ``width=1`` is the ring exactly.

What survives what (any placement that puts a rank's ``k + 1`` copies on distinct
hosts, which both do): the loss of any ``k`` hosts at once. ``k + 1`` losses lose a
file when they are a host and the holders of one of its ranks' replicas: with the
ring, ``k + 1`` consecutive hosts in host order; spread over width ``w``, a host and
``k`` hosts among its next ``k w``: for ``k = 1``, any two hosts at most ``w`` apart,
``w`` times as many pairs as the ring's adjacent ones (at 1,024 hosts and ``w = 8``,
1.6% of all pairs against 0.2%), each pair losing one rank's file where the ring loses
a whole host's. Either way such a snapshot is not whole, and the restore falls back
to the durable root; ``replicas=2`` makes every pair of losses survivable.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["lost_files", "replica_hosts", "replica_ranks"]


def replica_hosts(n_hosts: int, host: int, position: int, replicas: int, width: int | None = None,
                  ranks_here: int = 1) -> tuple[int, ...]:
    """The hosts that keep the replicas of the rank at ``position`` on host ``host``
    (of ``n_hosts``), never ``host`` itself, all distinct. ``replicas`` is clamped to
    ``n_hosts - 1``; ``width`` (default: ``ranks_here``, the ranks of that host) is how
    many hosts one replica of a host's ranks spreads over, clamped so that the ``k``
    replicas of one rank land on distinct hosts; 1 is the ring."""
    k = min(replicas, n_hosts - 1)
    if k <= 0:
        return ()
    w = max(1, min(width if width is not None else ranks_here, (n_hosts - 1) // k))
    step = position % w
    return tuple((host + 1 + (step + j * w) % (n_hosts - 1)) % n_hosts for j in range(k))


def replica_ranks(ranks: Sequence[Sequence[int]], replicas: int, width: int | None = None) -> dict[int, tuple[int, ...]]:
    """Rank -> the ranks that receive its replicas: on each host of
    :func:`replica_hosts`, the rank at the same position (wrapping when that host has
    fewer ranks), as the tier's ring does. ``ranks[h]``: host ``h``'s ranks, in order."""
    out: dict[int, tuple[int, ...]] = {}
    for h, here in enumerate(ranks):
        for i, r in enumerate(here):
            there = replica_hosts(len(ranks), h, i, replicas, width, len(here))
            out[r] = tuple(ranks[g][i % len(ranks[g])] for g in there)
    return out


def lost_files(ranks: Sequence[Sequence[int]], replicas: int, lost: set[int], width: int | None = None) -> list[int]:
    """The ranks none of whose copies (own host, replica hosts) is on a host left when
    the hosts ``lost`` are gone: whose snapshot files the restore cannot find in memory."""
    out = []
    for h, here in enumerate(ranks):
        for i, r in enumerate(here):
            if h in lost and all(g in lost for g in replica_hosts(len(ranks), h, i, replicas, width, len(here))):
                out.append(r)
    return out
