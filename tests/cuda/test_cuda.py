"""shardpoint on CUDA (issue 16): plain CUDA tensors, FSDP2 and DTensor on a CUDA
mesh, DDP-like replicas, optimizer state (fused AdamW, capturable Adam) created on
load and stepped, RNG of the rank's own device, TrainState, CheckpointManager,
async and overlapped saves, resharding GPU -> CPU and CPU -> GPU.

Skipped, visibly, without a GPU. On a machine with one:

    PYTHONPATH=src python -m pytest -rs tests/cuda

Worlds: one process without a process group; one rank with an NCCL default group;
two ranks sharing one GPU with a gloo default group (NCCL refuses two ranks on one
device) and CUDA tensors. Checkpoint traffic always uses shardpoint's own gloo group.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

import shardpoint
from shardpoint import _rng
from shardpoint.runtime import PROCESS
from shardpoint.saving import buffers as _stage
from shardpoint.saving import handle as asyncsave
from tests._dist import run_ranks

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a CUDA GPU (run `PYTHONPATH=src python -m pytest -rs tests/cuda` on a GPU machine)",
)

NCCL = {"SHARDPOINT_TEST_BACKEND": "nccl"}
GLOO_CUDA = {"SHARDPOINT_TEST_CUDA": "1"}


@pytest.fixture(autouse=True)
def _reset():  # type: ignore[no-untyped-def]
    yield
    PROCESS.seams.copy = None


def _model(seed: int = 0, device: str = "cuda") -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8)).to(device)


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int = 1, seed: int = 1) -> None:
    g = torch.Generator().manual_seed(seed)
    dev = next(model.parameters()).device
    for _ in range(steps):
        x = torch.randn(4, 32, generator=g).to(dev)
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()


def _snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


_OPTIMIZERS = {
    "fused_adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True),
    "capturable_adam": lambda ps: torch.optim.Adam(ps, lr=1e-2, capturable=True),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2),
}


# -- one process, no process group ---------------------------------------------------------------


@pytest.mark.parametrize("kind", sorted(_OPTIMIZERS))
def test_never_stepped_optimizer_resumes_and_steps(tmp_path, kind: str) -> None:  # type: ignore[no-untyped-def]
    make = _OPTIMIZERS[kind]
    model = _model()
    opt = make(model.parameters())
    _train(model, opt, steps=2)
    shardpoint.save(shardpoint.TrainState(model, opt, rng=False), tmp_path / "c")
    fresh = _model(seed=5)
    opt2 = make(fresh.parameters())  # never stepped: its state is created by the load
    report = shardpoint.load(shardpoint.TrainState(fresh, opt2, rng=False), tmp_path / "c")
    assert "optimizer/state/0.weight/exp_avg" in report.created
    for p, q in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(p, q)
        for name, v in opt.state[p].items():
            got = opt2.state[q][name]
            assert got.device == v.device and got.dtype == v.dtype, (kind, name, got.device, v.device)
            assert torch.equal(got.cpu(), v.cpu()), (kind, name)
    _train(model, opt, seed=9)
    _train(fresh, opt2, seed=9)  # a fused or capturable step would fail on CPU state
    for p, q in zip(model.parameters(), fresh.parameters()):
        torch.testing.assert_close(p, q)


def test_blocking_save_of_cuda_tensors_goes_through_the_pinned_pool(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    state = {"a": torch.randn(1024, 1024, device="cuda"), "b": torch.randn(300, 70, device="cuda").t(),
             "h": torch.randn(5000, device="cuda").to(torch.bfloat16), "c": torch.arange(7)}
    total = sum(t.numel() * t.element_size() for k, t in state.items() if t.is_cuda)
    slot = 256 << 10
    monkeypatch.setattr(PROCESS, "pool", _stage.Pool(slot_bytes=slot, slots=3))
    PROCESS.seams.counters.reset()
    shardpoint.save(state, tmp_path / "c")
    assert PROCESS.seams.counters.pooled == total and PROCESS.seams.counters.host_allocated == 3 * slot
    assert _stage.pool().pinned
    full = shardpoint.load_full(tmp_path / "c")
    assert all(torch.equal(full[k], v.cpu()) for k, v in state.items())


def test_load_into_cuda_targets(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Direct (contiguous, same dtype: pinned read, asynchronous copy), cast and
    strided targets on the GPU all hold the saved values when load returns."""
    torch.manual_seed(0)
    w = torch.randn(100, 50)
    shardpoint.save({"w": w, "v": w.clone(), "s": w.clone()}, tmp_path / "c")
    tgt = {"w": torch.empty(100, 50, device="cuda"), "v": torch.empty(100, 50, device="cuda", dtype=torch.bfloat16),
           "s": torch.empty(50, 100, device="cuda").t()}
    report = shardpoint.load(tgt, tmp_path / "c")
    assert report.cast == ["v"]
    assert torch.equal(tgt["w"].cpu(), w) and torch.equal(tgt["s"].cpu(), w)
    assert torch.equal(tgt["v"].cpu(), w.to(torch.bfloat16))


