"""Staging (issue 16) on the CPU: the overlapped async mode (returns before the copy,
optimizers wait for it, a tensor changed during it fails the save and commits
nothing), the blocking save's fixed pool, staging by need on 4 ranks, and optimizer
state created by the optimizer's own rules."""

from __future__ import annotations

import glob
import threading

import pytest
import torch

import shardpoint
from shardpoint.runtime import PROCESS
from shardpoint.saving import buffers as _stage
from shardpoint.saving import handle as asyncsave
from tests._dist import run_ranks


@pytest.fixture(autouse=True)
def _reset():  # type: ignore[no-untyped-def]
    yield
    PROCESS.seams.copy = None
    PROCESS.seams.phase = None


def _hold_copy() -> tuple[threading.Event, threading.Event]:
    """Hold the overlapped copy at its start until ``release`` is set."""
    started, release = threading.Event(), threading.Event()

    def hook(phase: str) -> None:
        if phase == "start":
            started.set()
            assert release.wait(60), "the test never released the copy"

    PROCESS.seams.copy = hook
    return started, release


# -- the overlapped mode -------------------------------------------------------------------------


def test_overlapped_save_returns_before_the_copy(tmp_path) -> None:  # type: ignore[no-untyped-def]
    started, release = _hold_copy()
    w = torch.arange(1000, dtype=torch.float32)
    h = shardpoint.save({"w": w, "step": 3}, tmp_path / "c", blocking=False, overlap=True)
    assert started.wait(60)
    assert not h.staged() and not h.done()  # save returned; the copy has not even begun
    y = (w * 2).sum()  # the next forward runs beside the copy (reads, never writes, saved state)
    release.set()
    h.wait()
    assert h.staged() and float(y) == 999000.0
    full = shardpoint.load_full(tmp_path / "c")
    assert torch.equal(full["w"], torch.arange(1000, dtype=torch.float32)) and full["step"] == 3


def test_overlap_needs_blocking_false(tmp_path) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match="blocking=False"):
        shardpoint.save({"w": torch.ones(2)}, tmp_path / "c", overlap=True)


def test_optimizer_step_waits_for_the_copy(tmp_path) -> None:  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 8)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(4, 16)).sum().backward()
    opt.step()
    at_call = {k: v.clone() for k, v in model.state_dict().items()}
    moments = opt.state[model.weight]["exp_avg"].clone()
    order: list[str] = []
    entered = threading.Event()
    # registered before the save's own hook, so it runs first: the step has begun
    def first(*_: object) -> None:
        order.append("step entered")
        entered.set()

    opt.register_step_pre_hook(first)
    opt.register_step_post_hook(lambda *_: order.append("step done") and None)

    def hook(phase: str) -> None:
        if phase == "start":  # the copy begins only once the step has begun: the step must wait for it
            assert entered.wait(60)
        elif phase == "done":
            order.append("copy done")

    PROCESS.seams.copy = hook
    h = shardpoint.save(shardpoint.TrainState(model, opt, rng=False), tmp_path / "c", blocking=False, overlap=True)
    model(torch.randn(4, 16)).sum().backward()  # forward and backward beside the copy
    opt.step()  # waits for the copy, then changes the parameters and moments
    h.wait()
    assert order == ["step entered", "copy done", "step done"]
    assert len(opt._optimizer_step_pre_hooks) == 1  # the save's hook is gone after wait()
    full = shardpoint.load_full(tmp_path / "c")
    assert torch.equal(full["model"]["weight"], at_call["weight"])
    assert not torch.equal(model.weight.detach(), at_call["weight"])
    assert torch.equal(full["optimizer"]["state"]["weight"]["exp_avg"], moments)


def test_a_tensor_changed_during_the_copy_fails_the_save_and_commits_nothing(tmp_path) -> None:  # type: ignore[no-untyped-def]
    w, b = torch.ones(100), torch.zeros(10)
    state = shardpoint.TrainState(rng=False, w=w, b=b)
    mgr = shardpoint.CheckpointManager(tmp_path)
    mgr.save(state, 1)
    _, release = _hold_copy()
    mgr.save(state, 2, blocking=False, overlap=True)
    b.add_(1)  # not an optimizer step: nothing waits for the copy
    release.set()
    with pytest.raises(shardpoint.errors.SaveAbortedError, match="'extra/b' was modified while the overlapped save") as e:
        mgr.wait()
    assert "extra/w" not in str(e.value)
    assert not (tmp_path / "step-00000002" / "manifest.json").exists()
    assert mgr.latest().step == 1 and [i.step for i in mgr.list()] == [1]
    again = shardpoint.TrainState(rng=False, w=torch.zeros(100), b=torch.ones(10))
    assert mgr.restore(again).step == 1
    assert torch.equal(again.extra["w"], torch.ones(100)) and torch.equal(again.extra["b"], torch.zeros(10))


def test_a_failed_overlapped_overwrite_keeps_the_old_checkpoint(tmp_path) -> None:  # type: ignore[no-untyped-def]
    w = torch.ones(1000)
    shardpoint.save({"w": w}, tmp_path / "c")
    _, release = _hold_copy()
    h = shardpoint.save({"w": w}, tmp_path / "c", blocking=False, overlap=True, overwrite=True)
    w.mul_(3)
    release.set()
    with pytest.raises(shardpoint.ShardpointError, match="'w' was modified"):
        h.wait()
    assert torch.equal(shardpoint.load_full(tmp_path / "c")["w"], torch.ones(1000))
    shardpoint.save({"w": w}, tmp_path / "c", blocking=False, overlap=True, overwrite=True).wait()  # and saving works again
    assert torch.equal(shardpoint.load_full(tmp_path / "c")["w"], torch.full((1000,), 3.0))


