"""The only module that talks to torch.distributed.

* One channel per process group (:class:`_Channel`) owns everything a checkpoint
  coordinates with: the per-call sequence, the arrival protocol on the store, and
  two gloo groups ("lanes") made on the caller's thread at a point every rank
  reaches. The data lane carries a save's or load's collectives and is held by one
  operation at a time (a new operation first waits for the asynchronous save in
  flight), so a background save's collectives never cross a foreground load's.
  The control lane carries only the per-step preemption flag, from the caller's
  thread, so that check never waits for a save in flight.
* Arrival: ranks announce themselves through the process group's store with a
  bounded wait, never through a collective on the training group, where a rank
  stuck in its own all-reduce would be matched against ours. A call costs each
  rank a constant number of store operations (one counter, one reference digest,
  one release key); absent ranks are enumerated only when the call is given up.
  The decision "everyone came" or "give up" is one atomic ``add`` on the counter,
  so every rank, late ones included, sees the same outcome.
* Without torch.distributed initialised everything degrades to one rank.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
import os
import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from types import ModuleType
from typing import TYPE_CHECKING, Any, Protocol, TypedDict

import torch

from .errors import ChannelClosedError, CollectiveMismatchError, RankFailedError, ShardpointError, UsageError
from .runtime import PROCESS

if TYPE_CHECKING:  # types only
    from torch.distributed import ProcessGroup

#: Timeout of the checkpoint lanes' collectives (a save's data phase can take long;
#: arrival is bounded separately by the call's ``timeout``).
GROUP_TIMEOUT = timedelta(seconds=float(os.environ.get("SHARDPOINT_GROUP_TIMEOUT", 1800)))

#: When a collective on the checkpoint group fails (a peer died: gloo raises at
#: once), how long the survivors wait for each other on the store before naming the
#: ranks that did not answer.
PEER_GRACE = float(os.environ.get("SHARDPOINT_PEER_GRACE", 1.0))

#: Added to the arrival counter by the rank that gives a call up: any later
#: arrival reads a count at or above it and knows the call was abandoned.
_ABORT = 1 << 40

#: Slice of a wait for a checkpoint collective (a wait returns as soon as the
#: collective completes; the slices only bound how late a closed channel is seen).
_POLL = timedelta(seconds=0.25)

#: Bytes of each rank's payload that the gather or scatter of an exchange with
#: ``rendezvous=False`` carries (:meth:`Comm.gather_json`): an agreement's verdict and a
#: small payload whole (a load's key agreement sends about 50).
HEAD = 120

_CLOSED = "the process is exiting: shardpoint's checkpoint collectives are closed"


def _dist() -> ModuleType | None:
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def default_rank_and_world() -> tuple[int, int] | None:
    """This process's rank and the world size of the default process group, or None
    while torch.distributed is not initialised (for callers that must not guess)."""
    dist = _dist()
    if dist is None:
        return None
    return int(dist.get_rank()), int(dist.get_world_size())


class _Background:
    """What a channel knows of the save running in the background, if any."""

    background: threading.Thread | None = None

    def settle(self) -> None:
        """Wait for the background operation (the asynchronous save in flight) to
        end, so the data lane is free. Its error stays with its handle."""
        t = self.background
        if t is not None and t is not threading.current_thread():
            t.join()
            self.background = None


class _Channel(_Background):
    """The one owner of a process group's checkpoint coordination.

    Every checkpoint collective of the group runs through it: ``seq`` numbers the
    calls (every rank makes the same calls in the same order, which arrival
    checks), ``data`` is the lane of save and load collectives, ``ctl`` the lane of
    the per-step flag, ``background`` the thread of the save in flight, the only
    other user of the data lane.
    """

    def __init__(self, dist: ModuleType, tag: str, ranks: list[int]) -> None:
        self.dist, self.tag, self.ranks = dist, tag, ranks
        self.world_pg = dist.group.WORLD  # a new default group (after destroy + init) gets a new channel
        self.seq = 0
        self.data: ProcessGroup | None = None
        self.ctl: ProcessGroup | None = None
        #: The side lane: point-to-point file transfers of the memory tier (replicas),
        #: run from a background thread; made only by :meth:`Comm.open_side`.
        self.side: ProcessGroup | None = None
        #: The newest thread started by :meth:`Comm.start_side` (each waits for the one
        #: before it, so the side lane's transfers run in the order they were started,
        #: the same on every rank).
        self.side_thread: threading.Thread | None = None
        self.background: threading.Thread | None = None
        self.closing = False
        #: An arrival kept for the next call (``Comm.arrive(..., hold=True)``): its
        #: identity digest and call number. Any other arrival drops it.
        self.held: tuple[str, int] | None = None
        #: Tagged slots of the current call number that this rank left abandoned, and
        #: their verdicts: calling one again raises at once instead of counting in twice.
        self.given_up: dict[str, bytes] = {}
        #: After a call at which the ranks disagreed: each rank's (operation, path) there,
        #: the same on every rank; the next call uses it to re-align (``_arrive_in_order``).
        self.mismatched: dict[int, tuple[str, str]] | None = None

    def open(self) -> None:
        """Make both lanes, on the caller's thread. Called where every rank of the
        group is known to be: right after a successful arrival, or in the per-step
        check that every rank makes at the same step."""
        if self.data is not None:
            return
        with PROCESS.channel_lock:
            if self.data is None:
                make = self.dist.new_group
                kw = dict(ranks=self.ranks, backend="gloo", timeout=GROUP_TIMEOUT, use_local_synchronization=True)
                data = make(**kw)
                self.ctl = make(**kw)
                self.data = data

    def close(self) -> None:
        """At interpreter exit: fail the lanes' pending and future collectives
        within :data:`_POLL` seconds, so that a background save blocked in one
        ends while the interpreter is whole (see :meth:`Comm._run`)."""
        self.closing = True

    def release(self) -> None:
        """Destroy both lanes now, on the caller's thread, while the interpreter is
        whole (their gloo threads are joined here rather than in the destructors
        that run while the process exits). Only when no thread uses them."""
        for g in (self.data, self.ctl, self.side):
            if g is not None:
                try:
                    self.dist.destroy_process_group(g)
                except Exception:  # noqa: BLE001 - already destroyed with the default group
                    pass
        self.data = self.ctl = self.side = None


class _Arrival(TypedDict):
    """A rank's arrival record on the store (JSON, one line per rank)."""

    r: int
    n: int
    op: str
    path: str