def test_async_and_overlapped_saves_on_cuda(tmp_path) -> None:  # type: ignore[no-untyped-def]
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    _train(model, opt)
    state = shardpoint.TrainState(model, opt, rng=False)
    mgr = shardpoint.CheckpointManager(tmp_path)
    first = _snapshot(model)
    mgr.save(state, 1, blocking=False)
    _train(model, opt)  # training goes on at once: the copy was taken
    mgr.wait()
    assert PROCESS.staging.pinned
    second = _snapshot(model)
    order: list[str] = []
    entered = threading.Event()

    def first_hook(*_: object) -> None:
        order.append("step entered")
        entered.set()

    opt.register_step_pre_hook(first_hook)

    def hold(phase: str) -> None:
        if phase == "start":
            assert entered.wait(60)
        elif phase == "done":
            order.append("copy done")

    PROCESS.seams.copy = hold
    h = mgr.save(state, 2, blocking=False, overlap=True)
    assert not h.staged()  # returned before the copy (held until the step begins)
    _train(model, opt)  # forward and backward beside the copy; the step waits for it
    order.append("step done")
    mgr.wait()
    assert order == ["step entered", "copy done", "step done"]
    for step, want in ((1, first), (2, second)):
        full = shardpoint.load_full(tmp_path / f"step-{step:08d}")
        assert all(torch.equal(full["model"][k], v) for k, v in want.items()), step


def test_a_cuda_tensor_changed_during_the_copy_fails_the_save(tmp_path) -> None:  # type: ignore[no-untyped-def]
    w = torch.ones(1 << 20, device="cuda")
    shardpoint.save({"w": w}, tmp_path / "c")
    release = threading.Event()
    PROCESS.seams.copy = lambda phase: release.wait(60) if phase == "start" else None
    h = shardpoint.save({"w": w}, tmp_path / "c", blocking=False, overlap=True, overwrite=True)
    w.mul_(3)  # a kernel launched from this thread: its version bump is seen
    release.set()
    with pytest.raises(shardpoint.ShardpointError, match="'w' was modified"):
        h.wait()
    assert torch.equal(shardpoint.load_full(tmp_path / "c")["w"], torch.ones(1 << 20))


def test_rng_of_the_own_device_only(tmp_path) -> None:  # type: ignore[no-untyped-def]
    torch.cuda.manual_seed(7)
    torch.rand(1, device="cuda")  # CUDA initialised
    streams = _rng.current_streams()
    assert len(streams["cuda"]) == 1  # this device's generator, not every visible one
    ts = shardpoint.TrainState(rng=True)
    shardpoint.save(ts, tmp_path / "c")
    a = torch.rand(4, device="cuda")
    report = shardpoint.load(ts, tmp_path / "c")
    assert report.per_rank["rng/streams"] == "restored"
    assert torch.equal(torch.rand(4, device="cuda"), a)
    old = dict(streams, cuda=streams["cuda"] * 8)  # as older versions saved: every device, here more than exist
    _rng.set_streams(old)


