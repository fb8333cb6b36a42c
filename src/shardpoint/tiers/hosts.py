"""Hosts and the plans of the memory tier over several hosts: pure functions, no I/O,
no torch.distributed.

* :class:`Hosts`: the ranks grouped by host name, hosts ordered by their lowest rank.
* :func:`replica_plan`: which rank sends which snapshot file to which rank of another
  host (replica ``j`` of a rank on host ``h`` goes to host ``(h + j) mod H``).
* :func:`restore_plan`: from every present host's inventory, the steps restorable in
  full (newest first), each with the transfers that give every host the manifest and
  the indexes (the byte ranges of data files each host's ranks read are fetched by
  the load itself: :mod:`.peer`), and the files no present host holds that the
  durable root's copy of the same save supplies (the last rung of the ladder).
* :func:`drain_parts`: which host copies which file of a snapshot to the durable root.

Every record is typed (msgspec Structs, as they travel): transfers are
:class:`~.replicate.Move`, files a host holds :class:`FileSpec`, a host's holdings
:class:`StepHolding`, and rank 0's restore decision :class:`RestoreDecision`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from ..errors import CorruptCheckpointError
from ..format.manifest import MANIFEST_NAME
from ..format.model import DataFile
from .replicate import Move

#: Sub-folders of a host's step folder: replicas received for other hosts' ranks, files
#: fetched whole from other hosts by a restore (the manifest, indexes), and byte ranges
#: of data files fetched by a restore (``ranges/<name>/<start>-<stop>``).
REPLICAS = "replicas"
FETCHED = "fetched"
RANGES = "ranges"


@dataclass(frozen=True, slots=True)
class Hosts:
    """The ranks of a group by host: ``names[h]`` is host ``h``, ``ranks[h]`` its ranks
    (ascending), hosts ordered by their lowest rank; ``of_rank[r]`` is rank ``r``'s host."""

    names: tuple[str, ...]
    ranks: tuple[tuple[int, ...], ...]
    of_rank: tuple[int, ...]

    @staticmethod
    def of(hostnames: Sequence[str]) -> Hosts:
        """Group ranks by ``hostnames[rank]``."""
        order: list[str] = []
        by: dict[str, list[int]] = {}
        for r, name in enumerate(hostnames):
            if name not in by:
                order.append(name)
                by[name] = []
            by[name].append(r)
        index = {n: h for h, n in enumerate(order)}
        return Hosts(tuple(order), tuple(tuple(by[n]) for n in order), tuple(index[n] for n in hostnames))

    def wire(self) -> dict[str, Any]:
        """JSON of the hosts, its size in the number of hosts (not ranks): each rank's
        host as runs of ``[host, count]`` (ranks of one host are usually consecutive)."""
        runs: list[list[int]] = []
        for h in self.of_rank:
            if runs and runs[-1][0] == h:
                runs[-1][1] += 1
            else:
                runs.append([h, 1])
        return {"names": list(self.names), "runs": runs}

    @staticmethod
    def from_wire(d: Mapping[str, Any]) -> Hosts:
        """Back from :meth:`wire`."""
        of_rank = tuple(int(h) for h, n in d["runs"] for _ in range(int(n)))
        names = tuple(str(n) for n in d["names"])
        return Hosts(names, tuple(tuple(r for r, x in enumerate(of_rank) if x == h) for h in range(len(names))), of_rank)

    def __len__(self) -> int:
        return len(self.names)

    def leader(self, h: int) -> int:
        """The rank that acts for host ``h`` (its lowest)."""
        return self.ranks[h][0]

    def is_leader(self, rank: int) -> bool:
        """Whether ``rank`` acts for its host (writes the manifest there, drains its
        part, reports its inventory)."""
        return self.leader(self.of_rank[rank]) == rank

    def targets(self, rank: int, replicas: int) -> list[int]:
        """The ranks that hold the replicas of ``rank``'s files: replica ``j`` (1..k) goes
        to host ``(h + j) mod H``, to the rank there at the same position as ``rank`` on
        its host (wrapping when that host has fewer ranks). Never ``rank``'s own host."""
        h = self.of_rank[rank]
        i = self.ranks[h].index(rank)
        out = []
        for j in range(1, min(replicas, len(self) - 1) + 1):
            there = self.ranks[(h + j) % len(self)]
            out.append(there[i % len(there)])
        return out