class _KeyValue(Protocol):
    """What a call's release uses of the process group's store (torch's ``Store``,
    whose stub types ``set`` as taking ``str`` only; it takes bytes too)."""

    def get(self, key: str, /) -> bytes: ...

    def set(self, key: str, value: str | bytes, /) -> None: ...

    def wait(self, keys: list[str], timeout: timedelta, /) -> None: ...


@functools.cache
def _takes_async_op(collective: Callable[..., object]) -> bool:
    try:
        return "async_op" in inspect.signature(collective).parameters
    except (TypeError, ValueError):
        return False


class _Solo(_Background):
    """Without torch.distributed: only the background save to wait for."""


def _solo() -> _Solo:
    """The no-group stand-in for a channel (one per process)."""
    with PROCESS.channel_lock:
        s = PROCESS.channels.get("")
        if not isinstance(s, _Solo):
            s = PROCESS.channels[""] = _Solo()
        return s


def _channel(dist: ModuleType, tag: str, ranks: list[int]) -> _Channel:
    with PROCESS.channel_lock:
        ch = PROCESS.channels.get(tag)
        if not isinstance(ch, _Channel) or ch.world_pg is not dist.group.WORLD:
            ch = PROCESS.channels[tag] = _Channel(dist, tag, ranks)
        return ch


def close_channels(release: bool = False) -> None:
    """Close every channel (see :meth:`_Channel.close`) and, with ``release``,
    destroy their lanes (:meth:`_Channel.release`); for the exit handler."""
    with PROCESS.channel_lock:
        chans = [c for c in PROCESS.channels.values() if isinstance(c, _Channel)]
        if release:
            PROCESS.channels.clear()
    for ch in chans:
        ch.close()
        if release:
            ch.release()


def seconds(timeout: object) -> float:
    """A ``timeout=`` argument in seconds; :class:`UsageError` unless it is a positive
    number or a :class:`~datetime.timedelta`."""
    s = timeout.total_seconds() if isinstance(timeout, timedelta) else timeout
    if isinstance(s, bool) or not isinstance(s, (int, float)) or not s > 0:
        raise UsageError(f"timeout must be a positive number of seconds or a timedelta (got {timeout!r})")
    return float(s)


