"""Collective safety on 4 real gloo ranks: ranks that do not call save are named
on every rank that did, whichever they are; ranks that call late get the same
error instead of hanging; ranks that disagree on the path are told so; and the
next correct save on all ranks works (the per-call sequence stays in step)."""

from __future__ import annotations

import os
import time

import pytest
import torch

import shardpoint
from shardpoint import CollectiveMismatchError
from tests._dist import run_ranks

pytestmark = pytest.mark.distributed
WORLD = 4
SHORT = 3.0  # seconds the failing calls wait for absent ranks
LONG = 60.0  # the correct calls afterwards: ranks arrive seconds apart


def state(rank: int) -> dict:
    return {"w": torch.arange(6.0), "step": 5, "rng": shardpoint.PerRank(rank)}


def check_next_save_works(rank: int, path: str) -> None:
    """A correct collective save and load right after the failure."""
    shardpoint.save(state(rank), path, timeout=LONG)
    target = {"w": torch.zeros(6), "step": 0, "rng": shardpoint.PerRank(-1)}
    report = shardpoint.load(target, path, timeout=LONG)
    assert torch.equal(target["w"], torch.arange(6.0)) and target["step"] == 5 and target["rng"].value == rank
    assert report.per_rank == {"rng": "restored"}


def absent_case(rank: int, world: int, callers: list[int], tmp: str) -> dict:
    """Ranks in ``callers`` call save; the others wait in a barrier of the training
    group (a collective of their own: it must not be matched against the save's),
    then call the same save late."""
    import torch.distributed as dist

    path = f"{tmp}/ckpt"
    t0 = time.monotonic()
    if rank in callers:
        with pytest.raises(CollectiveMismatchError) as ei:
            shardpoint.save(state(rank), path, timeout=SHORT)
        dist.barrier()  # lets the absent ranks go on
    else:
        dist.barrier()  # stuck in the training group's collective while the others save
        with pytest.raises(CollectiveMismatchError) as ei:
            shardpoint.save(state(rank), path, timeout=LONG)  # late: the call was already abandoned
    failed_after = time.monotonic() - t0
    leftovers = os.listdir(path) if os.path.isdir(path) else []
    check_next_save_works(rank, f"{tmp}/next")
    # every rank has left the abandoned call (the late ones too), so its keys are gone
    from shardpoint.collective import Comm

    store = Comm().store
    left = [k for k in ("ref", "bad", "n", "who", "go", "out") if store.check([f"1/{k}"])]
    return {"ranks": ei.value.ranks, "msg": str(ei.value), "failed_after": failed_after, "leftovers": leftovers,
            "store_keys_left": left}


def _check_absent(results: list[dict], absent: list[int]) -> None:
    for r, res in enumerate(results):
        assert res["ranks"] == absent, f"rank {r} named {res['ranks']}, expected {absent}"
        assert f"ranks {absent} of the process group did not call it" in res["msg"], res["msg"]
        assert "shardpoint.save(" in res["msg"] and "timeout" in res["msg"]
        # a late rank sees the verdict at once; it does not sit out its own (long) timeout
        assert res["failed_after"] < LONG, f"rank {r} waited its whole timeout"
        assert "manifest.json" not in res["leftovers"]
        assert res["store_keys_left"] == [], res["store_keys_left"]


def test_only_rank_0_calls_save(tmp_path) -> None:  # type: ignore[no-untyped-def]
    results = run_ranks(absent_case, WORLD, [0], str(tmp_path), timeout=180)
    _check_absent(results, [1, 2, 3])


def test_ranks_1_and_3_are_elsewhere(tmp_path) -> None:  # type: ignore[no-untyped-def]
    results = run_ranks(absent_case, WORLD, [0, 2], str(tmp_path), timeout=180)
    _check_absent(results, [1, 3])


def test_rank_0_does_not_call(tmp_path) -> None:  # type: ignore[no-untyped-def]
    results = run_ranks(absent_case, WORLD, [1, 2, 3], str(tmp_path), timeout=180)
    _check_absent(results, [0])


def never_case(rank: int, world: int, tmp: str) -> dict | None:
    """Only rank 0 calls; the others never do and simply finish."""
    if rank != 0:
        return None
    with pytest.raises(CollectiveMismatchError) as ei:
        shardpoint.save(state(rank), f"{tmp}/ckpt", timeout=SHORT)
    return {"ranks": ei.value.ranks}


def test_ranks_that_never_call_do_not_hang_rank_0(tmp_path) -> None:  # type: ignore[no-untyped-def]
    results = run_ranks(never_case, WORLD, str(tmp_path), timeout=180)
    assert results[0] == {"ranks": [1, 2, 3]} and results[1:] == [None, None, None]


