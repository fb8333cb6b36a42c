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
        return [json.loads(bytes(o[: int(s.item())].numpy())) for o, s in zip(outs, sizes)]

    def any_true(self, flags: torch.Tensor) -> torch.Tensor:
        """Element-wise OR of a uint8 vector over the ranks."""
        if self.store is None:
            return flags
        out = flags.clone()
        self._run(self.dist.all_reduce, out, op=self.dist.ReduceOp.MAX)
        return out

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
        if isinstance(error, ShardpointError):
            raise error
        if error is not None:  # keep the original (an OSError's errno, say) as the cause
            raise ShardpointError(f"rank {comm.rank} failed: {type(error).__name__}: {error}") from error
        from . import errors

        r, e = failed[0]
        cls = getattr(errors, e.get("type", ""), None)
        msg = f"rank {r} failed, so this collective call failed on every rank: {e['error']}"
        if cls is errors.CollectiveMismatchError:  # that rank saw ranks that did not come or died
            raise errors.CollectiveMismatchError(msg, ranks=[f for f, _ in failed])
        if not (isinstance(cls, type) and issubclass(cls, errors.ShardpointError)):
            cls = errors.ShardpointError  # its own ordinary error (a full disk): not a missing rank
        raise cls(msg + "; see that rank's error for the cause and fix it there")
    return [e["payload"] for e in everyone]
