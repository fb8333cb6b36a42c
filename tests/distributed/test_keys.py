"""Keys across real gloo ranks: pipeline stages load only their own layers, seed
003 (lazily absent keys are created on every rank), replicas that differ by one
ULP are refused naming key and ranks, and PerRank values round-trip rank by rank,
also onto another world size."""

from __future__ import annotations

import math
import os

import pytest
import torch

import shardpoint
from shardpoint import ShardpointError
from tests._dist import run_ranks

pytestmark = pytest.mark.distributed


# --- pipeline stages -----------------------------------------------------------------

def layer(i: int) -> dict:
    g = torch.Generator().manual_seed(i)
    return {"weight": torch.randn(3, 4, generator=g), "bias": torch.randn(3, generator=g)}


def stage_state(rank: int, fill: bool) -> dict:
    """Rank 0 holds layers 0-1, rank 1 layers 2-3; both hold the step counter."""
    mine = range(2 * rank, 2 * rank + 2)
    model = {f"layers.{i}": layer(i) if fill else {k: torch.zeros_like(v) for k, v in layer(i).items()} for i in mine}
    optim = {f"layers.{i}": {"exp_avg": layer(i)["weight"] * 0.5 if fill else torch.zeros(3, 4)} for i in mine}
    return {"model": model, "optim": optim, "step": 10 if fill else 0}


def pipeline_case(rank: int, world: int, path: str) -> dict:
    shardpoint.save(stage_state(rank, fill=True), path)
    target = stage_state(rank, fill=False)
    ptrs = {(i, k): t.data_ptr() for i, d in target["model"].items() for k, t in d.items()}
    report = shardpoint.load(target, path)
    for i, d in target["model"].items():
        want = layer(int(i.split(".")[1]))
        for k, t in d.items():
            assert torch.equal(t, want[k]) and t.data_ptr() == ptrs[(i, k)], (i, k)
    assert sorted(target["model"]) == [f"layers.{i}" for i in range(2 * rank, 2 * rank + 2)], "nothing may be created"
    assert target["step"] == 10
    return {"loaded": report.loaded, "created": report.created, "unexpected": report.unexpected,
            "missing": report.missing, "skipped": report.skipped}


def test_pipeline_stages_load_only_their_own_layers(tmp_path) -> None:  # type: ignore[no-untyped-def]
    results = run_ranks(pipeline_case, 2, str(tmp_path / "ckpt"), timeout=180)
    for rank, rep in enumerate(results):
        layers = [2 * rank, 2 * rank + 1]
        want = sorted([f"model/layers.{i}/{k}" for i in layers for k in ("bias", "weight")]
                      + [f"optim/layers.{i}/exp_avg" for i in layers] + ["step"])
        assert rep["loaded"] == want, f"rank {rank}"
        assert rep["created"] == [] and rep["unexpected"] == [] and rep["missing"] == [] and rep["skipped"] == []
    full = shardpoint.load_full(tmp_path / "ckpt")
    assert sorted(full["model"]) == [f"layers.{i}" for i in range(4)]


# --- seed 003 on two ranks --------------------------------------------------------------

def seed003_case(rank: int, world: int, tmp: str) -> dict:
    shardpoint.save({"dl_state": {"data": {"a": "b"}}}, f"{tmp}/ckpt")
    created: dict = {"dl_state": {}}
    r1 = shardpoint.load(created, f"{tmp}/ckpt")
    kept: dict = {"dl_state": {}}
    r2 = shardpoint.load(kept, f"{tmp}/ckpt", create=False)
    # rank 0 holds the key, rank 1 does not: it is rank 0's business only
    mixed: dict = {"dl_state": {"data": {"a": "x"}}} if rank == 0 else {"dl_state": {}}
    r3 = shardpoint.load(mixed, f"{tmp}/ckpt")
    return {"created": created, "r1": (r1.created, r1.unexpected, r1.loaded), "kept": kept,
            "r2": (r2.created, r2.unexpected, r2.loaded), "mixed": mixed, "r3": (r3.created, r3.unexpected, r3.loaded)}


def test_seed_003_on_two_ranks(tmp_path) -> None:  # type: ignore[no-untyped-def]
    results = run_ranks(seed003_case, 2, str(tmp_path), timeout=180)
    for rank, res in enumerate(results):
        assert res["created"] == {"dl_state": {"data": {"a": "b"}}}, f"rank {rank}"
        assert res["r1"] == (["dl_state/data/a"], [], [])
        assert res["kept"] == {"dl_state": {}} and res["r2"] == ([], ["dl_state/data/a"], [])
    assert results[0]["mixed"] == {"dl_state": {"data": {"a": "b"}}} and results[0]["r3"] == ([], [], ["dl_state/data/a"])
    assert results[1]["mixed"] == {"dl_state": {}} and results[1]["r3"] == ([], [], [])


# --- replicas that differ by one ULP ------------------------------------------------------