def misuse_then_save_case(rank: int, world: int, tmp: str) -> dict | None:
    """Rank 0 alone saves (a save behind `if rank == 0:`) and is told who is absent;
    the others wait in a training collective meanwhile. Then every rank saves
    another path, which must work: the abandoned call is not theirs."""
    import torch.distributed as dist

    out = None
    if rank == 0:
        with pytest.raises(CollectiveMismatchError) as ei:
            shardpoint.save(state(rank), f"{tmp}/misused", timeout=SHORT)
        out = {"ranks": ei.value.ranks}
    dist.barrier()
    check_next_save_works(rank, f"{tmp}/next")
    check_next_save_works(rank, f"{tmp}/after")
    return out


def test_a_save_on_rank_0_only_does_not_spoil_the_next_save(tmp_path) -> None:  # type: ignore[no-untyped-def]
    results = run_ranks(misuse_then_save_case, WORLD, str(tmp_path), timeout=180)
    assert results[0] == {"ranks": [1, 2, 3]} and results[1:] == [None, None, None]
    assert not (tmp_path / "misused" / "manifest.json").exists()


def paths_case(rank: int, world: int, tmp: str) -> dict:
    path = f"{tmp}/a" if rank < 2 else f"{tmp}/b"
    with pytest.raises(CollectiveMismatchError) as ei:
        shardpoint.save(state(rank), path, timeout=LONG)
    # save on one path, load on another: the same check
    with pytest.raises(CollectiveMismatchError) as ei2:
        if rank == 3:
            shardpoint.load({"w": torch.zeros(6)}, f"{tmp}/a", timeout=LONG)
        else:
            shardpoint.save(state(rank), f"{tmp}/a", timeout=LONG)
    check_next_save_works(rank, f"{tmp}/next")
    return {"ranks": ei.value.ranks, "msg": str(ei.value), "ranks2": ei2.value.ranks, "msg2": str(ei2.value),
            "a": os.path.exists(f"{tmp}/a/manifest.json"), "b": os.path.exists(f"{tmp}/b/manifest.json")}


def test_ranks_with_different_paths(tmp_path) -> None:  # type: ignore[no-untyped-def]
    results = run_ranks(paths_case, WORLD, str(tmp_path), timeout=180)
    for r, res in enumerate(results):
        assert res["ranks"] == [2, 3], f"rank {r}: {res}"
        assert "different checkpoint operations or paths" in res["msg"]
        assert f"rank 0: save('{tmp_path}/a')" in res["msg"] and f"rank 2: save('{tmp_path}/b')" in res["msg"]
        assert res["ranks2"] == [3] and "rank 3: load(" in res["msg2"]
        assert not res["a"] and not res["b"]


def tagged_case(rank: int, world: int, tmp: str) -> dict:
    """Tagged saves (a trainer's): rank 0 alone saves ``a`` while rank 1 goes straight
    on to the save of ``b`` that every rank makes (nothing holds it back, as after
    Lightning's ``if trainer.is_global_zero: trainer.save_checkpoint(a)``). Rank 0 is
    told rank 1 is absent and is refused at once when it retries ``a``; the save of
    ``b`` meets and commits; after it, a save of ``a`` by every rank meets anew. Only
    the abandoned slot's keys stay in the store."""
    import torch.distributed as dist

    from shardpoint.collective import Comm

    store = dist.distributed_c10d._get_default_store()
    shardpoint.save(state(rank), f"{tmp}/warm", timeout=LONG, tag="step 0")  # makes the lanes
    dist.barrier()
    keys = store.num_keys()
    out: dict = {"misuse": None, "again": None}
    if rank == 0:
        with pytest.raises(CollectiveMismatchError) as ei:
            shardpoint.save(state(rank), f"{tmp}/a", timeout=SHORT, tag="step 2")
        out["misuse"] = {"ranks": ei.value.ranks, "msg": str(ei.value)}
        t0 = time.monotonic()
        with pytest.raises(CollectiveMismatchError) as again:  # the same call: refused at once
            shardpoint.save(state(rank), f"{tmp}/a", timeout=LONG, tag="step 2")
        out["again"] = {"ranks": again.value.ranks, "after": time.monotonic() - t0}
    shardpoint.save(state(rank), f"{tmp}/b", timeout=LONG, tag="step 2")
    out["a_before"] = os.path.exists(f"{tmp}/a/manifest.json")
    dist.barrier()
    shardpoint.save(state(rank), f"{tmp}/a", timeout=LONG, tag="step 2")  # made by every rank now: meets anew
    check_next_save_works(rank, f"{tmp}/next")
    seq = Comm().channel.seq  # type: ignore[union-attr]
    dist.barrier()
    out.update(keys_added=store.num_keys() - keys, seq=seq, a=os.path.exists(f"{tmp}/a/manifest.json"),
               b=os.path.exists(f"{tmp}/b/manifest.json"))
    return out


