"""Verified recovery: a checkpoint records which of its tensors hold NaN or infinity
(found while the bytes are checksummed) and the caller's metrics; restore passes
over an unhealthy step, or one a metric predicate rejects, and says so; an explicit
step loads as asked; `shardpoint ls` marks them. Real gloo ranks, FSDP2 + AdamW."""

from __future__ import annotations

import contextlib
import io
import json
import math
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import shardpoint
from tests._dist import run_ranks
from tests.distributed.test_train_state import build

pytestmark = pytest.mark.distributed


def _train(rank: int, world: int, root: str, poison_at: int | None, losses: dict[int, float]) -> None:
    """Steps 1..8, a checkpoint every 2 steps with the step's loss; from ``poison_at``
    on, a weight holds NaN (and, through the step, the optimizer moments)."""
    m, opt, sched = build(0, world)
    mgr = shardpoint.CheckpointManager(root)
    state = shardpoint.TrainState(model=m, optimizer=opt, scheduler=sched)
    torch.manual_seed(rank)
    for i in range(1, 9):
        loss = m(torch.randn(4, 6)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        if i == poison_at:
            with torch.no_grad():
                m[0].weight.to_local()[0, 0] = math.nan
        if i % 2 == 0:
            mgr.save(state, i, metrics={"loss": losses.get(i, float(loss.detach()))})


def _restore(rank: int, world: int, root: str, accept_below: float | None) -> dict[str, Any]:
    m, opt, sched = build(1, world)
    mgr = shardpoint.CheckpointManager(root)
    state = shardpoint.TrainState(model=m, optimizer=opt, scheduler=sched)
    accept = None if accept_below is None else (lambda info: info.metrics["loss"] < accept_below)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = mgr.restore(state, accept=accept)
    out: dict[str, Any] = {"step": report.step if report else None, "passed_over": report.passed_over if report else None,
                           "warnings": [str(w.message) for w in caught if "not restoring" in str(w.message)],
                           "finite": all(bool(torch.isfinite(p.to_local()).all()) for p in m.parameters())}
    m2, opt2, sched2 = build(1, world)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        r8 = mgr.restore(shardpoint.TrainState(model=m2, optimizer=opt2, scheduler=sched2), step=8)
    out["explicit"] = r8.step if r8 else None
    out["explicit_finite"] = all(bool(torch.isfinite(p.to_local()).all()) for p in m2.parameters())
    out["explicit_warned"] = any("as asked" in str(w.message) for w in caught)
    return out


def _ls(root: Path) -> dict[int, dict[str, Any]]:
    from shardpoint.cli import main

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(["ls", str(root), "--json"]) == 0
    return {r["step"]: r for r in json.loads(buf.getvalue())}


def test_restore_passes_over_nan_checkpoints_and_says_why(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    run_ranks(_train, 2, str(root), 6, {}, timeout=300)
    results = run_ranks(_restore, 2, str(root), None, timeout=300)
    for r in results:
        assert r["step"] == 4 and r["finite"], r
        assert list(r["passed_over"]) == [8, 6], r
        assert all("non-finite" in why for why in r["passed_over"].values())
        # warned, naming each step and a key of each
        assert len(r["warnings"]) == 2, r["warnings"]
        for s, w in zip((8, 6), r["warnings"]):
            assert f"step {s} " in w and "'model/0.weight'" in w, w
        assert r["explicit"] == 8 and not r["explicit_finite"] and r["explicit_warned"], r
    rows = _ls(root)
    assert rows[2]["nonfinite"] == [] and rows[4]["nonfinite"] == []
    assert rows[6]["nonfinite"] == ["model/0.weight"]  # poisoned after step 6's update: the moments are still finite
    assert "model/0.weight" in rows[8]["nonfinite"] and "optimizer/state/0.weight/exp_avg" in rows[8]["nonfinite"]
    assert rows[8]["metrics"]["loss"] is None and math.isfinite(rows[4]["metrics"]["loss"])  # NaN: null, strict JSON
    meta = shardpoint.api.metadata(root / "step-00000008")
    assert "model/0.weight" in (meta.nonfinite or [])


def test_a_metric_predicate_passes_over_a_loss_spike(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    run_ranks(_train, 2, str(root), None, {8: 1e6}, timeout=300)
    results = run_ranks(_restore, 2, str(root), 100.0, timeout=300)
    for r in results:
        assert r["step"] == 6 and list(r["passed_over"]) == [8], r
        assert "rejected" in r["passed_over"][8] and "1000000.0" in r["passed_over"][8], r
        assert len(r["warnings"]) == 1 and "step 8 " in r["warnings"][0]
        assert r["explicit"] == 8 and r["explicit_finite"] and not r["explicit_warned"], r
    assert _ls(root)[8]["metrics"] == {"loss": 1e6}


class _Masked(torch.nn.Module):
    """A layer with a causal attention mask buffer that holds -inf, as many do."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)
        self.register_buffer("mask", torch.full((4, 4), -math.inf).triu(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) + self.mask.clamp(min=-1e4).sum(0)


def _sentinels(rank: int, world: int, root: str, poison: str | None) -> dict[str, Any]:
    """Steps 1..3 of a model whose mask buffer holds -inf, with a best-loss sentinel of
    +inf among the extras; step 4 poisoned as ``poison`` says (a NaN or an infinity in
    a weight); then restores as a fresh attempt would, by default, with ``accept``
    overriding the verdict, and with a rule that also refuses an infinity in a buffer."""
    from shardpoint.health import HealthRule

    torch.manual_seed(0)
    m = _Masked()
    opt = torch.optim.AdamW(m.parameters(), lr=0.1)
    mgr = shardpoint.CheckpointManager(root)
    state = shardpoint.TrainState(model=m, optimizer=opt, best_val_loss=torch.tensor(math.inf))
    for step in range(1, 5):
        m(torch.randn(2, 4)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        if step == 4 and poison is not None:
            with torch.no_grad():
                m.fc.weight[0, 0] = math.nan if poison == "nan" else math.inf
        mgr.save(state, step)

    def restore(**kw: Any) -> dict[str, Any]:
        m2 = _Masked()
        st = shardpoint.TrainState(model=m2, optimizer=torch.optim.AdamW(m2.parameters(), lr=0.1),
                                   best_val_loss=torch.tensor(0.0))
        rule = kw.pop("health", None)
        mgr2 = shardpoint.CheckpointManager(root, **({"health": rule} if rule else {}))
        with warnings.catch_warnings(record=True):
            warnings.simplefilter("always")
            try:
                r = mgr2.restore(st, **kw)
            except shardpoint.ShardpointError as e:
                return {"error": str(e)}
        return {"step": r.step if r else None, "passed": sorted(r.passed_over) if r else None,
                "best": float(st.extra["best_val_loss"]), "mask_inf": bool(torch.isinf(m2.mask).any())}

    infos = {i.step: i for i in mgr.list()}
    return {
        "default": restore(),
        "accept_all": restore(accept=lambda info: True),
        "strict_buffers": restore(health=HealthRule(inf=frozenset({"param", "buffer", "optimizer", "state"}))),
        "info": {s: {"nonfinite": list(i.nonfinite or ()), "nan": list(i.nan or ()), "roles": dict(i.roles),
                     "unfit": list(i.unfit), "healthy": i.healthy} for s, i in infos.items()},
    }


@pytest.mark.parametrize("poison", ["nan", "inf"])
def test_an_inf_sentinel_and_a_minus_inf_mask_do_not_block_a_restore(tmp_path: Path, poison: str) -> None:
    results = run_ranks(_sentinels, 2, str(tmp_path / "ckpt"), poison, timeout=300)
    for r in results:
        info = r["info"]
        # steps 1-3: recorded, with what each key is, and fit
        assert info[3]["nonfinite"] == ["extra/best_val_loss", "model/mask"], info[3]
        assert info[3]["nan"] == [] and info[3]["unfit"] == [] and info[3]["healthy"], info[3]
        assert info[3]["roles"] == {"extra/best_val_loss": "extra", "model/mask": "buffer"}, info[3]
        # step 4: a NaN or an infinity in a weight is poison either way
        assert info[4]["unfit"] == ["model/fc.weight"] and info[4]["roles"]["model/fc.weight"] == "param", info[4]
        assert info[4]["nan"] == (["model/fc.weight"] if poison == "nan" else []), info[4]
        d = r["default"]
        assert d["step"] == 3 and d["passed"] == [4], d
        assert d["best"] == math.inf and d["mask_inf"], d  # the sentinel and the mask come back as they were
        assert r["accept_all"]["step"] == 4, r["accept_all"]  # accept= overrides the verdict
        # a rule that also refuses an infinity in a buffer: no step is fit
        assert "no checkpoint under" in r["strict_buffers"]["error"] and "'model/mask'" in r["strict_buffers"]["error"]