class Comm:
    """Rank, world size and JSON collectives of one process group."""

    def __init__(self, process_group: ProcessGroup | None = None, timeout: timedelta | float = timedelta(minutes=10),
                 arrival_tag: str | None = None) -> None:
        self.timeout = seconds(timeout)
        #: With a tag, ranks meet by (operation, path, tag) instead of by call order
        #: (see :meth:`arrive`).
        self.arrival_tag = arrival_tag
        dist = _dist()
        self.dist = dist
        self._seq = 0  # the arrival sequence number of this call (0: no arrival yet)
        if dist is None:
            if process_group is not None:
                raise CollectiveMismatchError("a process_group was given but torch.distributed is not initialised")
            self.rank, self.world, self.ranks, self.tag = 0, 1, [0], "single"
            self.store = None
            self.channel: _Channel | None = None
            return
        group = process_group if process_group is not None else dist.group.WORLD
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.ranks = list(dist.get_process_group_ranks(group))
        self.tag = "g" + "-".join(map(str, self.ranks)) if len(self.ranks) <= 8 else f"g{len(self.ranks)}-{hash(tuple(self.ranks)) & 0xFFFFFFFF:x}"
        from torch.distributed.distributed_c10d import _get_default_store

        self.store = dist.PrefixStore(f"shardpoint/{self.tag}/", _get_default_store())
        self.channel = _channel(dist, self.tag, self.ranks)

    # -- arrival ---------------------------------------------------------------------
    def arrive(self, op: str, path: str, *, hold: bool = False) -> None:
        """Block until every rank of the group called ``op`` on ``path``, or raise
        :class:`CollectiveMismatchError` naming the ranks that did not come within
        the timeout (and raise the same on ranks that come later). First waits for
        the asynchronous save in flight on this group, whose collectives hold the
        data lane until it ends.

        With an ``arrival_tag`` (a trainer's global step, say) the ranks meet in a slot of
        their own for (operation, path, tag) instead of at the next call number, so a
        call that some ranks never make (a save behind ``if rank == 0:``) is abandoned
        naming them while the others' next call meets apart from it; see
        :meth:`_arrive_tagged`.

        ``hold``: keep this arrival for the next call on this group if that call has
        the same operation, path and tag (a trainer that runs a collective of its own
        between its arrival and the core's save arrives once, before it); any other
        call drops it.

        Store operations per rank: a compare-and-set of the reference digest, an
        add to the counter, an append of this rank's record, a wait for and a read
        of the release key, an add to the exit counter; the rank that arrives last
        also reads the mismatch counter and writes the release key, and the rank
        that leaves last deletes the call's keys. Nothing else unless the call
        fails; none in a group of one rank (it waits only for its save in flight)."""
        if self.store is None:
            _solo().settle()
            return
        ch = self.channel
        assert ch is not None
        ch.settle()
        if self.world == 1:  # a group of one rank: no other call to meet or to disagree with, no store operation
            if ch.closing:
                raise ChannelClosedError(_CLOSED)
            with PROCESS.channel_lock:
                ch.seq += 1
                self._seq = ch.seq
            ch.held = None
            ch.open()
            return
        identity = f"{op}\0{path}" if self.arrival_tag is None else f"{op}\0{path}\0{self.arrival_tag}"
        digest = hashlib.sha1(identity.encode()).hexdigest()[:16]
        held, ch.held = ch.held, None
        if held is not None and held[0] == digest:  # the same call, arrived for ahead of it
            self._seq = held[1]
            return
        if self.arrival_tag is not None:
            self._arrive_tagged(op, path, digest)
        else:
            self._arrive_in_order(op, path, digest)
        if hold:
            ch.held = (digest, self._seq)
        ch.open()

    def _arrive_in_order(self, op: str, path: str, digest: str) -> None:
        """The ranks meet at the next call number (see :meth:`arrive`).

        Ranks that meet with different operations or paths all raise at once, naming
        each rank's call. A misuse (rank 0 alone calls ``save(step 1)`` while the others
        are already at ``save(step 2)``) would then pair every later call of rank 0
        with the next one of the others; so a mismatch is remembered, and at the next
        call a rank whose call is one the others already made at the mismatch (and
        that they have since moved past) is *behind*: it raises at once (that call was
        abandoned on the others), while the others' calls meet again at the next call
        number, where the behind ranks' next calls find them."""
        ch = self.channel
        s, world = self.store, self.world
        assert ch is not None and s is not None
        while True:
            with PROCESS.channel_lock:
                ch.seq += 1
                seq = ch.seq
            self._seq = seq
            k = f"{seq}/"
            # the first rank's digest is the reference; a rank that differs says so
            # before it counts itself in, so the count of differing ranks is final
            # once everyone has counted in
            ref = s.compare_set(k + "ref", "", digest)
            if ref != digest.encode():
                s.add(k + "bad", 1)
            n = s.add(k + "n", 1)
            s.append(k + "who", json.dumps({"r": self.rank, "n": n, "op": op, "path": path}) + "\n")
            if n >= _ABORT and ref != digest.encode():
                # a call this rank never made (another op or path, on some ranks only: a
                # save behind `if rank == 0:`) was given up here before it came; it is
                # not late for it, so it moves on to the next call instead of failing
                self._leave(k)
                continue
            verdict = self._released(s, k, n, world, functools.partial(self._in_order_verdict, k))
            try:
                if verdict.startswith(b"aborted"):
                    ch.mismatched = None
                    self._raise_aborted(op, path, verdict)
                if verdict.startswith(b"behind:"):
                    behind = json.loads(verdict.decode().split(":", 1)[1])
                    before, ch.mismatched = ch.mismatched, None
                    if self.rank in behind:
                        raise self._behind(op, path, before or {})
                    continue  # not behind: this call meets the behind ranks' next one, at the next number
                if verdict == b"mismatch":
                    records = {rec["r"]: rec for rec in self._records(k, world, lambda recs: len(recs) >= world)}
                    ordered = [records[r] for r in sorted(records)]
                    ch.mismatched = {rec["r"]: (rec["op"], rec["path"]) for rec in ordered}
                    detail = ", ".join(f"rank {rec['r']}: {rec['op']}({rec['path']!r})" for rec in ordered)
                    first = (ordered[0]["op"], ordered[0]["path"])
                    raise CollectiveMismatchError(
                        f"ranks called different checkpoint operations or paths at the same point: {detail}; "
                        "every rank of the group must call the same shardpoint function with the same path",
                        ranks=[rec["r"] for rec in ordered if (rec["op"], rec["path"]) != first],
                    )
                ch.mismatched = None
                return
            finally:
                self._leave(k)

    def _in_order_verdict(self, k: str) -> bytes:
        """The verdict of call ``k``, by the last rank to count in: ``ok``; else, right
        after a mismatch, ``behind:[ranks]`` when some ranks made a call the others
        made at the mismatch and then moved past (see :meth:`_arrive_in_order`); else
        ``mismatch``."""
        s, ch = self.store, self.channel
        assert s is not None and ch is not None
        if s.add(k + "bad", 0) == 0:
            return b"ok"
        before = ch.mismatched
        if not before:
            return b"mismatch"
        now = {rec["r"]: (rec["op"], rec["path"]) for rec in self._records(k, self.world, lambda rs: len(rs) >= self.world)}
        moved_on = {r for r in now if r in before and now[r] != before[r]}
        behind = sorted(r for r, call in now.items() if r in moved_on
                        and any(before.get(o) == call for o in moved_on if o != r))
        return b"behind:" + json.dumps(behind).encode() if behind else b"mismatch"

    def _behind(self, op: str, path: str, before: dict[int, tuple[str, str]]) -> CollectiveMismatchError:
        """The error of a rank that is behind (see :meth:`_arrive_in_order`)."""
        made = sorted(r for r, call in before.items() if call == (op, path))
        mine = before.get(self.rank)
        met = f"this rank's {mine[0]}({mine[1]!r})" if mine else "another call of this rank"
        return CollectiveMismatchError(
            f"shardpoint.{op}({path!r}) was abandoned before this rank made it: ranks {made} made it at the previous "
            f"checkpoint call, where it met {met} and failed on every rank (the CollectiveMismatchError raised there "
            "names each rank's call). Nothing was saved or loaded by this call; the next call that every rank makes "
            "meets as usual. Call checkpoint functions on all ranks in the same order",
            ranks=made,
        )

    def _arrive_tagged(self, op: str, path: str, digest: str) -> None:
        """The ranks meet in the slot ``<next call number>/t/<digest of op, path,
        tag>``. The call number moves on only when everyone came, so the ranks of a
        call given up (some ranks never made it) stay at the number the others are
        at, and everyone's next call meets in a fresh slot; a rank that makes the
        abandoned call late reads its verdict. A call number that an untagged call
        was given up at before this rank came is skipped, as in :meth:`_arrive_in_order`.

        Store operations per rank: a check of the untagged slot, an add to the
        counter, an append of this rank's record, a wait for and a read of the
        release key, an add to the exit counter; the last to arrive writes the
        release key and the last to leave deletes the slot's keys."""
        ch = self.channel
        s, world = self.store, self.world
        assert ch is not None and s is not None
        seq = ch.seq + 1
        while s.check([f"{seq}/n"]) and s.add(f"{seq}/n", 0) >= _ABORT:
            self._leave(f"{seq}/")  # an untagged call this rank never made, given up before it came
            with PROCESS.channel_lock:
                ch.seq = seq
            seq += 1
        self._seq = seq
        k = f"{seq}/t/{digest}/"
        if k in ch.given_up:  # this rank already left this very call abandoned
            self._raise_aborted(op, path, ch.given_up[k])
        n = s.add(k + "n", 1)
        s.append(k + "who", json.dumps({"r": self.rank, "n": n, "op": op, "path": path}) + "\n")
        verdict = self._released(s, k, n, world, lambda: b"ok")
        try:
            if verdict.startswith(b"aborted"):
                ch.given_up[k] = verdict
                self._raise_aborted(op, path, verdict)
        finally:
            self._leave(k, ("n", "who", "go", "out"))
        with PROCESS.channel_lock:
            ch.seq = seq
            ch.given_up.clear()

    def _released(self, s: _KeyValue, k: str, n: int, world: int, verdict_of_last: Callable[[], bytes]) -> bytes:
        """The verdict of call ``k`` for a rank whose count-in returned ``n``: the call's
        release key if the call was already given up (a late rank) or once it is
        written; the last rank to count in writes it (``verdict_of_last()``); a rank
        that waits past the timeout gives the call up (naming the absent ranks)."""
        if n >= _ABORT:  # late: this very call was given up before this rank came
            return bytes(s.get(k + "go"))
        if n == world:  # last: release everyone
            verdict = verdict_of_last()
            s.set(k + "go", verdict)
            return verdict
        try:
            s.wait([k + "go"], timedelta(seconds=self.timeout))
        except Exception:  # noqa: BLE001 - the store's timeout error (DistStoreError and kin)
            self._give_up(k)
        return bytes(s.get(k + "go"))

    def _give_up(self, k: str) -> None:
        """The timeout passed: abandon the call unless the last rank just came. The
        first rank to give up names the ranks not counted in and writes the verdict."""
        s, world = self.store, self.world
        assert s is not None
        v = s.add(k + "n", _ABORT)
        came = v % _ABORT
        if v // _ABORT != 1 or came >= world:
            return  # someone gave up first, or everyone came: the verdict is (being) written
        # each counted rank appends its record right after counting itself in
        recs = self._records(k, came, lambda rs: sum(1 for r in rs if r["n"] < _ABORT) >= came)
        counted = {r["r"] for r in recs if r["n"] < _ABORT}
        absent = [r for r in range(world) if r not in counted]
        s.set(k + "go", "aborted:" + json.dumps(absent))

    def _records(self, k: str, want: int, enough: Callable[[list[_Arrival]], bool]) -> list[_Arrival]:
        """The ranks' arrival records (failure paths only), once ``enough`` of them
        are in (each rank appends its own right after counting itself in)."""
        assert self.store is not None
        deadline = time.monotonic() + max(5.0, min(self.timeout, 60.0))
        while True:
            raw = self.store.get(k + "who").decode() if self.store.check([k + "who"]) else ""
            recs = [json.loads(line) for line in raw.splitlines() if line]
            if enough(recs) or time.monotonic() >= deadline:
                return recs
            time.sleep(0.01)

    def _leave(self, k: str, names: tuple[str, ...] = ("ref", "bad", "n", "who", "go", "out")) -> None:
        """Count this rank out; the last rank out deletes the call's keys. A call
        that was given up keeps them until the absent ranks come, so that they
        still read the verdict (ranks that never come leave its keys behind)."""
        s = self.store
        assert s is not None
        if s.add(k + "out", 1) == self.world:
            for name in names:
                s.delete_key(k + name)

    def _raise_aborted(self, op: str, path: str, verdict: bytes) -> None:
        absent = json.loads(verdict.decode().split(":", 1)[1])
        at = f" [{self.arrival_tag}]" if self.arrival_tag else ""
        raise CollectiveMismatchError(
            f"shardpoint.{op}({path!r}){at} is collective, but ranks {absent} of the process group did not call it "
            f"within the timeout of {self.timeout:g}s, so it was abandoned on every rank. Call it on all ranks, not "
            "only on rank 0 (not inside `if rank == 0:`, `if trainer.is_global_zero:`, "
            "`if accelerator.is_main_process:` or `if args.process_index == 0:`), at the same point of the "
            "program; raise `timeout=` if ranks arrive far apart",
            ranks=absent,
        )

    # -- the lanes -------------------------------------------------------------------
    def group(self) -> ProcessGroup | None:
        """The data lane (gloo) of this process group's channel. Made on first use
        if no arrival made it yet: call it only where every rank is."""
        assert self.channel is not None
        self.channel.open()
        return self.channel.data

    def start_background(self, target: Callable[[], None], name: str) -> threading.Thread:
        """Run ``target`` in a thread that holds the data lane until it ends: the
        next arrival on this group waits for it."""
        t = threading.Thread(target=target, name=name, daemon=True)
        (self.channel or _solo()).background = t
        t.start()
        return t

    def open_side(self) -> None:
        """Make the side lane (a gloo group of this group's ranks, of its own) if it is
        not made yet. Collective: call it on the caller's thread where every rank is.
        Its transfers (:meth:`exchange`) never interleave with the data lane's
        collectives, so a background thread may run them while saves and loads go on."""
        if self.channel is None:
            return
        ch = self.channel
        ch.open()
        with PROCESS.channel_lock:
            if ch.side is None:
                ch.side = self._td.new_group(ranks=ch.ranks, backend="gloo", timeout=GROUP_TIMEOUT,
                                             use_local_synchronization=True)

    def start_side(self, target: Callable[[], None], name: str) -> threading.Thread:
        """Run ``target`` (which calls :meth:`exchange` with ``background=True``) in a
        thread once every side-lane thread started before it on this group ended: the
        transfers of several managers (or snapshots) never interleave, and run in the
        order they were started, which is the same on every rank."""
        ch = self.channel
        prev = ch.side_thread if ch is not None else None

        def run() -> None:
            if prev is not None:
                prev.join()
            target()

        t = threading.Thread(target=run, name=name, daemon=False)
        if ch is not None:
            ch.side_thread = t
        t.start()
        return t

    def exchange(self, sends: Sequence[tuple[int, int, torch.Tensor]],
                 recvs: Sequence[tuple[int, int, torch.Tensor]], *, background: bool = False,
                 progress: float | None = None) -> None:
        """Point-to-point transfers on the side lane (made by :meth:`open_side`): each
        ``(peer, tag, tensor)`` of ``sends`` goes to that rank of the group, each of
        ``recvs`` is filled from it; a send and its receive carry the same tag. All are
        posted at once, then waited for (within the lane's timeout,
        ``SHARDPOINT_GROUP_TIMEOUT``). From the caller's thread it first waits for the side lane's
        background transfers (:meth:`start_side`, whose targets pass ``background``).
        ``progress``: seconds each message may take once the one before it ended (a
        peer that vanished without closing its connections, a host powered off, is
        given up then, not after the lane's timeout; gloo then closes the pair, so
        only for transfers whose failure ends the operation). Raises
        :class:`ShardpointError` naming the peers when a transfer fails (a peer died)."""
        if self.store is None or (not sends and not recvs):
            return
        ch = self.channel
        assert ch is not None and ch.side is not None, "open_side() first, on every rank"
        if not background and ch.side_thread is not None:
            ch.side_thread.join()  # the transfers started in the background first, as on every rank
        td, group = self._td, ch.side
        closed = "the process is exiting: shardpoint's checkpoint transfers are closed"
        peers = sorted({p for p, _, _ in sends} | {p for p, _, _ in recvs})
        try:
            works = [td.irecv(t, src=self.ranks[p], group=group, tag=tag) for p, tag, t in recvs]
            works += [td.isend(t, dst=self.ranks[p], group=group, tag=tag) for p, tag, t in sends]
            for w in works:
                # a plain wait: gloo closes a point-to-point pair whose wait times out, so
                # no short slices here (the thread is not a daemon: an exit waits for it)
                if ch.closing:
                    raise ChannelClosedError(closed)
                if progress is None:
                    w.wait()
                else:
                    w.wait(timeout=timedelta(seconds=progress))
        except ShardpointError:
            raise
        except Exception as e:  # noqa: BLE001 - RuntimeError, DistError: a peer's connection closed
            raise RankFailedError(
                f"rank {self.rank}: a transfer with ranks {peers} of the group failed ({type(e).__name__}: "
                f"{str(e).strip()[:300]}); one of them died or hangs. What it carried is not counted (see its "
                "logs; a restart restores from what every present host holds)", ranks=peers) from e
        PROCESS.seams.traffic.add(sum(t.numel() * t.element_size() for _, _, t in recvs))

    def _alone(self) -> bool:
        """Whether this is a group of one rank (or no process group): a JSON collective's
        result is then its own argument, with no gloo call (a closed channel still
        raises :class:`ChannelClosedError`, as a collective would)."""
        if self.store is None:
            return True
        if self.world != 1:
            return False
        if self.channel is not None and self.channel.closing:
            raise ChannelClosedError(_CLOSED)
        return True

    @property
    def _td(self) -> ModuleType:
        """torch.distributed, in the collectives (only reached with a process group)."""
        assert self.dist is not None
        return self.dist

    # -- the coordinator pattern: rank 0 receives, plans, and answers each rank ----------
    def gather_json(self, obj: object, *, rendezvous: bool = True) -> list[Any] | None:
        """Every rank's ``obj`` (JSON-serialisable) on rank 0 of the group, in rank
        order; None on the other ranks, which receive nothing. Sizes travel first (one
        int64 per rank, gathered), then each payload point-to-point at its own size, so
        the coordinator receives the sum of the payloads, never the largest times the
        world.

        The point-to-point sends are also what tells the coordinator that a rank left
        before the verdict: a send completes only when its receiver takes it, while a
        gather's bytes arrive before the coordinator asks for them. Payloads carried in
        the gather itself let rank 0 commit a save on the vote of a rank that had
        exited and reported the save not committed (``tests/distributed/test_channel.py``,
        ``test_exit_while_a_peer_holds_the_save_ends_cleanly``).

        ``rendezvous=False`` carries them so all the same, for an exchange that no
        commit follows (a load's agreements): each rank's size and its first
        :data:`HEAD` bytes in the one gather (what is longer follows point to point),
        one collective where there were two: an agreement on 2 ranks took 0.33 ms at
        best and 0.55 at the median against 0.54 and 0.86 (``benchmarks/agree_bench.py``).
        Rank 0 then receives :data:`HEAD` bytes more per rank; the others receive
        nothing either way."""
        if self._alone():
            return [obj]
        root = self.ranks[0]
        if not rendezvous:
            return self._gather_inline(obj, root)
        data = _encode(obj) if self.rank != 0 else b""  # rank 0 keeps its own object: never encoded
        size = torch.tensor([len(data)], dtype=torch.int64)
        if self.rank != 0:
            self._run(self._td.gather, size, None, dst=root)
            if data:
                self._run(self._td.send, _as_tensor(data), dst=root)
            PROCESS.seams.traffic.ops += 1
            return None
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world)]
        self._run(self._td.gather, size, sizes, dst=root)
        ns = [int(s.item()) for s in sizes]
        bufs = [torch.empty(n, dtype=torch.uint8) for n in ns]
        self._run(self._recv_all, bufs, ns)
        PROCESS.seams.traffic.add(8 * self.world + sum(ns[1:]))
        return [obj] + [json.loads(bytes(b.numpy())) for b in bufs[1:]]

    def _gather_inline(self, obj: object, root: int) -> list[Any] | None:
        """:meth:`gather_json` with ``rendezvous=False``."""
        if self.rank != 0:
            data = _encode(obj)
            self._run(self._td.gather, _inline(data), None, dst=root)
            if len(data) > HEAD:
                self._run(self._td.send, _as_tensor(data[HEAD:]), dst=root)
            PROCESS.seams.traffic.ops += 1
            return None
        heads = [torch.empty(8 + HEAD, dtype=torch.uint8) for _ in range(self.world)]
        self._run(self._td.gather, torch.zeros(8 + HEAD, dtype=torch.uint8), heads, dst=root)
        raw = [bytes(h.numpy()) for h in heads]
        ns = [max(0, int.from_bytes(r[:8], "little") - HEAD) for r in raw]
        ns[0] = 0  # rank 0's own object is not in the exchange
        bufs = [torch.empty(n, dtype=torch.uint8) for n in ns]
        if any(ns):
            self._run(self._recv_all, bufs, ns)
        PROCESS.seams.traffic.add((8 + HEAD) * self.world + sum(ns))
        return [obj] + [_joined(raw[r], bytes(bufs[r].numpy())) for r in range(1, self.world)]

    def _recv_all(self, bufs: list[torch.Tensor], ns: list[int], group: ProcessGroup | None) -> None:
        """Rank 0: receive ``bufs[r]`` from each rank ``r`` > 0 whose ``ns[r]`` is not 0, at once."""
        works = [self._td.irecv(bufs[r], src=self.ranks[r], group=group) for r in range(1, self.world) if ns[r]]
        for w in works:
            w.wait()

    def _send_all(self, datas: list[bytes], group: ProcessGroup | None) -> None:
        """Rank 0: send ``datas[r]`` to each rank ``r`` > 0 where it is not empty, at once."""
        works = [self._td.isend(_as_tensor(datas[r]), dst=self.ranks[r], group=group)
                 for r in range(1, self.world) if datas[r]]
        for w in works:
            w.wait()

    def scatter_json(self, objs: list[object] | None, *, rendezvous: bool = True) -> Any:
        """Rank 0 gives ``objs[r]`` to rank ``r`` (``objs`` is ignored elsewhere); each
        rank receives only its own object (its size, then its bytes; with
        ``rendezvous=False``, its size and first :data:`HEAD` bytes in the scatter,
        the rest after it: see :meth:`gather_json`)."""
        if self._alone():
            assert objs is not None
            return objs[0]
        root = self.ranks[0]
        if self.rank == 0:
            assert objs is not None and len(objs) == self.world
            datas = [b""] + [_encode(o) for o in objs[1:]]  # rank 0 keeps its own object: never encoded
            if rendezvous:
                sizes = [torch.tensor([len(d)], dtype=torch.int64) for d in datas]
                self._run(self._td.scatter, torch.zeros(1, dtype=torch.int64), sizes, src=root)
            else:
                self._run(self._td.scatter, torch.zeros(8 + HEAD, dtype=torch.uint8), [_inline(d) for d in datas],
                          src=root)
                datas = [d[HEAD:] for d in datas]
            if any(datas):
                self._run(self._send_all, datas)
            PROCESS.seams.traffic.ops += 1
            return objs[0]
        if not rendezvous:
            head = torch.empty(8 + HEAD, dtype=torch.uint8)
            self._run(self._td.scatter, head, None, src=root)
            raw = bytes(head.numpy())
            rest = torch.empty(max(0, int.from_bytes(raw[:8], "little") - HEAD), dtype=torch.uint8)
            if rest.numel():
                self._run(self._td.recv, rest, src=root)
            PROCESS.seams.traffic.add(8 + HEAD + rest.numel())
            return _joined(raw, bytes(rest.numpy()))
        size = torch.zeros(1, dtype=torch.int64)
        self._run(self._td.scatter, size, None, src=root)
        n = int(size.item())
        buf = torch.empty(n, dtype=torch.uint8)
        if n:
            self._run(self._td.recv, buf, src=root)
        PROCESS.seams.traffic.add(8 + n)
        return json.loads(bytes(buf.numpy()))

    def broadcast_json(self, obj: object) -> Any:
        """Rank 0's ``obj`` on every rank (``obj`` is ignored elsewhere)."""
        if self._alone():
            return obj
        root = self.ranks[0]
        data = _encode(obj) if self.rank == 0 else b""
        size = torch.tensor([len(data)], dtype=torch.int64)
        self._run(self._td.broadcast, size, src=root)
        n = int(size.item())
        buf = _as_tensor(data) if self.rank == 0 else torch.empty(n, dtype=torch.uint8)
        if n:
            self._run(self._td.broadcast, buf, src=root)
        if self.rank == 0:
            PROCESS.seams.traffic.ops += 1
            return obj
        PROCESS.seams.traffic.add(8 + n)
        return json.loads(bytes(buf.numpy()))

    def flag_any(self, flag: bool) -> bool:
        """Whether ``flag`` is set on any rank, on the control lane: never waits for
        a save in flight. Call it on the caller's thread, on every rank at the same
        point (the per-step preemption check)."""
        if self.store is None:
            return flag
        out = torch.tensor([1 if flag else 0], dtype=torch.uint8)
        assert self.channel is not None
        self.channel.open()
        self._run(self._td.all_reduce, out, op=self._td.ReduceOp.MAX, lane="ctl")
        return bool(out[0])

    def _run(
        self,
        collective: Callable[..., Any],  # Any: a torch.distributed collective, its Work with async_op=True
        *args: object,
        lane: str = "data",
        **kwargs: object,
    ) -> None:
        """One collective on a lane of the channel (every checkpoint collective goes
        through here). When it fails (gloo raises as soon as a peer's connection
        closes), raise :class:`CollectiveMismatchError` naming the ranks that are gone
        instead of gloo's own error, so that ``except ShardpointError`` in a training
        loop sees it."""
        ch = self.channel
        assert ch is not None
        group = self.group() if lane == "data" else ch.ctl
        if ch.closing:
            raise ChannelClosedError(_CLOSED)
        try:
            if not _takes_async_op(collective):
                collective(*args, group=group, **kwargs)
                return
            work = collective(*args, group=group, async_op=True, **kwargs)
            # wait in short slices: a thread blocked in gloo must get back to Python
            # while the interpreter is whole, or it is killed inside torch's C++ code
            # when it finalises (SIGABRT); the exit handler closes the channel
            while True:
                try:
                    work.wait(timeout=_POLL)
                    return
                except Exception:  # noqa: BLE001 - "Operation timed out!" or the collective's own error
                    if work.is_completed():
                        work.wait()  # raises the collective's own error, if that is what it was
                        return
                    if ch.closing:
                        raise ChannelClosedError(_CLOSED) from None
        except ShardpointError:
            raise
        except Exception as e:  # noqa: BLE001 - RuntimeError, DistError and its subclasses
            raise self._failure(e) from e

    def _failure(self, e: BaseException) -> ShardpointError:
        """What a failed collective raises: the channel closing at exit, or the peers that are gone."""
        assert self.channel is not None
        if self.channel.closing:
            return ChannelClosedError(_CLOSED)
        return self._peer_failure(e)

    def _peer_failure(self, cause: BaseException) -> CollectiveMismatchError:
        """Survivors of a failed collective report in on the store for up to
        :data:`PEER_GRACE` seconds; the ranks that do not are named."""
        what = f"{type(cause).__name__}: {str(cause).strip()[:300]}"
        assert self.store is not None
        grace = min(PEER_GRACE, self.timeout)
        try:
            key = f"{self._seq}/failed"
            self.store.set(f"{key}/{self.rank}", "1")
            deadline = time.monotonic() + grace
            while True:
                present = [r for r in range(self.world) if self.store.check([f"{key}/{r}"])]
                if len(present) == self.world or time.monotonic() >= deadline:
                    break
                time.sleep(0.02)
        except Exception:  # noqa: BLE001 - the store is gone with the process that hosted it
            agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
            host = "the launcher's agent" if agent else "rank 0"
            return CollectiveMismatchError(
                f"{host} (which hosts the process group's store) is gone: a collective of the checkpoint on rank "
                f"{self.rank} failed ({what}) and the store is unreachable. The save or load did not complete "
                "(a save that did not commit left no checkpoint); see the logs of the rank that died and restart the job",
                ranks=[] if agent else [0],
            )
        absent = [r for r in range(self.world) if r not in present]
        if not absent:
            return CollectiveMismatchError(
                f"a collective of the checkpoint failed on every rank ({what}); the save or load did not complete. "
                f"If it timed out, raise SHARDPOINT_GROUP_TIMEOUT (now {GROUP_TIMEOUT.total_seconds():g}s)",
                ranks=[],
            )
        return CollectiveMismatchError(
            f"ranks {absent} died or hang: a collective of the checkpoint on rank {self.rank} failed ({what}) and "
            f"they did not answer within {grace:g}s after it. The save or load did not "
            "complete on every rank (a save that did not commit left no checkpoint); see those ranks' logs and "
            "restart the job",
            ranks=absent,
        )