# -- the blocking save's pool ---------------------------------------------------------------------


def test_blocking_save_through_the_pool_is_bounded_and_byte_identical(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The path device tensors take (forced for CPU ones): host staging is the fixed
    pool, reused, whatever the state's size; the files are the same bytes."""
    torch.manual_seed(0)
    state = {"a": torch.randn(1024, 1024), "b": torch.randn(300, 70).t(), "c": torch.arange(10), "e": torch.empty(0),
             "h": torch.randn(1000).to(torch.bfloat16)}
    total = sum(t.numel() * t.element_size() for t in state.values())
    shardpoint.save(state, tmp_path / "direct")
    slot = 384 << 10  # not a divisor of the 1 MiB CRC block: checksums chain across pieces
    monkeypatch.setattr(PROCESS.seams, "force_pool", True)
    monkeypatch.setattr(PROCESS, "pool", _stage.Pool(slot_bytes=slot, slots=3))
    PROCESS.seams.counters.reset()
    shardpoint.save(state, tmp_path / "pool")
    assert PROCESS.seams.counters.pooled == total
    assert PROCESS.seams.counters.host_allocated == 3 * slot < total / 3
    shardpoint.save(state, tmp_path / "pool2")
    assert PROCESS.seams.counters.host_allocated == 3 * slot  # reused, not grown
    files = [sorted(glob.glob(str(tmp_path / d / "*.safetensors"))) for d in ("direct", "pool")]
    assert [open(f, "rb").read() for f in files[0]] == [open(f, "rb").read() for f in files[1]]
    full = shardpoint.load_full(tmp_path / "pool")  # CRCs verified
    assert all(torch.equal(full[k], v) for k, v in state.items())


# -- staging by need on 4 ranks -------------------------------------------------------------------


def _by_need(rank: int, world: int, path: str) -> tuple[int, int, int]:
    torch.manual_seed(0)
    state = {f"w{i}": torch.randn(64, 256) for i in range(16)}  # 1 MiB replicated on every rank (DDP-like)
    shardpoint.save(state, path + "/async", blocking=False).wait()
    staged = asyncsave.staging_nbytes()
    PROCESS.seams.force_pool = True  # the device path: replicas another rank writes are checksummed through the pool
    PROCESS.seams.counters.reset()
    shardpoint.save(state, path + "/pool")
    return staged, PROCESS.seams.counters.host_allocated, sum(t.numel() * t.element_size() for t in state.values())


@pytest.mark.distributed
def test_each_rank_stages_only_what_it_writes(tmp_path) -> None:  # type: ignore[no-untyped-def]
    out = run_ranks(_by_need, 4, str(tmp_path), timeout=120)
    total = out[0][2]
    for staged, pooled_host, _ in out:
        assert total / 4 <= staged <= total / 4 + 16 * 64  # a quarter (plus alignment), not the whole state
        # the blocking save held only the pool's slots (one tensor's bytes each), never a whole host copy
        assert pooled_host == _stage.SLOTS * 64 * 256 * 4 <= total / 4
    torch.manual_seed(0)
    want = {f"w{i}": torch.randn(64, 256) for i in range(16)}
    for d in ("async", "pool"):
        full = shardpoint.load_full(tmp_path / d)
        assert all(torch.equal(full[k], v) for k, v in want.items())


# -- optimizer state created on load ------------------------------------------------------------


@pytest.mark.parametrize("fused", [False, True])
def test_never_stepped_optimizer_resumes_by_its_own_rules(tmp_path, fused: bool) -> None:  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, fused=fused)
    model(torch.randn(3, 8)).sum().backward()
    opt.step()
    shardpoint.save(shardpoint.TrainState(model, opt, rng=False), tmp_path / "c")
    fresh = torch.nn.Linear(8, 4)
    opt2 = torch.optim.AdamW(fresh.parameters(), lr=0.1, fused=fused)  # never stepped: no state yet
    report = shardpoint.load(shardpoint.TrainState(fresh, opt2, rng=False), tmp_path / "c")
    assert "optimizer/state/weight/exp_avg" in report.created
    for p, q in zip(model.parameters(), fresh.parameters()):
        for name, v in opt.state[p].items():
            got = opt2.state[q][name]
            assert got.device == v.device and got.dtype == v.dtype and torch.equal(got, v), name
    grads = torch.randn(3, 8)
    for m, o in ((model, opt), (fresh, opt2)):
        o.zero_grad()
        m(grads).sum().backward()
        o.step()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), fresh.parameters()))


def test_created_moments_take_the_parameters_dtype(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """As ``Optimizer.load_state_dict`` casts them: float32 moments saved, a bfloat16
    model resumed; ``step`` stays as saved (not fused, not capturable)."""
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(3, 8)).sum().backward()
    opt.step()
    shardpoint.save(shardpoint.TrainState(model, opt, rng=False), tmp_path / "c")
    half = torch.nn.Linear(8, 4).to(torch.bfloat16)
    opt2 = torch.optim.AdamW(half.parameters())
    shardpoint.load(shardpoint.TrainState(half, opt2, rng=False), tmp_path / "c")
    st = opt2.state[half.weight]
    assert st["exp_avg"].dtype == torch.bfloat16 and st["step"].dtype == torch.float32
    half(torch.randn(3, 8, dtype=torch.bfloat16)).sum().backward()
    opt2.step()
    assert float(st["step"]) == 2.0
