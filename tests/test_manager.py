"""CheckpointManager and TrainState in one process: discovery, retention,
rollback, selective restore, dtype casts, key maps, scheduler and GradScaler."""

from __future__ import annotations

import os

import pytest
import torch

import shardpoint
from shardpoint.errors import KeyMismatchError
from shardpoint.runtime import PROCESS


def filled(value: float) -> torch.nn.Linear:
    m = torch.nn.Linear(4, 3)
    with torch.no_grad():
        for p in m.parameters():
            p.fill_(value)
    return m


def test_empty_root_restores_nothing(tmp_path) -> None:  # type: ignore[no-untyped-def]
    mgr = shardpoint.CheckpointManager(tmp_path / "none")
    m = filled(1.0)
    assert mgr.restore(shardpoint.TrainState(model=m)) is None
    assert not mgr.has_checkpoint() and mgr.latest() is None and mgr.list() == []
    assert torch.all(m.weight == 1.0)


def _save_step(mgr: shardpoint.CheckpointManager, step: int, fail: bool = False) -> None:
    state = shardpoint.TrainState(model=filled(float(step)), rng=False, step=step)
    if not fail:
        mgr.save(state, step)
        return

    def boom(phase: str) -> None:
        if phase == "written":
            raise OSError("injected failure after the data was written")

    PROCESS.seams.phase = boom
    try:
        with pytest.raises(shardpoint.ShardpointError, match="injected"):
            mgr.save(state, step)
    finally:
        PROCESS.seams.phase = None


def test_retention_keep_last_with_a_failed_save(tmp_path) -> None:  # type: ignore[no-untyped-def]
    mgr = shardpoint.CheckpointManager(tmp_path, keep_last=2)
    for step in (1, 2, 3):
        _save_step(mgr, step)
    _save_step(mgr, 4, fail=True)
    assert mgr.latest().step == 3, "a failed save must not move latest"
    for step in (5, 6, 7):
        _save_step(mgr, step)
    assert [i.step for i in mgr.list()] == [6, 7]
    assert sorted(os.listdir(tmp_path)) == ["latest", "owners", "step-00000006", "step-00000007"], "leftovers must be cleared"


def test_retention_keep_every(tmp_path) -> None:  # type: ignore[no-untyped-def]
    mgr = shardpoint.CheckpointManager(tmp_path, keep_last=1, keep_every=3)
    for step in range(1, 8):
        _save_step(mgr, step)
    assert [i.step for i in mgr.list()] == [3, 6, 7]


def test_retention_never_deletes_the_restored_checkpoint(tmp_path) -> None:  # type: ignore[no-untyped-def]
    mgr = shardpoint.CheckpointManager(tmp_path, keep_last=1)
    _save_step(mgr, 1)
    _save_step(mgr, 2)
    mgr.restore(shardpoint.TrainState(model=filled(0.0), rng=False, step=0), step=2)
    _save_step(mgr, 3)
    _save_step(mgr, 4)
    assert [i.step for i in mgr.list()] == [2, 4]


def test_latest_follows_a_rollback(tmp_path) -> None:  # type: ignore[no-untyped-def]
    mgr = shardpoint.CheckpointManager(tmp_path)
    _save_step(mgr, 500)
    # the run was rolled back and resumed from an earlier point: a new attempt (a new manager
    # claims the root anew; latest never moves back within one attempt)
    mgr = shardpoint.CheckpointManager(tmp_path)
    _save_step(mgr, 200)
    assert mgr.latest().step == 200
    m = filled(0.0)
    assert mgr.restore(shardpoint.TrainState(model=m, rng=False, step=0)).step == 200
    assert torch.all(m.weight == 200)
    # latest naming a checkpoint that is not committed falls back to the highest committed step
    (tmp_path / "latest").write_text("step-00000999")
    assert mgr.latest().step == 500


def test_latest_ignores_uncommitted_folders(tmp_path) -> None:  # type: ignore[no-untyped-def]
    mgr = shardpoint.CheckpointManager(tmp_path)
    _save_step(mgr, 1)
    (tmp_path / "step-00000009").mkdir()
    (tmp_path / "step-00000009" / "r00000-x.safetensors").write_bytes(b"partial")
    assert mgr.latest().step == 1 and [i.step for i in mgr.list()] == [1]
    with pytest.raises(shardpoint.CheckpointNotFoundError):
        mgr.restore(shardpoint.TrainState(model=filled(0.0), rng=False), step=9)