def _encode(obj: object) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def _as_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _inline(data: bytes) -> torch.Tensor:
    """The fixed-size first part of a payload sent with ``rendezvous=False``
    (:meth:`Comm.gather_json`): its size (8 bytes, little-endian), then its first
    :data:`HEAD` bytes, zero-padded."""
    out = bytearray(8 + HEAD)
    out[:8] = len(data).to_bytes(8, "little")
    first = data[:HEAD]
    out[8 : 8 + len(first)] = first
    return torch.frombuffer(out, dtype=torch.uint8)


def _joined(raw: bytes, rest: bytes) -> Any:
    """The object whose :func:`_inline` part is ``raw`` and whose bytes after the
    first :data:`HEAD` are ``rest``."""
    n = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8 : 8 + min(n, HEAD)] + rest if n > HEAD else raw[8 : 8 + n])


class _Failure(TypedDict, total=False):
    """A failed rank's record in a collective call's exchange (JSON)."""

    ok: bool
    error: str
    type: str
    rank: int
    failed: list[int]
    cause: bool


def _failure(error: BaseException) -> _Failure:
    return {"ok": False, "error": f"{type(error).__name__}: {error}", "type": type(error).__name__}


def _raise_failed(comm: Comm, failed: list[tuple[int, _Failure]], error: BaseException | None) -> None:
    """Raise on this rank for a collective call in which ``failed`` ranks failed
    (this rank's own ``error`` first: a :class:`ShardpointError` as it is, anything
    else as a :class:`RankFailedError` caused by it). Another rank's ordinary error (a
    full disk) arrives as a :class:`RankFailedError` naming that rank (a shardpoint
    error of another class, as that class); :class:`CollectiveMismatchError` stays for
    ranks that did not come or died."""
    if isinstance(error, ShardpointError):
        raise error
    if error is not None:  # keep the original (an OSError's errno, say) as the cause
        raise RankFailedError(f"rank {comm.rank} failed: {type(error).__name__}: {error}", rank=comm.rank) from error
    from . import errors

    r, e = failed[0]
    cls = getattr(errors, e.get("type", ""), None)
    msg = f"rank {r} failed, so this collective call failed on every rank: {e['error']}"
    if cls is errors.CollectiveMismatchError:  # that rank saw ranks that did not come or died
        raise errors.CollectiveMismatchError(msg, ranks=[f for f, _ in failed])
    msg += "; see that rank's error for the cause and fix it there"
    if not (isinstance(cls, type) and issubclass(cls, errors.ShardpointError)) or cls is errors.RankFailedError:
        # its own ordinary error (a full disk): not a missing rank
        raise errors.RankFailedError(msg, rank=r, ranks=[f for f, _ in failed])
    raise cls(msg)