def test_a_tagged_save_only_rank_0_makes_never_meets_the_next_one(tmp_path) -> None:  # type: ignore[no-untyped-def]
    res = run_ranks(tagged_case, 2, str(tmp_path), timeout=180)
    m = res[0]["misuse"]
    assert m["ranks"] == [1] and "did not call it" in m["msg"] and "[step 2]" in m["msg"], m
    assert res[1]["misuse"] is None
    assert res[0]["again"]["ranks"] == [1] and res[0]["again"]["after"] < SHORT, res[0]  # refused at once
    for r in res:
        assert r["b"] and r["a"] and not r["a_before"], r
        assert r["seq"] == res[0]["seq"], res  # the call numbers stay in step
        assert r["keys_added"] <= 4, r  # at most the abandoned slot's n, who, go, out


def misuse_then_steps_case(rank: int, world: int, tmp: str, how: str) -> dict:
    """Rank 0 alone makes one checkpoint call (``how``: a manager save of step 1, a
    ``shardpoint.save`` or a ``shardpoint.load``) while the other ranks go straight on
    to the saves of steps 2, 3 and 4 that every rank makes: they meet rank 0's stray
    call, and everyone is told. Then the channel re-aligns: steps 3 and 4 commit on
    every rank, and the resume point is step 4."""
    import torch.distributed as dist

    mgr = shardpoint.CheckpointManager(f"{tmp}/mgr", timeout=LONG)
    shardpoint.save(state(rank), f"{tmp}/p0", timeout=LONG)  # something for the stray load to load
    dist.barrier()

    def save(step: int) -> None:
        if how == "manager":
            mgr.save(state(rank), step)
        else:
            shardpoint.save(state(rank), f"{tmp}/p{step}", timeout=LONG)

    out: dict = {"stray": None, "steps": {}}
    if rank == 0:
        with pytest.raises(CollectiveMismatchError) as ei:
            if how == "manager":
                mgr.save(state(rank), 1)
            elif how == "save":
                shardpoint.save(state(rank), f"{tmp}/p1", timeout=LONG)
            else:
                shardpoint.load({"w": torch.zeros(6), "step": 0, "rng": shardpoint.PerRank(-1)}, f"{tmp}/p0",
                                timeout=LONG)
        out["stray"] = {"ranks": ei.value.ranks, "msg": str(ei.value)}
    for step in (2, 3, 4):
        t0 = time.monotonic()
        try:
            save(step)
            out["steps"][step] = "ok"
        except CollectiveMismatchError as e:
            out["steps"][step] = f"{e.ranks} {e}"
        out.setdefault("took", {})[step] = time.monotonic() - t0
    target = {"w": torch.zeros(6), "step": 0, "rng": shardpoint.PerRank(-1)}
    if how == "manager":
        out["restored"] = shardpoint.CheckpointManager(f"{tmp}/mgr", timeout=LONG).restore(target).step
    else:
        shardpoint.load(target, f"{tmp}/p4", timeout=LONG)
        out["restored"] = 4 if torch.equal(target["w"], torch.arange(6.0)) else None
    return out


@pytest.mark.parametrize("how", ["manager", "save", "load"])
def test_the_calls_after_a_misuse_meet_again(tmp_path, how: str) -> None:  # type: ignore[no-untyped-def]
    res = run_ranks(misuse_then_steps_case, 2, str(tmp_path), how, timeout=240)
    stray = res[0]["stray"]
    assert stray["ranks"] == [1] and "different checkpoint operations or paths" in stray["msg"], stray
    for r in res:
        assert r["steps"][3] == "ok" and r["steps"][4] == "ok", r
        assert r["restored"] == 4, r
        assert all(t < LONG for t in r["took"].values()), r  # nobody sat out a timeout
    # the call that met the misuse: rank 1's save of step 2 failed with it; rank 0's, made
    # after it, is refused at once as abandoned, naming rank 1
    assert "different checkpoint operations or paths" in res[1]["steps"][2], res[1]
    assert res[0]["steps"][2].startswith("[1] ") and "was abandoned before this rank made it" in res[0]["steps"][2]
    step2 = tmp_path / ("mgr/step-00000002" if how == "manager" else "p2") / "manifest.json"
    assert not step2.exists()