class FileSpec(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """One file of a snapshot where one host holds it: ``rel``, where it lies in the
    host's step folder (``name``, ``replicas/<name>`` or ``fetched/<name>``); ``name``,
    the name it has in the checkpoint; its ``size``; and for an index the digest its
    manifest records (``digest``, named: ``crc32:<8 hex>`` or ``sha256:<64 hex>``; None
    for a data file, whose chunks carry CRCs)."""

    rel: str
    name: str
    size: int
    digest: str | None = None


def rank_files(manifest_files: Mapping[str, DataFile]) -> dict[int, list[FileSpec]]:
    """Saving rank -> the file specs of the files it wrote (its data file, then its
    index), from a manifest's ``files`` table (version 2: every file names its rank)."""
    out: dict[int, list[FileSpec]] = {}
    for name, entry in sorted(manifest_files.items()):
        if entry.rank is None:
            raise CorruptCheckpointError(f"{name}: the manifest names no saving rank for it (a snapshot is format version 2)")
        specs = out.setdefault(entry.rank, [])
        specs.append(FileSpec(name, name, entry.size))
        idx = entry.index
        if idx is not None:
            specs.append(FileSpec(idx.name, idx.name, idx.size, idx.digest))
    return out


def needed(manifest_files: Mapping[str, DataFile]) -> dict[str, int]:
    """Every file a snapshot consists of (data files and indexes), with its size."""
    return {spec.name: spec.size for specs in rank_files(manifest_files).values() for spec in specs}


def replica_plan(hosts: Hosts, saver_files: Mapping[int, list[FileSpec]], replicas: int) -> list[Move]:
    """The transfers of a snapshot's replication, in one order every rank computes
    alike. ``saver_files``: the files each rank wrote (:func:`rank_files`); ranks are
    those of the saving group."""
    out = []
    for rank in sorted(saver_files):
        for dst in hosts.targets(rank, replicas):
            for spec in saver_files[rank]:
                out.append(Move(spec.rel, spec.name, spec.size, rank, dst, f"{REPLICAS}/{spec.name}"))
    return out


def drain_parts(hosts: Hosts, saver_files: Mapping[int, list[FileSpec]]) -> dict[int, list[FileSpec]]:
    """Host -> the file specs it drains to the durable root right after the snapshot:
    each host its own ranks' files, read from its own memory."""
    parts: dict[int, list[FileSpec]] = {}
    for rank, specs in saver_files.items():
        parts.setdefault(hosts.of_rank[rank], []).extend(specs)
    return parts


class StepHolding(msgspec.Struct, frozen=True, kw_only=True):
    """What one host holds of one step: its inventory entry (:meth:`.shm.JobArea.inventory`).
    The manifest's record (``save_id`` to ``sha``) is empty when the host holds no
    readable manifest of the step."""

    save_id: str | None = None
    healthy: bool = True
    """By the default :class:`~shardpoint.health.HealthRule`."""
    nonfinite: list[str] = []
    nan: list[str] | None = None
    roles: dict[str, str] = {}
    metrics: dict[str, float] = {}
    created: float = 0.0
    world_size: int = 0
    manifest: int | None = None
    """The manifest's size."""
    need: dict[str, int] | None = None
    """Every file the manifest names (data files and indexes), with its size."""
    data: list[str] = []
    """The data files among ``need``."""
    sha: dict[str, str] = {}
    """Each index's digest, as the manifest records it (named: ``crc32:<8 hex>`` or ``sha256:<64 hex>``)."""
    have: dict[str, tuple[int, str]] = {}
    """Every file present in the step folder, its ``replicas/`` and ``fetched/``: name ->
    (size, path relative to the step folder; the step folder's own copy preferred)."""
    ranges: dict[str, list[tuple[int, int, str]]] = {}
    """Byte ranges of data files under ``ranges/``: name -> [(start, stop, relpath)] by offset."""


#: One host's inventory: step (as a string) -> what it holds of it (``plan.restore.Inventory`` is one
#: host's holdings of one snapshot, in the planner's terms: :func:`.peer.plan_fetch` makes those from these).
HostInventory = dict[str, StepHolding]


class Redrain(msgspec.Struct, frozen=True):
    """After a restore: the step to drain again (``save_id``: its snapshot's), and which
    host copies which of its files (``parts``: host -> file specs)."""

    step: int
    save_id: str
    parts: dict[int, list[FileSpec]]


class Candidate(msgspec.Struct, frozen=True):
    """A step restorable in full from the present hosts (and the root), and how:
    ``fetch``, the whole files each host lacks (the manifest, the indexes; data files
    too for an inventory that does not say which files are data) copied from a host
    that has them; ``durable``, the files no present host holds, read from the durable
    root's checkpoint of the same step and save (a drained snapshot is byte-identical
    to its memory copy): the byte ranges the loads read of them, the indexes whole;
    ``redrain``, what to drain again once it is restored (None: nothing)."""

    step: int
    save_id: str
    fetch: list[Move]
    redrain: Redrain | None = None
    durable: list[str] = []


class RestoreDecision(msgspec.Struct, frozen=True):
    """Rank 0's decision of a restore from memory, for every rank: the snapshots passed
    over (step -> why), the steps the hosts hold in full, and the candidates, newest
    first. Travels as JSON (:meth:`wire`, :meth:`from_wire`)."""

    passed: dict[int, str]
    restorable: list[int]
    cands: list[Candidate]

    def wire(self) -> str:
        """As one JSON string."""
        return msgspec.json.encode(self).decode()

    @staticmethod
    def from_wire(data: str) -> RestoreDecision:
        """Back from :meth:`wire`."""
        return msgspec.json.decode(data, type=RestoreDecision)


def unhealthy(step: int, entry: StepHolding) -> str:
    """Why a snapshot is not fit to resume from by its health alone ("" when it is)."""
    if entry.healthy:
        return ""
    return f"it holds non-finite values in {list(entry.nonfinite)[:5]}"


def restore_plan(hosts: Hosts, inventories: Sequence[HostInventory], durable: int | None,
                 judge: Callable[[int, StepHolding], str] = unhealthy,
                 rooted: Callable[[int, str], bool] | None = None,
                 ) -> tuple[list[Candidate], dict[int, str]]:
    """The steps restorable in full from what the present hosts hold, newest first, and
    the steps passed over with why.

    ``inventories[h]`` is host ``h``'s (:class:`StepHolding` per step). A step is restorable
    when some host holds a manifest of it that ``judge(step, inventory entry)`` finds
    fit (it returns why not, "" when fit; by default: healthy), it is at least as new
    as ``durable``, and every file its manifest names is on some host at its size, or,
    for the files on no present host, ``rooted(step, save_id)`` says the durable root
    holds that step committed by the same save (asked only then): those files are read
    from there (:attr:`Candidate.durable`), the rest from memory and peers.
    The manifest and the indexes (every file but those in ``data``) that some host
    holds are fetched from the first host (by host order, rotating over its ranks)
    that has them, into ``fetched/`` on each host that lacks them; data files are read
    by byte range."""
    by_step: dict[tuple[int, str], list[int]] = {}  # (step, save id) -> hosts holding its manifest
    for h, inv in enumerate(inventories):
        for key, st in inv.items():
            if st.save_id is not None:
                by_step.setdefault((int(key), st.save_id), []).append(h)
    out: list[Candidate] = []
    passed: dict[int, str] = {}
    for (step, sid), holders in sorted(by_step.items(), key=lambda kv: (kv[0][0], len(kv[1])), reverse=True):
        if durable is not None and step < durable:
            continue
        first = inventories[holders[0]][str(step)]
        why = judge(step, first)
        if why:
            passed[step] = why
            continue
        need: dict[str, int] = dict(first.need or {})
        need[MANIFEST_NAME] = int(first.manifest or 0)
        where: dict[str, list[tuple[int, str]]] = {}
        for h, inv in enumerate(inventories):
            held = inv.get(str(step))
            if held is None:
                continue
            st = held
            if st.save_id == sid:
                where.setdefault(MANIFEST_NAME, []).append((h, MANIFEST_NAME))
            for name, (size, rel) in st.have.items():
                if need.get(name) == size and name != MANIFEST_NAME:
                    where.setdefault(name, []).append((h, rel))
        lost = sorted(n for n in need if n not in where)
        if lost and (rooted is None or not rooted(step, sid)):
            passed.setdefault(step, f"{len(lost)} of its files are on no present host (e.g. {lost[0]}), and the "
                                    "durable root holds no copy of this save of it")
            continue
        fetch: list[Move] = []
        turn = 0
        data = set(first.data)
        for name in sorted((n for n in need if n not in data and n in where),
                           key=lambda n: n == MANIFEST_NAME):  # the manifest last
            holders_of = {h: rel for h, rel in reversed(where[name])}
            src_h = min(holders_of)
            for h in range(len(hosts)):
                if h in holders_of:
                    continue
                src = hosts.ranks[src_h][turn % len(hosts.ranks[src_h])]
                dst = hosts.ranks[h][turn % len(hosts.ranks[h])]
                rel = name if name == MANIFEST_NAME else f"{FETCHED}/{name}"
                fetch.append(Move(holders_of[src_h], name, need[name], src, dst, rel))
                turn += 1
        out.append(Candidate(step, sid, fetch, durable=lost))
    return out, passed


def redrain_parts(hosts: Hosts, inventories: Sequence[HostInventory], chosen: Candidate,
                  due: Sequence[int], durable: int | None) -> Redrain | None:
    """After restoring ``chosen``: the newest step due for durability (in ``due``),
    newer than ``durable`` and not newer than the restored step, whose snapshot is
    whole on the present hosts and whose manifest rank 0's host holds (or gets, for
    the restored step itself), with its save id and which host drains which file (the
    first host, by host order, holding it). None when there is none."""
    for step in sorted(due, reverse=True):
        if step > chosen.step or (durable is not None and step <= durable):
            continue
        nothing = StepHolding()
        if step == chosen.step:  # rank 0's host holds its manifest once the restore's fetch is done
            st0 = next((inv[str(step)] for inv in inventories
                        if inv.get(str(step), nothing).save_id == chosen.save_id), None)
            if st0 is None:
                return None
        else:
            st0 = inventories[0].get(str(step))
            if st0 is None or st0.save_id is None or not st0.healthy:
                continue
        parts: dict[int, list[FileSpec]] = {}
        for name, size in (st0.need or {}).items():
            for h in range(len(inventories)):
                got = inventories[h].get(str(step), nothing).have.get(name)
                if got is not None and got[0] == size:
                    parts.setdefault(h, []).append(FileSpec(got[1], name, size, st0.sha.get(name)))
                    break
            else:
                return None
        return Redrain(step, str(st0.save_id), parts)
    return None
