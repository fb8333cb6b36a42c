"""The only module that talks to torch.distributed.

* Arrival: ranks announce themselves through the process group's store with a
  per-call sequence number and a bounded wait, never through a collective on the
  training group, where a rank stuck in its own all-reduce would be matched
  against ours. The decision "everyone came" or "give up" is one atomic
  compare-and-set, so every rank, late ones included, sees the same outcome.
* After arrival, checkpoint traffic runs on a dedicated gloo group created once
  per process group.
* Without torch.distributed initialised everything degrades to one rank.
"""

from __future__ import annotations

import json
import os
import threading
import time
from datetime import timedelta
from typing import Any

import torch

from .errors import CollectiveMismatchError, ShardpointError

#: Timeout of the dedicated checkpoint group's collectives (a save's data phase can
#: take long; arrival is bounded separately by the call's ``timeout``).
GROUP_TIMEOUT = timedelta(seconds=float(os.environ.get("SHARDPOINT_GROUP_TIMEOUT", 1800)))

#: When a collective on the checkpoint group fails (a peer died: gloo raises at
#: once), how long the survivors wait for each other on the store before naming the
#: ranks that did not answer.
PEER_GRACE = float(os.environ.get("SHARDPOINT_PEER_GRACE", 1.0))

_seq: dict[str, int] = {}


class Traffic:
    """Bytes this process received through the checkpoint group's collectives, and
    how many collectives it ran (the scale tests and benchmark read it)."""

    __slots__ = ("received", "ops")

    def __init__(self) -> None:
        self.received = 0
        self.ops = 0

    def reset(self) -> None:
        self.received = self.ops = 0

    def add(self, nbytes: int) -> None:
        self.received += int(nbytes)
        self.ops += 1


#: Counted at the Comm layer for every JSON collective and ``any_true``.
traffic = Traffic()

_groups: dict[str, Any] = {}
_lock = threading.Lock()


def _dist():  # type: ignore[no-untyped-def]
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