def ulp_case(rank: int, world: int, tmp: str) -> dict:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    out = {}
    # 1: a parameter; 2: deep inside the optimizer state; 3: a plain float
    for case in ("param", "optim", "value"):
        sd = {"model": {k: v.clone() for k, v in model.state_dict().items()}, "optim": opt.state_dict(), "lr": 0.1}
        if rank == 1 and case == "param":
            w = sd["model"]["weight"]
            w[1, 2] = torch.nextafter(w[1, 2], torch.tensor(float("inf")))
        if rank == 1 and case == "optim":
            sd["optim"] = {"state": {k: dict(v) for k, v in sd["optim"]["state"].items()}, "param_groups": sd["optim"]["param_groups"]}
            ea = sd["optim"]["state"][0]["exp_avg"].clone()
            ea.view(-1)[5] = torch.nextafter(ea.view(-1)[5], torch.tensor(-float("inf")))
            sd["optim"]["state"][0]["exp_avg"] = ea
        if rank == 1 and case == "value":
            sd["lr"] = math.nextafter(0.1, 1.0)
        path = f"{tmp}/{case}"
        with pytest.raises(ShardpointError) as ei:
            shardpoint.save(sd, path)
        torch.distributed.barrier()  # every rank has cleaned up after itself
        out[case] = {"msg": str(ei.value), "files": sorted(os.listdir(path)) if os.path.isdir(path) else []}
    # the same values as PerRank round-trip rank by rank
    mine = {"w": model.state_dict()["weight"].clone(), "lr": 0.1}
    if rank == 1:
        mine["w"][1, 2] = torch.nextafter(mine["w"][1, 2], torch.tensor(float("inf")))
        mine["lr"] = math.nextafter(0.1, 1.0)
    shardpoint.save({"shared": model.state_dict()["bias"].clone(), "mine": shardpoint.PerRank(mine)}, f"{tmp}/per_rank")
    target = {"shared": torch.zeros(3), "mine": shardpoint.PerRank({"w": torch.zeros(3, 4), "lr": 0.0})}
    w_obj = target["mine"].value["w"]
    report = shardpoint.load(target, f"{tmp}/per_rank")
    assert target["mine"].value["w"] is w_obj, "a per-rank tensor must be filled in place"
    out["per_rank"] = {"w": w_obj.clone(), "lr": target["mine"].value["lr"], "report": report.per_rank, "mine": mine,
                       "loaded": report.loaded}
    return out


def test_replicas_differing_by_one_ulp_are_refused(tmp_path) -> None:  # type: ignore[no-untyped-def]
    results = run_ranks(ulp_case, 2, str(tmp_path), timeout=180)
    keys = {"param": "'model/weight'", "optim": "'optim/state/0/exp_avg'", "value": "'lr'"}
    for rank, res in enumerate(results):
        for case, key in keys.items():
            msg = res[case]["msg"]
            assert key in msg and "ranks [0]" in msg and "ranks [1]" in msg, f"rank {rank}, {case}: {msg}"
            assert "PerRank" in msg
            assert res[case]["files"] == [], f"rank {rank}, {case}: leftovers {res[case]['files']}"
        pr = res["per_rank"]
        assert torch.equal(pr["w"], pr["mine"]["w"]) and pr["lr"] == pr["mine"]["lr"]
        assert pr["report"] == {"mine": "restored"} and pr["loaded"] == ["mine/lr", "mine/w", "shared"]
    assert not torch.equal(results[0]["per_rank"]["w"], results[1]["per_rank"]["w"])
    full = shardpoint.load_full(tmp_path / "per_rank")
    assert sorted(full["mine"]) == [0, 1]
    for r in (0, 1):
        assert torch.equal(full["mine"][r]["w"], results[r]["per_rank"]["mine"]["w"])


# --- PerRank on another world size ----------------------------------------------------------

def per_rank_save(rank: int, world: int, path: str) -> None:
    shardpoint.save({"rng": shardpoint.PerRank({"seed": 100 + rank, "state": torch.full((3,), rank, dtype=torch.uint8)}),
                     "pos": shardpoint.PerRank(rank * 7)}, path)


def per_rank_load(rank: int, world: int, path: str) -> dict:
    target = {"rng": shardpoint.PerRank({"seed": -1, "state": torch.full((3,), 255, dtype=torch.uint8)}),
              "pos": shardpoint.PerRank(-1)}
    report = shardpoint.load(target, path)
    return {"rng": target["rng"].value, "pos": target["pos"].value, "per_rank": report.per_rank,
            "loaded": report.loaded, "world_size": report.world_size}


def test_per_rank_values_on_another_world_size(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Rank r gets what rank r saved; a rank that did not exist at save time keeps
    its own value, and its report says "kept"."""
    path = str(tmp_path / "ckpt")
    run_ranks(per_rank_save, 2, path, timeout=180)
    results = run_ranks(per_rank_load, 3, path, timeout=180)
    for r in (0, 1):
        res = results[r]
        assert res["rng"]["seed"] == 100 + r and torch.equal(res["rng"]["state"], torch.full((3,), r, dtype=torch.uint8))
        assert res["pos"] == 7 * r and res["per_rank"] == {"pos": "restored", "rng": "restored"}
        assert res["loaded"] == ["pos", "rng/seed", "rng/state"] and res["world_size"] == 2
    new = results[2]
    assert new["rng"]["seed"] == -1 and torch.equal(new["rng"]["state"], torch.full((3,), 255, dtype=torch.uint8))
    assert new["pos"] == -1 and new["per_rank"] == {"pos": "kept", "rng": "kept"} and new["loaded"] == []
    # and onto fewer ranks: rank 0 gets its own, rank 1's value is simply not loaded
    target = {"rng": shardpoint.PerRank({"seed": -1, "state": torch.zeros(3, dtype=torch.uint8)}), "pos": shardpoint.PerRank(-1)}
    report = shardpoint.load(target, path)
    assert target["rng"].value["seed"] == 100 and target["pos"].value == 0
    assert report.per_rank == {"pos": "restored", "rng": "restored"}