def _flip(path, byte: int) -> None:  # type: ignore[no-untyped-def]
    raw = bytearray(path.read_bytes())
    raw[byte] ^= 0x04
    path.write_bytes(bytes(raw))


def _restored_step(mgr: shardpoint.CheckpointManager, **kw) -> int:  # type: ignore[no-untyped-def]
    m = filled(0.0)
    report = mgr.restore(shardpoint.TrainState(model=m, rng=False, step=0), **kw)
    assert torch.all(m.weight == report.step)
    return report.step


def test_latest_is_sealed_and_a_legacy_latest_is_still_read(tmp_path) -> None:  # type: ignore[no-untyped-def]
    mgr = shardpoint.CheckpointManager(tmp_path)
    _save_step(mgr, 1)
    _save_step(mgr, 2)
    raw = (tmp_path / "latest").read_bytes()
    assert raw.startswith(b'{"seal":"sha256:') and b'"latest":"step-00000002"' in raw
    for legacy in (b"step-00000001", b"step-00000001\n"):  # as written before pointers were sealed
        (tmp_path / "latest").write_bytes(legacy)
        assert mgr.latest().step == 1 and _restored_step(mgr) == 1
    (tmp_path / "latest").write_bytes(b"step-00000001 junk")
    with pytest.raises(shardpoint.CorruptCheckpointError, match="latest: not a checkpoint pointer"):
        mgr.latest()


def test_damaged_latest_is_an_error_unless_fallback(tmp_path) -> None:  # type: ignore[no-untyped-def]
    mgr = shardpoint.CheckpointManager(tmp_path)
    for step in (1, 2, 3):
        _save_step(mgr, step)
    (tmp_path / "latest").write_bytes(b'{"seal":"sha256:' + b"0" * 64 + b'","latest":"step-00000002"}')
    for call in (mgr.latest, lambda: _restored_step(mgr)):
        with pytest.raises(shardpoint.CorruptCheckpointError, match=r"latest: checksum mismatch.*fallback=True"):
            call()
    assert mgr.has_checkpoint() and [i.step for i in mgr.list()] == [1, 2, 3]
    with pytest.warns(UserWarning, match="falling back to step 3"):
        assert _restored_step(mgr, fallback=True) == 3  # latest is unreadable: the newest sound step
    _save_step(mgr, 4)  # a save writes a sound pointer again
    assert mgr.latest().step == 4


def test_damaged_newest_manifest_is_an_error_unless_fallback(tmp_path) -> None:  # type: ignore[no-untyped-def]
    for step in (100, 500, 200):  # rolled back to 100 (a new attempt), then saved 200: latest names 200
        mgr = shardpoint.CheckpointManager(tmp_path)
        _save_step(mgr, step)
    _flip(tmp_path / "step-00000200" / "manifest.json", 300)
    with pytest.raises(shardpoint.CorruptCheckpointError, match=r"step 200 is damaged: .*step-00000200/manifest.json"):
        mgr.latest()
    with pytest.raises(shardpoint.CorruptCheckpointError, match="step-00000200/manifest.json: checksum mismatch"):
        _restored_step(mgr)
    infos = mgr.list()
    assert [(i.step, i.damaged is not None) for i in infos] == [(100, False), (200, True), (500, False)]
    assert "checksum mismatch" in infos[1].damaged and infos[1].size == 0
    with pytest.raises(shardpoint.CorruptCheckpointError, match="step 200 is damaged"):
        _restored_step(mgr, step=200)
    with pytest.warns(UserWarning, match="falling back to step 100"):
        assert _restored_step(mgr, fallback=True) == 100  # the step before 200, not the abandoned 500
    assert _restored_step(mgr, step=500) == 500
    # without latest, the highest step is the one to resume from
    (tmp_path / "latest").unlink()
    _flip(tmp_path / "step-00000500" / "manifest.json", 300)
    with pytest.raises(shardpoint.CorruptCheckpointError, match="step 500 is damaged"):
        _restored_step(mgr)
    with pytest.warns(UserWarning, match="falling back to step 100"):
        assert _restored_step(mgr, fallback=True) == 100
    _flip(tmp_path / "step-00000100" / "manifest.json", 300)
    with pytest.raises(shardpoint.CorruptCheckpointError, match="no sound checkpoint to fall back to"):
        _restored_step(mgr, fallback=True)


