"""Peer memory as storage: a restore from the memory tier fetches, for each host, only
the byte ranges of data files its ranks' loads read, from the nearest holder.

The load plans its reads as always (:mod:`shardpoint.load`); before it reads, its
``fetch`` stage (:class:`PeerFetch`, collective) sends each rank's ranges (what its
reader reads: each job's bytes rounded out to whole checksum blocks, so that the
load verifies every byte it uses, as from any storage) to rank 0, minus what its own
host already holds (whole files: its own, its replicas; ranges fetched before). Rank
0 merges them per host and chooses a holder for each with the restore planner
(:func:`shardpoint.plan.restore.choose_sources`: one holder per file and reader host,
spread over the holders, least loaded first), and sends each rank only the moves it
takes part in (:func:`~shardpoint.collective.coordinate`). The moves run on the side
lane (:func:`.replicate.transfer`: a holder serves a range from a memory map of its
file; the receiver writes ``ranges/<name>/<start>-<stop>`` under a temporary name
and renames it whole); then every rank's load reads through its host's
:class:`~.view.TieredView`. A replacement host (empty) is the same restore: it holds
nothing, so it fetches exactly what its ranks read. Files no present host holds,
when the durable root holds the same save of the step (:attr:`.hosts.Candidate.durable`),
are not moved: each rank's load reads its ranges of them from the root, through the
same view (the ladder per file: this host's memory, a peer's, the durable root).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import msgspec
import numpy as np

from ..collective import Comm, agree, coordinate
from ..errors import CollectiveMismatchError, MemoryTierError, RankFailedError, ShardpointError
from ..load.read import FileRange
from ..plan.restore import DURABLE, HeldRange, Inventory, Needs, NewWorld, SnapshotLayout, choose_sources
from .hosts import RANGES, Hosts, StepHolding
from .replicate import Move, tagged, transfer
from .view import TieredView


class Wants(msgspec.Struct, frozen=True, array_like=True):
    """What one rank asks for (to rank 0): the ranges of files its host lacks that its
    jobs need (exact) and that its reader reads (rounded to checksum blocks)."""

    exact: list[FileRange]
    read: list[FileRange]


class Order(msgspec.Struct, frozen=True, array_like=True):
    """Rank 0's answer to one rank: the moves it sends or receives (tagged), what its
    host's ranks need of files it lacks that peers hold (exact bytes, each byte once)
    and will receive, and what they need of files only the durable root holds
    (``durable``, exact bytes, each byte once); or why the ranges cannot be had
    (``missing``, the same on every rank)."""

    moves: list[Move]
    needed: int = 0
    incoming: int = 0
    missing: str = ""
    durable: int = 0


def _merge(ranges: Sequence[FileRange]) -> list[FileRange]:
    out: list[FileRange] = []
    for r in sorted(ranges, key=lambda r: (r.file, r.start, r.stop)):
        if out and out[-1].file == r.file and r.start <= out[-1].stop:
            if r.stop > out[-1].stop:
                out[-1] = FileRange(r.file, out[-1].start, r.stop)
            continue
        out.append(r)
    return out


def plan_fetch(hosts: Hosts, holdings: Sequence[StepHolding], sizes: Mapping[str, int],
               wants: Sequence[Wants | None], durable: Collection[str] = ()) -> list[Order]:
    """Rank 0, pure: from each rank's :class:`Wants` (None: nothing) and each host's
    holdings of the step (its inventory entry: whole files and ranges), every rank's :class:`Order`.
    ``sizes``: the data files' sizes. Each host's ranks' ranges are merged (a byte two
    of its ranks read travels once); the holder of each (reader host, file) is chosen
    by :func:`~shardpoint.plan.restore.choose_sources`; senders and receivers rotate
    over the holder's and the reader's ranks. A range no present host holds is read
    from the durable root when its file is in ``durable`` (no move; the root holds
    the same save), and makes the orders say ``missing`` otherwise."""
    n_hosts = len(hosts)
    read: list[list[FileRange]] = [[] for _ in range(n_hosts)]
    exact: list[list[FileRange]] = [[] for _ in range(n_hosts)]
    for rank, w in enumerate(wants):
        if w is not None:
            read[hosts.of_rank[rank]] += w.read
            exact[hosts.of_rank[rank]] += w.exact
    read = [_merge(r) for r in read]
    exact = [_merge(e) for e in exact]
    rows = [(h, r) for h in range(n_hosts) for r in read[h]]
    names = sorted(sizes)
    index = {n: i for i, n in enumerate(names)}
    invs = []
    for h, st in enumerate(holdings):
        whole = frozenset(index[n] for n, (size, _rel) in st.have.items() if n in index and size == sizes[n])
        held = tuple(HeldRange(index[n], a, b) for n, v in st.ranges.items() if n in index for a, b, _rel in v)
        invs.append(Inventory(h, whole, held))
    orders: list[list[Move]] = [[] for _ in range(len(hosts.of_rank))]
    incoming = [0] * n_hosts
    from_root: dict[tuple[int, str], list[FileRange]] = {}  # (reader host, file) -> its rows read from the root
    if rows:
        k = len(rows)
        length = np.array([r.stop - r.start for _, r in rows], dtype=np.int64)
        layout = SnapshotLayout(shape=length.reshape(k, 1), itemsize=np.ones(k, dtype=np.int64),
                                tensor=np.arange(k, dtype=np.int32),
                                file=np.array([index[r.file] for _, r in rows], dtype=np.int32),
                                offset=np.array([r.start for _, r in rows], dtype=np.int64),
                                box_offsets=np.zeros((k, 1), dtype=np.int64), box_sizes=length.reshape(k, 1),
                                file_size=np.array([sizes[n] for n in names], dtype=np.int64))
        needs = Needs(np.array([h for h, _ in rows], dtype=np.int32), np.arange(k, dtype=np.int64),
                      layout.offset, layout.offset + length)
        plan = choose_sources(layout, needs, NewWorld(np.arange(n_hosts, dtype=np.int32)), invs,
                              holder_verifies=False)  # the reader's load verifies every block it reads
        lost = [rows[i] for i in np.nonzero(plan.source == DURABLE)[0].tolist() if rows[i][1].file not in durable]
        if lost:
            h, r = lost[0]
            why = (f"bytes {r.start}..{r.stop} of {r.file} (read on host {hosts.names[h]}) are on no present host"
                   + (f", and {len(lost) - 1} more ranges" if len(lost) > 1 else ""))
            return [Order([], missing=why)] * len(hosts.of_rank)
        for i in np.nonzero(plan.source == DURABLE)[0].tolist():
            h, r = rows[i]
            from_root.setdefault((h, r.file), []).append(r)
        moves = _moves(hosts, holdings, sizes, rows, plan.source.tolist())  # none from the root: each rank reads
        for m in tagged(moves):
            orders[m.src].append(m)
            orders[m.dst].append(m)
            incoming[hosts.of_rank[m.dst]] += m.size
    # what each host's ranks need (exact bytes, each once): from peers (or ranges it holds), and from the root
    # (a merged exact range lies inside one merged row: the rounded-out reads of touching ranges touch too)
    needed, rooted = [0] * n_hosts, [0] * n_hosts
    for h, es in enumerate(exact):
        for e in es:
            there = from_root.get((h, e.file), ())
            if any(r.start <= e.start and e.stop <= r.stop for r in there):
                rooted[h] += e.stop - e.start
            else:
                needed[h] += e.stop - e.start
    return [Order(orders[r], needed[hosts.of_rank[r]], incoming[hosts.of_rank[r]], durable=rooted[hosts.of_rank[r]])
            for r in range(len(hosts.of_rank))]


def _moves(hosts: Hosts, holdings: Sequence[StepHolding], sizes: Mapping[str, int],
           rows: Sequence[tuple[int, FileRange]], source: Sequence[int]) -> list[Move]:
    """The moves of the planned rows: per (reader host, file, holder), ranges that touch
    made one, from the holder's whole file; from a holder of ranges, each row from the
    range that covers it."""
    groups: dict[tuple[int, str, int], list[FileRange]] = {}
    for (h, r), src in zip(rows, source):
        if src not in (h, DURABLE):  # a range from the root is read there by the rank itself
            groups.setdefault((h, r.file, src), []).append(r)
    out: list[Move] = []
    turn = 0
    for (h, name, src), rs in sorted(groups.items()):
        whole = holdings[src].have.get(name)
        pieces: list[tuple[int, int, int, str, int]] = []  # start, stop, offset in the source, its relpath, its size
        if whole is not None and whole[0] == sizes[name]:
            pieces = [(r.start, r.stop, r.start, whole[1], sizes[name]) for r in _merge(rs)]
        else:
            for r in rs:
                a, b, rel = next(p for p in holdings[src].ranges[name] if p[0] <= r.start and r.stop <= p[1])
                pieces.append((r.start, r.stop, r.start - a, rel, b - a))
        for a, b, off, rel, src_size in pieces:
            there, here = hosts.ranks[src], hosts.ranks[h]
            out.append(Move(rel, name, b - a, there[turn % len(there)], here[turn % len(here)],
                            f"{RANGES}/{name}/{a}-{b}", offset=off, src_size=src_size))
            turn += 1
    return out


class PeerFetch:
    """The ``fetch`` stage of a restore's load (:data:`shardpoint.load.pipeline.Fetch`):
    collective; see the module docstring. ``holdings`` (rank 0): each host's inventory
    entry of the step. After it ran: ``received``, the bytes this rank received;
    ``needed``/``incoming``, its host's; ``durable``, what its host's ranks need of
    the files the durable root supplies (``view.rooted``); ``failed``, whether the
    fetch (not the load's own planning) failed, alike on every rank."""

    def __init__(self, comm: Comm, hosts: Hosts, view: TieredView, step: int,
                 holdings: Sequence[StepHolding] | None, make_folder: Callable[[], None] | None = None) -> None:
        self.comm, self.hosts, self.view, self.step = comm, hosts, view, step
        self.holdings = holdings
        self.make_folder = make_folder
        self.received = self.needed = self.incoming = self.durable = 0
        self.failed = False

    def _wants(self, ranges: tuple[list[FileRange], list[FileRange]]) -> Wants:
        """This rank's ranges of data files its host does not hold."""
        view = self.view
        exact, read = ranges
        keep = [r for r in read if r.file in view.file_sizes and not view.holds(r.file, r.start, r.stop)]
        files = {r.file for r in keep}
        return Wants([r for r in exact if r.file in files and not view.holds(r.file, r.start, r.stop)], keep)

    def _decide(self, payloads: list[Any]) -> list[Any]:
        assert self.holdings is not None
        wants = [None if p is None else msgspec.convert(p, Wants) for p in payloads]
        return msgspec.to_builtins(plan_fetch(self.hosts, self.holdings, self.view.file_sizes, wants, self.view.rooted))

    def __call__(self, ranges: tuple[list[FileRange], list[FileRange]] | None, error: BaseException | None) -> None:
        comm, hosts = self.comm, self.hosts
        mine = None
        if ranges is not None and error is None:
            try:
                mine = msgspec.to_builtins(self._wants(ranges))
            except Exception as e:  # noqa: BLE001 - fanned out to every rank
                error = e
        order = msgspec.convert(coordinate(comm, mine, error, self._decide), Order)
        if order.missing:
            self.failed = True
            raise MemoryTierError(f"memory snapshot {self.step}: {order.missing}")
        self.needed, self.incoming, self.durable = order.needed, order.incoming, order.durable
        problems: list[str] = []
        err: BaseException | None = None
        gone: CollectiveMismatchError | None = None
        try:
            if any(m.dst == comm.rank for m in order.moves) and self.make_folder is not None:
                self.make_folder()
            problems = transfer(comm, self.view.inner.inner.root, order.moves, progress=comm.timeout)
        except ShardpointError as e:
            if not isinstance(e, RankFailedError):  # this host's own files, the process exiting: fanned out
                err = e
            else:  # a peer died or hangs mid-transfer: name it and its host
                peers = sorted({m.src if m.dst == comm.rank else m.dst for m in order.moves} - {comm.rank})
                where = ", ".join(f"rank {p} on host {hosts.names[hosts.of_rank[p]]}" for p in peers)
                gone = CollectiveMismatchError(
                    f"restoring memory snapshot {self.step}: rank {comm.rank} (host {hosts.names[hosts.of_rank[comm.rank]]}) "
                    f"was exchanging byte ranges with {where} when the transfer failed ({e}). Nothing was loaded; "
                    "restart the job (the restore then reads what the present hosts hold)", ranks=peers)
                err = gone
        except Exception as e:  # noqa: BLE001 - fanned out to every rank
            err = e
        if gone is not None:
            # no agreement with a lost peer (a host that vanished without closing its
            # connections would hold it up to the group's timeout): this rank raises
            # now, and the others fail as soon as they find it gone
            raise gone
        if problems and err is None:
            err = MemoryTierError(f"memory snapshot {self.step}: " + "; ".join(problems))
        self.received = sum(m.size for m in order.moves if m.dst == comm.rank) if err is None else 0
        try:
            agree(comm, None, err)  # every rank learns whether every fetch went through
        except ShardpointError as e:
            if not isinstance(e, CollectiveMismatchError):  # not a lost peer: the snapshot is passed over
                self.failed = True
            raise
        self.view.refresh()
