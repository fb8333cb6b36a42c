"""The coordinator round on real gloo ranks, in both its forms: payloads sent point to
point after their sizes (``rendezvous=True``, what a save's commit needs) and carried
in the gather and the scatter (``rendezvous=False``, a load's agreements). Every size
around the inline part arrives whole, and a load that fails on one rank, before its
reads or after them, with a message longer than the inline part, raises on every rank
naming that rank and carrying the whole message."""

from __future__ import annotations

import pytest
import torch

import shardpoint
from tests._dist import run_ranks

pytestmark = pytest.mark.distributed


def exchange_case(rank: int, world: int) -> dict:
    from shardpoint.collective import HEAD, Comm, agree
    from shardpoint.runtime import PROCESS

    comm = Comm()
    comm.arrive("load", "/warm-up")
    # JSON strings of sizes around the inline part: a rank's payload is len + 2 bytes (its quotes)
    sizes = [0, HEAD - 3, HEAD - 2, HEAD - 1, HEAD, 5 * HEAD + 7]
    out: dict = {"gathered": [], "scattered": [], "agreed": [], "traffic": []}
    for rendezvous in (True, False):
        for n in sizes:
            mine = chr(ord("a") + rank) * (n + rank)  # each rank's own length: some inline, some not
            got = comm.gather_json(mine, rendezvous=rendezvous)
            out["gathered"].append(got)
            PROCESS.seams.traffic.reset()
            reply = comm.scatter_json([f"{r}:" + "z" * n for r in range(world)] if rank == 0 else None,
                                      rendezvous=rendezvous)
            out["traffic"].append((rendezvous, n, PROCESS.seams.traffic.received))
            out["scattered"].append(reply)
            out["agreed"].append(agree(comm, [rank, mine], None, lambda e: sorted(p[0] for p in e),
                                       rendezvous=rendezvous))
    out["sizes"] = sizes
    return out


def test_exchanges_carry_every_size_whole_in_both_forms() -> None:
    from shardpoint.collective import HEAD

    res = run_ranks(exchange_case, 3, timeout=120)
    sizes = res[0]["sizes"]
    for rank, got in enumerate(res):
        for i, n in enumerate(sizes * 2):
            want = [chr(ord("a") + r) * (n + r) for r in range(3)]
            assert got["gathered"][i] == (want if rank == 0 else None), (rank, n)
            assert got["scattered"][i] == f"{rank}:" + "z" * n, (rank, n)
            assert got["agreed"][i] == [0, 1, 2]
        if rank:
            for rendezvous, n, received in got["traffic"]:
                size = len(f'"{rank}:' + "z" * n + '"')
                # inline: the fixed part, and what is longer than it after; else its size, then its bytes
                assert received == (8 + HEAD + max(0, size - HEAD) if not rendezvous else 8 + size), (rendezvous, n)


class _Refuses:
    """A stateful object that refuses its state on rank 1 with a long message."""

    def __init__(self, rank: int) -> None:
        self.rank, self.value = rank, 0

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, sd: dict) -> None:
        if self.rank == 1:
            raise ValueError("rank one refuses this state: " + "x" * 400 + " (the end of the message)")
        self.value = sd["value"]


def load_failure_case(rank: int, world: int, tmp: str) -> dict:
    path = f"{tmp}/ck"
    shardpoint.save({"w": torch.arange(4.0), "obj": _Refuses(rank)}, path)
    out = {}
    # after the reads: rank 1's object refuses what was read
    with pytest.raises(shardpoint.ShardpointError) as ei:
        shardpoint.load({"w": torch.zeros(4), "obj": _Refuses(rank)}, path)
    out["after"] = (type(ei.value).__name__, str(ei.value), getattr(ei.value, "rank", None))
    # before the reads: rank 1's target has another shape
    with pytest.raises(shardpoint.ShardpointError) as ei:
        shardpoint.load({"w": torch.zeros(4 + rank)}, path, strict=False)
    out["before"] = (type(ei.value).__name__, str(ei.value), getattr(ei.value, "rank", None))
    # and the next load goes through on both
    target = {"w": torch.zeros(4)}
    shardpoint.load(target, path, strict=False)
    out["next"] = target["w"].tolist()
    return out


def test_a_load_failing_on_one_rank_names_it_on_every_rank(tmp_path) -> None:  # type: ignore[no-untyped-def]
    res = run_ranks(load_failure_case, 2, str(tmp_path), timeout=120)
    for rank, got in enumerate(res):
        kind, msg, who = got["after"]
        assert "rank one refuses this state" in msg and "(the end of the message)" in msg, (rank, msg)
        if rank == 0:
            assert kind == "RankFailedError" and "rank 1 failed" in msg and who == 1, msg
        kind, msg, _ = got["before"]
        assert kind == "KeyMismatchError" and "key 'w'" in msg and "global shape (5,)" in msg, (rank, msg)
        if rank == 0:
            assert "rank 1 failed" in msg, msg
        assert got["next"] == [0.0, 1.0, 2.0, 3.0]