def _trained():  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, betas=(0.8, 0.9), weight_decay=0.05)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=7)
    for _ in range(3):
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    scaler.update(1.0) if False else None
    return model, opt, sched, scaler


def _fresh():  # type: ignore[no-untyped-def]
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.5)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    scaler = torch.amp.GradScaler("cpu")
    return model, opt, sched, scaler


def test_scheduler_scaler_and_hyperparameters_round_trip(tmp_path) -> None:  # type: ignore[no-untyped-def]
    model, opt, sched, scaler = _trained()
    shardpoint.save(shardpoint.TrainState(model, opt, sched, scaler, best=0.25), tmp_path / "c")
    m2, o2, s2, g2 = _fresh()
    st = shardpoint.TrainState(m2, o2, s2, g2, best=None)
    shardpoint.load(st, tmp_path / "c")
    assert st.model is m2 and st.optimizer is o2 and st.scheduler is s2 and st.grad_scaler is g2
    assert s2.state_dict() == sched.state_dict()
    assert g2.state_dict() == scaler.state_dict() and g2.get_scale() == 1024.0
    hp = {k: v for k, v in o2.param_groups[0].items() if k != "params"}
    assert hp == {k: v for k, v in opt.param_groups[0].items() if k != "params"}
    assert st.extra["best"] == 0.25


def test_selective_restore(tmp_path) -> None:  # type: ignore[no-untyped-def]
    model, opt, sched, _ = _trained()
    mgr = shardpoint.CheckpointManager(tmp_path)
    mgr.save(shardpoint.TrainState(model, opt, sched, step=3), 3)

    # model only, into a model with a new head: strict=False reports the head as missing
    torch.manual_seed(5)
    new = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2), torch.nn.Linear(2, 7))
    head = new[2].weight.clone()
    o_new = torch.optim.AdamW(new.parameters(), lr=0.5)
    r = mgr.restore(shardpoint.TrainState(new, o_new, step=0), only=["model"], strict=False)
    assert r.missing == ["model/2.bias", "model/2.weight"]
    assert torch.equal(new[0].weight, model[0].weight) and torch.equal(new[2].weight, head)
    assert not o_new.state and o_new.param_groups[0]["lr"] == 0.5
    assert all(k.startswith(("optimizer/", "scheduler/", "rng/", "extra/")) for k in r.skipped)
    with pytest.raises(KeyMismatchError, match="model/2.weight"):
        mgr.restore(shardpoint.TrainState(new, step=0), only=["model"])

    # everything but optimizer and scheduler
    m2, o2, s2, _ = _fresh()
    st = shardpoint.TrainState(m2, o2, s2, step=0)
    r = mgr.restore(st, exclude=["optimizer", "scheduler"])
    assert torch.equal(m2[1].weight, model[1].weight) and not o2.state and s2.last_epoch == 0
    assert st.extra["step"] == 3 and not any(k.startswith("optimizer/") for k in r.loaded)

    # everything but the model
    m3, o3, s3, _ = _fresh()
    before = m3[0].weight.clone()
    r = mgr.restore(shardpoint.TrainState(m3, o3, s3, step=0), exclude=["model"])
    assert torch.equal(m3[0].weight, before) and s3.last_epoch == 3
    for p, p3 in zip(model.parameters(), m3.parameters()):
        assert torch.equal(opt.state[p]["exp_avg"], o3.state[p3]["exp_avg"])
    assert all(k.startswith("model/") for k in r.skipped if not k.startswith("rng"))


def test_dtype_cast_is_reported(tmp_path) -> None:  # type: ignore[no-untyped-def]
    model, *_ = _trained()
    shardpoint.save(shardpoint.TrainState(model, rng=False), tmp_path / "c")
    half = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)).to(torch.bfloat16)
    r = shardpoint.load(shardpoint.TrainState(half, rng=False), tmp_path / "c")
    assert r.cast == ["model/0.bias", "model/0.weight", "model/1.bias", "model/1.weight"]
    assert torch.equal(half[0].weight, model[0].weight.to(torch.bfloat16))