def coordinate(comm: Comm, payload: object, error: BaseException | None,
               decide: Callable[[list[Any]], Sequence[object]],
               explain: Callable[[], BaseException | None] | None = None, *, rendezvous: bool = True) -> Any:
    """One round of the coordinator pattern: every rank's ``payload`` (or the error it
    hit) goes to rank 0, which calls ``decide(payloads) -> replies`` (one reply per
    rank) and sends each rank only its own reply. If any rank failed, or ``decide``
    raised, every rank raises, naming the failing rank and carrying its message (the
    failing rank re-raises its own exception). A non-coordinator rank receives one
    reply, whatever the world size.

    ``explain`` (rank 0, only when some rank failed): an error that is the cause of
    those failures (a newer attempt took the root, and its retention removed the files
    being written), raised on every rank in their place; None keeps them.

    ``rendezvous=False``: the payloads and replies travel inside the gather and the
    scatter (:meth:`Comm.gather_json`), half the collectives; only for a round that no
    commit follows, since rank 0 may then decide on the vote of a rank that has left.

    Returns:
        This rank's reply.
    """
    mine = {"ok": True, "payload": payload} if error is None else _failure(error)
    own: BaseException | None = error
    try:
        everyone = comm.gather_json(mine, rendezvous=rendezvous)
        replies: list[object] | None = None
        if everyone is not None:  # the coordinator
            failed = [(r, e) for r, e in enumerate(everyone) if not e["ok"]]
            cause = explain() if failed and explain is not None else None
            if cause is not None:
                own = cause
                replies = [{**_failure(cause), "rank": 0, "failed": [0], "cause": True}] * comm.world
            elif failed:
                r, e = failed[0]
                bad = {"ok": False, "rank": r, "error": e["error"], "type": e["type"], "failed": [f for f, _ in failed]}
                replies = [bad] * comm.world
            else:
                try:
                    out = decide([e["payload"] for e in everyone])
                    replies = [{"ok": True, "payload": p} for p in out]
                except Exception as ex:  # noqa: BLE001 - fanned out to every rank
                    own = ex
                    replies = [{**_failure(ex), "rank": 0, "failed": [0]}] * comm.world
        reply = comm.scatter_json(replies, rendezvous=rendezvous)
    except CollectiveMismatchError as lost:
        if own is None:
            raise
        # a peer is gone as well; this rank's own failure is what its user needs first
        raise RankFailedError(f"rank {comm.rank} failed: {type(own).__name__}: {own} (and {lost})",
                              rank=comm.rank) from own
    if not reply["ok"]:
        if reply.get("cause") and comm.rank != 0:
            own = None  # this rank's own failure followed from the cause rank 0 found: that is what it raises
        others: list[tuple[int, _Failure]] = [(f, {}) for f in reply["failed"] if f != reply["rank"]]
        _raise_failed(comm, [(reply["rank"], reply), *others], own)
    return reply["payload"]


def agree(comm: Comm, payload: object, error: BaseException | None,
          merge: Callable[[list[Any]], Any] | None = None, *, rendezvous: bool = True) -> Any:
    """Each rank's ``payload`` or error to rank 0; if any rank failed, raise on every
    rank (the failing rank re-raises its own exception); else every rank gets
    ``merge(payloads)``, computed once on rank 0 (None without ``merge``; an error
    ``merge`` raises is raised on every rank). A non-coordinator rank sends its payload
    and receives the merged result, whatever the world size (:func:`coordinate`;
    ``rendezvous=False`` for an agreement that no commit follows, as there)."""
    return coordinate(comm, payload, error, _merged(comm, merge), rendezvous=rendezvous)


def _merged(comm: Comm, merge: Callable[[list[Any]], Any] | None) -> Callable[[list[Any]], list[Any]]:
    """The coordinator's decision of an agreement: ``merge``'s one result, for every rank."""

    def decide(payloads: list[Any]) -> list[Any]:
        return [merge(payloads) if merge is not None else None] * comm.world

    return decide
