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
    assert math.isnan(rows[8]["metrics"]["loss"]) and math.isfinite(rows[4]["metrics"]["loss"])
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