def test_key_map_loads_renamed_modules(tmp_path) -> None:  # type: ignore[no-untyped-def]
    model, opt, *_ = _trained()
    shardpoint.save(shardpoint.TrainState(model, opt, rng=False), tmp_path / "c")

    class Renamed(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.encoder = torch.nn.Linear(4, 4)
            self.head = torch.nn.Linear(4, 2)

    for key_map in ({"0.weight": "encoder.weight", "0.bias": "encoder.bias", "1.weight": "head.weight", "1.bias": "head.bias"},
                    lambda k: k.replace("0.", "encoder.").replace("1.", "head.")):
        new = Renamed()
        o_new = torch.optim.AdamW(new.parameters(), lr=0.5)
        r = shardpoint.load(shardpoint.TrainState(new, o_new, rng=False, key_map=key_map), tmp_path / "c")
        assert not r.missing
        assert torch.equal(new.encoder.weight, model[0].weight) and torch.equal(new.head.bias, model[1].bias)
        assert torch.equal(o_new.state[new.head.weight]["exp_avg"], opt.state[model[1].weight]["exp_avg"])


def test_param_groups_that_do_not_match_raise(tmp_path) -> None:  # type: ignore[no-untyped-def]
    model, opt, *_ = _trained()
    shardpoint.save(shardpoint.TrainState(model, opt, rng=False), tmp_path / "c")
    m2, *_ = _fresh()
    o2 = torch.optim.AdamW([{"params": m2[0].parameters()}, {"params": m2[1].parameters(), "lr": 1.0}])
    with pytest.raises(KeyMismatchError, match="param_groups"):
        shardpoint.load(shardpoint.TrainState(m2, o2, rng=False), tmp_path / "c")


def test_latest_never_moves_back_within_an_attempt(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """One attempt that saves a lower step after a higher one (without restoring in
    between) leaves latest on the higher one, and says so; a restore (a new attempt,
    the way to go back) moves it."""
    mgr = shardpoint.CheckpointManager(tmp_path)
    _save_step(mgr, 500)
    with pytest.warns(UserWarning, match=r"latest stays at step-00000500"):
        _save_step(mgr, 200)
    assert mgr.latest().step == 500
    assert _restored_step(mgr, step=200) == 200  # a restore claims the root anew
    _save_step(mgr, 201)
    assert mgr.latest().step == 201


def test_retention_leaves_an_older_attempts_newer_step_alone(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """An older attempt committed step 6 but never pointed latest at it (frozen between
    the two, then gone); the newer attempt resumes from 4 and saves 5: retention counts
    and deletes steps up to 5 only, so 6 stays until the newer attempt saves 6 over it."""
    from shardpoint.format.pointer import LATEST, Pointer

    old = shardpoint.CheckpointManager(tmp_path, keep_last=2)
    for step in (2, 4, 6):
        _save_step(old, step)
    (tmp_path / LATEST).write_bytes(Pointer("step-00000004", old.generation).to_bytes())  # as if frozen before latest
    new = shardpoint.CheckpointManager(tmp_path, keep_last=1)
    assert _restored_step(new) == 4
    _save_step(new, 5)
    assert [i.step for i in new.list()] == [4, 5, 6]  # 4: restored from; 6: an older attempt's, above 5
    assert new.latest().step == 5
    _save_step(new, 6)
    assert [i.step for i in new.list()] == [4, 6] and new.latest().step == 6
    with pytest.raises(shardpoint.errors.FencedError, match="generation 1.*generation 2"):
        _save_step(old, 8)
    assert [i.step for i in new.list()] == [4, 6]


@pytest.mark.parametrize("kw", [{"keep_last": "3"}, {"keep_last": 2.5}, {"keep_last": 0}, {"keep_every": True},
                                {"timeout": "10"}, {"timeout": -1}, {"timeout": 0}, {"save_every": 0}])
def test_bad_arguments_are_refused_at_construction(tmp_path, kw) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(shardpoint.errors.UsageError, match=next(iter(kw))):
        shardpoint.CheckpointManager(tmp_path, **kw)
    with pytest.raises(shardpoint.errors.UsageError, match="root must be a directory path or a URL"):
        shardpoint.CheckpointManager(5)  # type: ignore[arg-type]


@pytest.mark.parametrize("step", [1.5, -1, True, "3"])
def test_a_bad_step_is_refused_naming_it(tmp_path, step) -> None:  # type: ignore[no-untyped-def]
    mgr = shardpoint.CheckpointManager(tmp_path)
    with pytest.raises(shardpoint.errors.UsageError, match=r"step must be a whole number >= 0 \(got " + repr(step)):
        mgr.save(shardpoint.TrainState(model=filled(1.0), rng=False), step)
    assert not any(tmp_path.iterdir()), "a refused save leaves nothing behind"


def test_the_conveniences_people_look_for(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """all_steps, latest_step, should_save, delete, and the manager as a context manager."""
    with shardpoint.CheckpointManager(tmp_path, save_every=10) as mgr:
        assert mgr.all_steps() == [] and mgr.latest_step() is None
        assert [s for s in range(0, 35) if mgr.should_save(s)] == [0, 10, 20, 30]
        for step in (10, 20, 30):
            _save_step(mgr, step)
        assert mgr.all_steps() == [10, 20, 30] and mgr.latest_step() == 30
        mgr.delete(20)
        assert mgr.all_steps() == [10, 30] and not (tmp_path / "step-00000020").exists()
        with pytest.raises(shardpoint.CheckpointNotFoundError, match="committed steps: \\[10, 30\\]"):
            mgr.delete(20)
        with pytest.raises(shardpoint.errors.UsageError, match="the resume point"):
            mgr.delete(30)
        mgr._preempt.set()  # a preemption signal arrived: every step is due
        assert mgr.should_save(31)
    assert shardpoint.CheckpointManager(tmp_path).latest_step() == 30


def test_delete_keeps_what_later_checkpoints_refer_to(tmp_path) -> None:  # type: ignore[no-untyped-def]
    mgr = shardpoint.CheckpointManager(tmp_path, incremental=True)
    frozen = torch.arange(1000.0)
    for step in (1, 2):
        mgr.save({"frozen": frozen, "step": step}, step)
    mgr.delete(1)
    assert mgr.all_steps() == [2]
    full = shardpoint.load_full(tmp_path / "step-00000002")
    assert torch.equal(full["frozen"], frozen) and full["step"] == 2


def test_a_metric_that_is_not_a_number_is_refused_before_anything_is_written(tmp_path) -> None:  # type: ignore[no-untyped-def]
    mgr = shardpoint.CheckpointManager(tmp_path)
    with pytest.raises(shardpoint.errors.UsageError, match=r"metrics\['loss'\] = 'abc'"):
        mgr.save(shardpoint.TrainState(model=filled(1.0), rng=False), 1, metrics={"loss": "abc"})
    assert not any(tmp_path.iterdir())


def test_keep_best_keeps_the_best_steps_by_a_metric(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """keep_last=1 with keep_best=("loss", 2): the newest step and the two lowest
    losses stay; a step without the metric or with a NaN is never among the best."""
    losses = {1: 5.0, 2: 1.0, 3: float("nan"), 4: 3.0, 5: 0.5, 6: 9.0, 7: None}
    mgr = shardpoint.CheckpointManager(tmp_path, keep_last=1, keep_best=("loss", 2))
    for step, loss in losses.items():
        mgr.save(shardpoint.TrainState(model=filled(float(step)), rng=False), step,
                 metrics=None if loss is None else {"loss": loss})
    assert mgr.all_steps() == [2, 5, 7]
    top = shardpoint.CheckpointManager(tmp_path / "acc", keep_last=1, keep_best=["acc", 1, "max"])
    for step, acc in enumerate([0.2, 0.9, 0.5, 0.4]):
        top.save(shardpoint.TrainState(model=filled(float(step)), rng=False), step, metrics={"acc": acc})
    assert top.all_steps() == [1, 3]
    for bad in [("loss",), ("loss", 0), ("loss", 2, "median"), "loss"]:
        with pytest.raises(shardpoint.errors.UsageError, match="keep_best="):
            shardpoint.CheckpointManager(tmp_path, keep_best=bad)  # type: ignore[arg-type]