class Comm:
    """Rank, world size and JSON collectives of one process group."""

    def __init__(self, process_group: Any = None, timeout: timedelta | float = timedelta(minutes=10)) -> None:
        self.timeout = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
        dist = _dist()
        self.dist = dist
        if dist is None:
            if process_group is not None:
                raise CollectiveMismatchError("a process_group was given but torch.distributed is not initialised")
            self.rank, self.world, self.ranks, self.tag = 0, 1, [0], "single"
            self.store = None
            return
        group = process_group if process_group is not None else dist.group.WORLD
        self.user_group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.ranks = list(dist.get_process_group_ranks(group))
        self.tag = "g" + "-".join(map(str, self.ranks)) if len(self.ranks) <= 8 else f"g{len(self.ranks)}-{hash(tuple(self.ranks)) & 0xFFFFFFFF:x}"
        from torch.distributed.distributed_c10d import _get_default_store

        self.store = dist.PrefixStore(f"shardpoint/{self.tag}/", _get_default_store())
        self._group: Any = None
        self._seq = 0  # the arrival sequence number of this call (0: no arrival yet)

    # -- arrival ---------------------------------------------------------------------
    def arrive(self, op: str, path: str) -> None:
        """Block until every rank of the group called ``op`` on ``path``, or raise
        :class:`CollectiveMismatchError` naming the ranks that did not come within
        the timeout (and raise the same on ranks that come later)."""
        if self.store is None:
            return
        with _lock:
            seq = _seq.get(self.tag, 0) + 1
            _seq[self.tag] = seq
        self._seq = seq
        store, base, world = self.store, f"{seq}", self.world
        store.set(f"{base}/arrive/{self.rank}", json.dumps({"op": op, "path": path}))
        state_key = f"{base}/state"
        # atomically count ourselves in, unless the call was already given up
        cur = b""
        while True:
            if cur.startswith(b"aborted"):
                self._raise_aborted(op, path, cur)
            n = int(cur.decode().split(":")[1]) if cur else 0
            # the value names who wrote it: compare_set answers with the current value
            # both on success and on a lost race, so only a unique value tells them apart
            new = f"open:{n + 1}:{self.rank}".encode()
            got = store.compare_set(state_key, cur.decode() if cur else "", new.decode())
            if got == new:
                break
            cur = got
        deadline = time.monotonic() + self.timeout
        pause = 0.002
        while True:
            cur = store.get(state_key)
            if cur.startswith(f"open:{world}:".encode()):
                break
            if cur.startswith(b"aborted"):
                self._raise_aborted(op, path, cur)
            if time.monotonic() >= deadline:
                absent = [r for r in range(world) if not store.check([f"{base}/arrive/{r}"])]
                verdict = ("aborted:" + json.dumps(absent)).encode()
                got = store.compare_set(state_key, cur.decode(), verdict.decode())
                if got == verdict:
                    self._raise_aborted(op, path, verdict)
                continue  # the state moved (someone arrived or gave up): look again
            time.sleep(pause)
            pause = min(pause * 2, 0.05)
        records = [json.loads(v) for v in store.multi_get([f"{base}/arrive/{r}" for r in range(world)])]
        if any(r != records[0] for r in records):
            detail = ", ".join(f"rank {r}: {rec['op']}({rec['path']!r})" for r, rec in enumerate(records))
            raise CollectiveMismatchError(
                f"ranks called different checkpoint operations or paths at the same point: {detail}; "
                "every rank of the group must call the same shardpoint function with the same path",
                ranks=[r for r, rec in enumerate(records) if rec != records[0]],
            )

    def _raise_aborted(self, op: str, path: str, verdict: bytes) -> None:
        absent = json.loads(verdict.decode().split(":", 1)[1])
        raise CollectiveMismatchError(
            f"shardpoint.{op}({path!r}) is collective, but ranks {absent} of the process group did not call it "
            f"within the timeout of {self.timeout:g}s, so it was abandoned on every rank. Call it on all ranks "
            "(not only on rank 0), at the same point of the program; raise `timeout=` if ranks arrive far apart",
            ranks=absent,
        )

    # -- the dedicated group -------------------------------------------------------
    def group(self) -> Any:
        """The checkpoint group (gloo), created once per process group, after arrival."""
        if self._group is None:
            with _lock:
                g = _groups.get(self.tag)
                if g is None:
                    g = self.dist.new_group(
                        ranks=self.ranks, backend="gloo", timeout=GROUP_TIMEOUT, use_local_synchronization=True
                    )
                    _groups[self.tag] = g
            self._group = g
        return self._group

    def all_gather_json(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` (JSON-serialisable), in rank order."""
        if self.store is None:
            return [obj]
        data = json.dumps(obj, separators=(",", ":")).encode()
        size = torch.tensor([len(data)], dtype=torch.int64)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world)]
        self._run(self.dist.all_gather, sizes, size)
        n = max(int(s.item()) for s in sizes)
        buf = torch.zeros(n, dtype=torch.uint8)
        buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else buf[:0]
        outs = [torch.empty(n, dtype=torch.uint8) for _ in range(self.world)]
        self._run(self.dist.all_gather, outs, buf)
        traffic.add(8 * self.world + n * self.world)
        return [json.loads(bytes(o[: int(s.item())].numpy())) for o, s in zip(outs, sizes)]

    def any_true(self, flags: torch.Tensor) -> torch.Tensor:
        """Element-wise OR of a uint8 vector over the ranks."""
        if self.store is None:
            return flags
        out = flags.clone()
        self._run(self.dist.all_reduce, out, op=self.dist.ReduceOp.MAX)
        traffic.add(out.numel() * out.element_size())
        return out

    # -- the coordinator pattern: rank 0 receives, plans, and answers each rank ----------
    def gather_json(self, obj: Any) -> list[Any] | None:
        """Every rank's ``obj`` (JSON-serialisable) on rank 0 of the group, in rank
        order; None on the other ranks, which receive nothing. Sizes travel first (one
        int64 per rank, gathered), then each payload point-to-point at its own size, so
        the coordinator receives the sum of the payloads, never the largest times the
        world."""
        if self.store is None:
            return [obj]
        data = _encode(obj)
        size = torch.tensor([len(data)], dtype=torch.int64)
        root = self.ranks[0]
        if self.rank != 0:
            self._run(self.dist.gather, size, None, dst=root)
            if data:
                self._run(self.dist.send, _as_tensor(data), dst=root)
            traffic.ops += 1
            return None
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world)]
        self._run(self.dist.gather, size, sizes, dst=root)
        ns = [int(s.item()) for s in sizes]
        bufs = [torch.empty(n, dtype=torch.uint8) for n in ns]

        def recv_all(group: Any) -> None:
            works = [self.dist.irecv(bufs[r], src=self.ranks[r], group=group) for r in range(1, self.world) if ns[r]]
            for w in works:
                w.wait()

        self._run(recv_all)
        traffic.add(8 * self.world + sum(ns[1:]))
        return [obj] + [json.loads(bytes(b.numpy())) for b in bufs[1:]]

    def scatter_json(self, objs: list[Any] | None) -> Any:
        """Rank 0 gives ``objs[r]`` to rank ``r`` (``objs`` is ignored elsewhere); each
        rank receives only its own object (its size, then its bytes)."""
        if self.store is None:
            assert objs is not None
            return objs[0]
        root = self.ranks[0]
        size = torch.zeros(1, dtype=torch.int64)
        if self.rank == 0:
            assert objs is not None and len(objs) == self.world
            datas = [_encode(o) for o in objs]
            sizes = [torch.tensor([len(d)], dtype=torch.int64) for d in datas]
            self._run(self.dist.scatter, size, sizes, src=root)

            def send_all(group: Any) -> None:
                works = [self.dist.isend(_as_tensor(datas[r]), dst=self.ranks[r], group=group)
                         for r in range(1, self.world) if datas[r]]
                for w in works:
                    w.wait()

            self._run(send_all)
            traffic.ops += 1
            return objs[0]
        self._run(self.dist.scatter, size, None, src=root)
        n = int(size.item())
        buf = torch.empty(n, dtype=torch.uint8)
        if n:
            self._run(self.dist.recv, buf, src=root)
        traffic.add(8 + n)
        return json.loads(bytes(buf.numpy()))

    def broadcast_json(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank (``obj`` is ignored elsewhere)."""
        if self.store is None:
            return obj
        root = self.ranks[0]
        data = _encode(obj) if self.rank == 0 else b""
        size = torch.tensor([len(data)], dtype=torch.int64)
        self._run(self.dist.broadcast, size, src=root)
        n = int(size.item())
        buf = _as_tensor(data) if self.rank == 0 else torch.empty(n, dtype=torch.uint8)
        if n:
            self._run(self.dist.broadcast, buf, src=root)
        if self.rank == 0:
            traffic.ops += 1
            return obj
        traffic.add(8 + n)
        return json.loads(bytes(buf.numpy()))

    def _run(self, collective: Any, *args: Any, **kwargs: Any) -> None:
        """One collective on the checkpoint group. When it fails (gloo raises as soon
        as a peer's connection closes), raise :class:`CollectiveMismatchError` naming
        the ranks that are gone instead of gloo's own error, so that
        ``except ShardpointError`` in a training loop sees it."""
        try:
            collective(*args, group=self.group(), **kwargs)
        except Exception as e:  # noqa: BLE001 - RuntimeError, DistError and its subclasses
            raise self._peer_failure(e) from e

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


def _encode(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def _as_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _failure(error: BaseException) -> dict[str, Any]:
    return {"ok": False, "error": f"{type(error).__name__}: {error}", "type": type(error).__name__}


def _raise_failed(comm: Comm, failed: list[tuple[int, dict[str, Any]]], error: BaseException | None) -> None:
    """Raise on this rank for a collective call in which ``failed`` ranks failed
    (this rank's own ``error`` first, with its original type)."""
    if isinstance(error, ShardpointError):
        raise error
    if error is not None:  # keep the original (an OSError's errno, say) as the cause
        raise ShardpointError(f"rank {comm.rank} failed: {type(error).__name__}: {error}") from error
    from . import errors

    r, e = failed[0]
    cls = getattr(errors, e.get("type", ""), None)
    if not (isinstance(cls, type) and issubclass(cls, errors.ShardpointError)) or cls is errors.CollectiveMismatchError:
        cls = errors.CollectiveMismatchError
    msg = f"rank {r} failed, so this collective call failed on every rank: {e['error']}"
    if cls is errors.CollectiveMismatchError:
        raise errors.CollectiveMismatchError(msg, ranks=[f for f, _ in failed])
    raise cls(msg)


def coordinate(comm: Comm, payload: Any, error: BaseException | None, decide: Any) -> Any:
    """One round of the coordinator pattern: every rank's ``payload`` (or the error it
    hit) goes to rank 0, which calls ``decide(payloads) -> replies`` (one reply per
    rank) and sends each rank only its own reply. If any rank failed, or ``decide``
    raised, every rank raises, naming the failing rank and carrying its message (the
    failing rank re-raises its own exception). A non-coordinator rank receives one
    reply, whatever the world size.

    Returns:
        This rank's reply.
    """
    mine = {"ok": True, "payload": payload} if error is None else _failure(error)
    own: BaseException | None = error
    try:
        everyone = comm.gather_json(mine)
        replies: list[Any] | None = None
        if everyone is not None:  # the coordinator
            failed = [(r, e) for r, e in enumerate(everyone) if not e["ok"]]
            if failed:
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
        reply = comm.scatter_json(replies)
    except CollectiveMismatchError as lost:
        if own is None:
            raise
        # a peer is gone as well; this rank's own failure is what its user needs first
        raise ShardpointError(f"rank {comm.rank} failed: {type(own).__name__}: {own} (and {lost})") from own
    if not reply["ok"]:
        others = [(f, {}) for f in reply["failed"] if f != reply["rank"]]
        _raise_failed(comm, [(reply["rank"], reply), *others], own)
    return reply["payload"]


def agree(comm: Comm, payload: Any, error: BaseException | None) -> list[Any]:
    """Exchange each rank's ``payload`` or error; if any rank failed, raise on every
    rank (the failing rank re-raises its own exception)."""
    mine = {"ok": error is None, "payload": payload if error is None else None}
    if error is not None:
        mine["error"] = f"{type(error).__name__}: {error}"
        mine["type"] = type(error).__name__
    try:
        everyone = comm.all_gather_json(mine)
    except CollectiveMismatchError as lost:
        if error is None:
            raise
        # a peer is gone as well; this rank's own failure is what its user needs first
        raise ShardpointError(f"rank {comm.rank} failed: {type(error).__name__}: {error} (and {lost})") from error
    failed = [(r, e) for r, e in enumerate(everyone) if not e["ok"]]
    if failed:
        _raise_failed(comm, failed, error)
    return [e["payload"] for e in everyone]
