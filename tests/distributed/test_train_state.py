"""TrainState + CheckpointManager on real gloo ranks with FSDP2: restore into a
fresh model and a never-stepped AdamW, continue bit for bit; RNG streams; DDP and
compiled keys; preemption."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

import shardpoint
from tests._dist import run_ranks

pytestmark = pytest.mark.distributed


def model_fn(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 9), torch.nn.Tanh(), torch.nn.Linear(9, 5), torch.nn.Linear(5, 2))


def build(seed: int, world: int):  # type: ignore[no-untyped-def]
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    m = model_fn(seed)
    for layer in m:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(m, mesh=mesh)
    opt = torch.optim.AdamW(m.parameters(), lr=3e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
    return m, opt, sched


def step(m, opt, sched, i: int, rank: int, world: int) -> None:  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(1000 + i)
    x, y = torch.randn(8, 6, generator=g), torch.randn(8, 2, generator=g)
    n = 8 // world
    loss = torch.nn.functional.mse_loss(m(x[rank * n : (rank + 1) * n]), y[rank * n : (rank + 1) * n])
    loss.backward()
    opt.step()
    opt.zero_grad()
    sched.step()


def snapshot(m, opt) -> dict[str, torch.Tensor]:  # type: ignore[no-untyped-def]
    out = {f"p/{n}": p.full_tensor().clone() for n, p in m.named_parameters()}
    names = {id(p): n for n, p in m.named_parameters()}
    for p, st in opt.state.items():
        for k, v in st.items():
            out[f"o/{names[id(p)]}/{k}"] = (v.full_tensor() if hasattr(v, "full_tensor") else v).clone()
    return out


def uninterrupted(rank: int, world: int, root: str) -> dict:
    m, opt, sched = build(0, world)
    for i in range(3):
        step(m, opt, sched, i, rank, world)
    state = shardpoint.TrainState(model=m, optimizer=opt, scheduler=sched, step=3)
    shardpoint.CheckpointManager(root).save(state, 3)
    saved = snapshot(m, opt)
    draws = torch.rand(4)
    lr = opt.param_groups[0]["lr"]
    step(m, opt, sched, 3, rank, world)
    return {"saved": saved, "next": snapshot(m, opt), "draws": draws, "lr": lr}


def resumed(rank: int, world: int, root: str) -> dict:
    mgr = shardpoint.CheckpointManager(root)
    m, opt, sched = build(7, world)
    state = shardpoint.TrainState(model=m, optimizer=opt, scheduler=sched, step=0)
    ids = (id(state.model), id(state.optimizer), id(state.scheduler))
    report = mgr.restore(state)
    same_objects = ids == (id(m), id(opt), id(sched)) and state.model is m and state.optimizer is opt
    restored = snapshot(m, opt)
    draws = torch.rand(4)
    lr = opt.param_groups[0]["lr"]
    step(m, opt, sched, 3, rank, world)
    nxt = snapshot(m, opt)
    # negative control: the optimizer left out
    m2, opt2, sched2 = build(7, world)
    mgr.restore(shardpoint.TrainState(model=m2, optimizer=opt2, scheduler=sched2, step=0), exclude=["optimizer"])
    step(m2, opt2, sched2, 3, rank, world)
    return {"restored": restored, "next": nxt, "control": snapshot(m2, opt2), "draws": draws, "lr": lr,
            "same_objects": same_objects, "report": report, "extra": state.extra}


@pytest.mark.parametrize("world", [2, 4])
def test_fsdp2_resume_bit_exact(tmp_path, world: int) -> None:  # type: ignore[no-untyped-def]
    root = str(tmp_path / "run")
    ref = run_ranks(uninterrupted, world, root, timeout=240)
    got = run_ranks(resumed, world, root, timeout=240)
    for r in range(world):
        g, want = got[r], ref[r]
        assert g["same_objects"]
        assert g["report"].step == 3 and g["extra"] == {"step": 3}
        assert g["report"].per_rank["rng/streams"] == "restored"
        assert any(k.startswith("optimizer/state/") for k in g["report"].created), "never-stepped AdamW state is created"
        assert set(g["restored"]) == set(want["saved"])
        for k in want["saved"]:
            assert torch.equal(g["restored"][k], want["saved"][k]), f"rank {r}: {k} not restored exactly"
        for k in want["next"]:
            assert torch.equal(g["next"][k], want["next"][k]), f"rank {r}: {k} differs after the next step"
        assert torch.equal(g["draws"], want["draws"]), "RNG streams do not continue exactly"
        assert g["lr"] == pytest.approx(want["lr"], rel=0, abs=0)
        # the negative control must break the equality, so the test above can fail
        assert any(not torch.equal(g["control"][k], want["next"][k]) for k in want["next"] if k.startswith("p/"))


def rng_save(rank: int, world: int, root: str) -> None:
    torch.manual_seed(100 + rank)
    shardpoint.CheckpointManager(root).save(shardpoint.TrainState(rng=5), 1)


def rng_load(rank: int, world: int, root: str) -> tuple[str, torch.Tensor]:
    torch.manual_seed(999)
    state = shardpoint.TrainState(rng=5)
    report = shardpoint.CheckpointManager(root).restore(state)
    return report.per_rank["rng/streams"], torch.rand(3)


def test_rng_on_another_world_size(tmp_path) -> None:  # type: ignore[no-untyped-def]
    root = str(tmp_path / "rng")
    run_ranks(rng_save, 2, root)
    out = run_ranks(rng_load, 4, root)
    assert [s for s, _ in out] == ["restored", "restored", "derived", "derived"]
    for r in (0, 1):
        torch.manual_seed(100 + r)
        assert torch.equal(out[r][1], torch.rand(3))
    assert not torch.equal(out[2][1], out[3][1]), "new ranks must derive different streams"
    torch.manual_seed(shardpoint.TrainState.derived_seed(5, 2))
    assert torch.equal(out[2][1], torch.rand(3))


def ddp_save(rank: int, world: int, root: str) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    m = DDP(model_fn(3))
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    m(torch.randn(4, 6)).sum().backward()
    opt.step()
    shardpoint.save(shardpoint.TrainState(model=m, optimizer=opt, rng=False), root)
    return {k.removeprefix("module."): v.clone() for k, v in m.state_dict().items()}


def test_ddp_keys_load_into_compiled_and_plain(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = str(tmp_path / "ddp")
    want = run_ranks(ddp_save, 2, path)[0]
    meta = shardpoint.metadata(path)
    assert all(not k.startswith("model/module.") for k in meta.tensors)
    for m in (model_fn(9), torch.compile(model_fn(9))):
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        report = shardpoint.load(shardpoint.TrainState(model=m, optimizer=opt, rng=False), path)
        got = {k.removeprefix("_orig_mod."): v for k, v in m.state_dict().items()}
        assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
        assert not report.missing


def preempt_job(rank: int, world: int, root: str) -> dict:
    mgr = shardpoint.CheckpointManager(root)
    mgr.handle_signals()
    torch.manual_seed(0)  # replicated state must agree on every rank
    m = torch.nn.Linear(3, 3)
    state = shardpoint.TrainState(model=m, rng=False, step=0)
    for i in range(1, 200):
        with torch.no_grad():
            m.weight.fill_(float(i))
        state.extra["step"] = i
        if rank == 2 and i == 5:
            os.kill(os.getpid(), signal.SIGTERM)  # only one rank is told to stop
        time.sleep(0.01)
        if mgr.save_if_preempted(state, i):
            return {"stopped_at": i}
    return {"stopped_at": None}


def test_preemption_saves_the_same_step_on_every_rank(tmp_path) -> None:  # type: ignore[no-untyped-def]
    root = str(tmp_path / "pre")
    out = run_ranks(preempt_job, 4, root)
    steps = {o["stopped_at"] for o in out}
    assert steps == {5}, steps
    mgr = shardpoint.CheckpointManager(root)
    assert mgr.latest().step == 5 and mgr.latest().world_size == 4
    m = torch.nn.Linear(3, 3)
    state = shardpoint.TrainState(model=m, rng=False, step=0)
    assert mgr.restore(state).step == 5
    assert state.extra["step"] == 5 and torch.all(m.weight == 5)