def test_a_cpu_checkpoint_restores_where_cuda_is_in_use(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Saved without a CUDA stream (a CPU run), loaded strictly where CUDA is initialised."""
    streams = _rng.current_streams()
    streams.pop("cuda", None)
    shardpoint.save({"rng": {"base_seed": 0, "streams": shardpoint.PerRank(streams)}}, tmp_path / "c")
    torch.rand(1, device="cuda")
    report = shardpoint.load(shardpoint.TrainState(rng=True), tmp_path / "c")
    assert report.per_rank["rng/streams"] == "restored"


# -- one rank, NCCL ------------------------------------------------------------------------------


def _nccl_world1(rank: int, world: int, path: str) -> list[str]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor

    assert dist.get_backend() == "nccl"
    mesh = init_device_mesh("cuda", (1,))
    model = _model()
    for m in model:
        if isinstance(m, torch.nn.Linear):
            fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, opt)  # FSDP2 forward and backward over NCCL
    dt = distribute_tensor(torch.arange(64.0, device="cuda").reshape(8, 8), mesh, [Shard(0)])
    torch.cuda.manual_seed(11)
    state = shardpoint.TrainState(model, opt, rng=True, dt=dt)
    mgr = shardpoint.CheckpointManager(path)
    mgr.save(state, 1)
    mgr.save(state, 2, blocking=False)
    mgr.wait()
    want = {k: v.full_tensor().cpu() for k, v in model.state_dict().items()}
    mgr.save(state, 3, blocking=False, overlap=True)
    _train(model, opt)  # the step waits for the copy
    mgr.wait()
    a = torch.rand(4, device="cuda")
    fresh = _model(seed=3)
    for m in fresh:
        if isinstance(m, torch.nn.Linear):
            fully_shard(m, mesh=mesh)
    fully_shard(fresh, mesh=mesh)
    opt2 = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    dt2 = distribute_tensor(torch.zeros(8, 8, device="cuda"), mesh, [Shard(0)])
    report = mgr.restore(shardpoint.TrainState(fresh, opt2, rng=True, dt=dt2))
    assert report.step == 3
    assert torch.equal(torch.rand(4, device="cuda"), a)
    for k, v in fresh.state_dict().items():
        assert torch.equal(v.full_tensor().cpu(), want[k]), k
    assert torch.equal(dt2.full_tensor().cpu(), torch.arange(64.0).reshape(8, 8))
    for p in fresh.parameters():
        assert opt2.state[p]["exp_avg"].device.type == "cuda"
    _train(fresh, opt2)
    return sorted(report.created)


def test_nccl_world_of_one(tmp_path) -> None:  # type: ignore[no-untyped-def]
    created = run_ranks(_nccl_world1, 1, str(tmp_path), timeout=300, env=NCCL)[0]
    assert "optimizer/state/0.weight/exp_avg" in created


# -- two ranks on one GPU, gloo default group, CUDA tensors --------------------------------------


def _fsdp(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cuda", (2,))
    model = _model(seed)
    for m in model:
        if isinstance(m, torch.nn.Linear):
            fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _locals(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    out = {f"model/{k}": v.to_local().cpu().clone() for k, v in model.state_dict().items()}
    for name, p in model.named_parameters():
        out[f"exp_avg/{name}"] = opt.state[p]["exp_avg"].to_local().cpu().clone()
    return out


def _fsdp_two(rank: int, world: int, path: str, cpu_ckpt: str) -> dict[str, Any]:
    model, opt = _fsdp(0)
    for p in model.parameters():  # no forward over gloo: a gradient by hand, then a real step
        p.grad = torch.ones_like(p)
    opt.step()
    shardpoint.save(shardpoint.TrainState(model, opt, rng=False), path)
    saved = _locals(model, opt)
    # CPU -> GPU: a checkpoint saved by one CPU process, into a never-stepped FSDP2 optimizer on the GPU
    fresh, opt2 = _fsdp(4)
    report = shardpoint.load(shardpoint.TrainState(fresh, opt2, rng=False), cpu_ckpt)
    assert "optimizer/state/0.weight/exp_avg" in report.created
    assert all(opt2.state[p]["exp_avg"].to_local().is_cuda for p in fresh.parameters())
    return {"saved": saved, "from_cpu": _locals(fresh, opt2)}


def test_fsdp2_on_a_cuda_mesh_reshards_gpu_to_cpu_and_back(tmp_path) -> None:  # type: ignore[no-untyped-def]
    cpu_model = _model(0, device="cpu")
    cpu_opt = torch.optim.AdamW(cpu_model.parameters(), lr=1e-2)
    _train(cpu_model, cpu_opt, steps=2)
    shardpoint.save(shardpoint.TrainState(cpu_model, cpu_opt, rng=False), tmp_path / "cpu")
    out = run_ranks(_fsdp_two, 2, str(tmp_path / "gpu"), str(tmp_path / "cpu"), timeout=300, env=GLOO_CUDA)
    # GPU -> CPU: the FSDP2 shards of two GPU ranks, loaded whole by one CPU process
    full = shardpoint.load_full(tmp_path / "gpu")
    for name in ("0.weight", "0.bias", "2.weight", "2.bias"):
        whole = torch.cat([o["saved"][f"model/{name}"] for o in out])
        assert torch.equal(full["model"][name], whole), name
        assert torch.equal(full["optimizer"]["state"][name]["exp_avg"], torch.cat([o["saved"][f"exp_avg/{name}"] for o in out]))
        # CPU -> GPU: each rank holds its half of the CPU checkpoint
        got = torch.cat([o["from_cpu"][f"model/{name}"] for o in out])
        assert torch.equal(got, dict(cpu_model.named_parameters())[name].detach()), name
        p = dict(cpu_model.named_parameters())[name]
        assert torch.equal(torch.cat([o["from_cpu"][f"exp_avg/{name}"] for o in out]), cpu_opt.state[p]["exp_avg"])
    cpu_fresh = _model(9, device="cpu")
    opt3 = torch.optim.AdamW(cpu_fresh.parameters(), lr=1e-2)
    shardpoint.load(shardpoint.TrainState(cpu_fresh, opt3, rng=False), tmp_path / "gpu")
    assert all(s["exp_avg"].device.type == "cpu" for s in opt3.state.values())
    _train(cpu_fresh, opt3)


def _replicas(rank: int, world: int, path: str) -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    model = torch.nn.Linear(256, 256).cuda()
    with torch.no_grad():
        for p in model.parameters():  # the same on both ranks, as DDP keeps them
            p.copy_(torch.randn(p.shape, generator=g))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    torch.cuda.manual_seed(100 + rank)
    state = shardpoint.TrainState(model, opt, rng=True, mine=shardpoint.PerRank(torch.full((3,), float(rank), device="cuda")))
    mgr = shardpoint.CheckpointManager(path)
    mgr.save(state, 1, blocking=False)
    mgr.wait()
    staged = asyncsave.staging_nbytes()
    PROCESS.seams.counters.reset()
    mgr.save(state, 2)  # blocking: through the pinned pool; replicas the other rank writes are checksummed through it
    pooled = PROCESS.seams.counters.host_allocated
    at_call = {k: v.cpu().clone() for k, v in model.state_dict().items()}
    release = threading.Event()
    PROCESS.seams.copy = lambda phase: release.wait(60) if phase == "start" else None
    h = mgr.save(state, 3, blocking=False, overlap=True)
    staged_early = h.staged()
    release.set()
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    mgr.wait()
    a = torch.rand(4, device="cuda")
    report = mgr.restore(state, step=3)
    assert report.per_rank["rng/streams"] == "restored"
    b = torch.rand(4, device="cuda")
    return {"staged": staged, "pooled": pooled, "at_call": at_call, "a": a.cpu(), "b": b.cpu(),
            "staged_early": staged_early, "state_bytes": sum(v.numel() * v.element_size() for v in model.state_dict().values())}


def test_ddp_like_replicas_on_two_ranks(tmp_path) -> None:  # type: ignore[no-untyped-def]
    out = run_ranks(_replicas, 2, str(tmp_path), timeout=300, env=GLOO_CUDA)
    params = out[0]["state_bytes"]
    for o in out:
        assert torch.equal(o["a"], o["b"])  # each rank's own CUDA stream restored
        assert not o["staged_early"]
        # parameters + 2 moments replicated on both: each rank stages about half
        assert o["staged"] < 0.75 * 3 * params
        assert o["pooled"] <= _stage.SLOTS * _stage.SLOT_BYTES
    assert not torch.equal(out[0]["a"], out[1]["a"])
    full = shardpoint.load_full(tmp_path / "step-00000003")
    assert all(torch.equal(full["model"][k], v) for k, v in out[0]["at_call"].items())
    assert torch.equal(full["extra"]["mine"][1], torch.ones(3))
