"""shardpoint.integrations.deepspeed on real DeepSpeed engines (CPU, gloo), real
ranks: the ZeRO partitions it finds are DeepSpeed's own, and a run saved on 4 ranks
continues on 2 (accumulation doubled), 3 or 4 as if it had never stopped."""

from __future__ import annotations

import os

import pytest
import torch

from tests.integrations.ds_common import build_engine, full_state, require_deepspeed, run_ds, train

require_deepspeed()

# bounds for a loaded machine: the first run may also build DeepSpeed's comm op (ds_common.build_comm_op_once)
pytestmark = [pytest.mark.distributed, pytest.mark.deepspeed, pytest.mark.timeout(900)]

REL = 1e-4


# -- rank functions (module level: the ranks import them) -----------------------------------------
BF16_OPTIMIZER = {"data_types": {"grad_accum_dtype": "fp32"}}  # ZeRO-1 + bf16 + fp32 grads: DeepSpeed's BF16_Optimizer


def _pieces_match(rank: int, world: int, stage: int, bf16: bool, extra: dict | None = None) -> int:
    from shardpoint.integrations.deepspeed import pieces, torch_optimizer
    from shardpoint.layout import FlatShard

    engine = build_engine(stage, bf16=bf16, extra=extra)
    assert type(engine.optimizer).__name__ == ("BF16_Optimizer" if extra else type(engine.optimizer).__name__)
    train(engine, 0, 2)
    full = full_state(engine)
    topt = torch_optimizer(engine)
    seen = 0
    for pc in pieces(engine):
        for name, flat in [("model", pc.key)] + [(k, topt.state[pc.key][k]) for k in ("exp_avg", "exp_avg_sq")]:
            leaf = pc.view(flat)
            want = full[f"model/{pc.fqn}" if name == "model" else f"optimizer/state/{pc.fqn}/{name}"].reshape(-1)
            if isinstance(leaf, FlatShard):
                assert leaf.local.data_ptr() == flat.view(-1)[pc.offset :].data_ptr()  # a view, not a copy
                got, want = leaf.local, want[leaf.start : leaf.start + leaf.local.numel()]
            else:
                got = leaf.reshape(-1)
            assert torch.equal(got, want), (pc.fqn, name)
            seen += 1
    return seen


def _train_save(rank: int, world: int, stage: int, path: str, before: int, after: int, bf16: bool) -> dict:
    from shardpoint.integrations.deepspeed import save

    engine = build_engine(stage, bf16=bf16)
    train(engine, 0, before)
    save(engine, path, client_state={"epoch": 3, "note": "hello"})
    ref = full_state(engine)
    return {"full": ref, "losses": train(engine, before, after)}


def _load_continue(rank: int, world: int, stage: int, path: str, before: int, after: int, gas: int,
                   exclude: list[str] | None, bf16: bool) -> dict:
    from shardpoint.integrations.deepspeed import load

    engine = build_engine(stage, gas=gas, seed=1, bf16=bf16)
    module, opt, sched = engine.module, engine.optimizer, engine.lr_scheduler
    client: dict = {}
    report = load(engine, path, exclude=exclude, client_state=client)
    assert engine.module is module and engine.optimizer is opt and engine.lr_scheduler is sched
    if exclude is None:  # a never-stepped engine: its Adam state was created, then filled
        assert [k for k in report.created if k.startswith("optimizer/state/")] and report.unexpected == []
        assert not [k for k in report.loaded if k.startswith("optimizer/state/")]
    full = full_state(engine) if exclude is None else None
    return {"full": full, "losses": train(engine, before, after), "client": client, "report": report}


# -- tests ----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "stage,bf16,extra",
    [(0, False, None), (1, False, None), (2, False, None), (3, False, None),
     (0, True, None), (1, True, BF16_OPTIMIZER), (2, True, None), (3, True, None)],
)
def test_pieces_are_views_of_deepspeeds_own_partitions(stage: int, bf16: bool, extra: dict | None) -> None:
    """Each rank's FlatShard of every master weight and Adam moment equals that range
    of what DeepSpeed's safe_get_full_* API gathers, and aliases DeepSpeed's buffer."""
    seen = run_ds(_pieces_match, 3, stage, bf16, extra)
    assert all(n > 0 for n in seen)


def _rel(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_resume_on_half_the_ranks_with_accumulation_doubled(tmp_path: os.PathLike, stage: int) -> None:
    path = str(tmp_path / "ck")
    saved = run_ds(_train_save, 4, stage, path, 2, 3, False)
    ref = saved[0]
    got = run_ds(_load_continue, 2, stage, path, 2, 3, 2, None, False)
    for r in got:
        for k, v in ref["full"].items():
            if k.startswith(("model/", "optimizer/")):
                assert torch.equal(r["full"][k], v), k
        assert r["full"]["lr"] == ref["full"]["lr"]
        assert r["full"]["global_steps"] == ref["full"]["global_steps"] == 2
        assert r["client"] == {"epoch": 3, "note": "hello"}
        assert r["report"].missing == [] and r["report"].unexpected == []
    assert _rel(got[0]["losses"], ref["losses"]) <= REL, (got[0]["losses"], ref["losses"])
    # negative control: the same load without the Adam moments (and step) does not continue the run
    bad = run_ds(_load_continue, 2, stage, path, 2, 3, 2, ["optimizer/state"], False)
    assert bad[0]["losses"][0] == pytest.approx(ref["losses"][0], rel=REL)  # same weights: same first loss
    assert _rel(bad[0]["losses"], ref["losses"]) > REL


@pytest.mark.parametrize("stage,before,after", [(0, 2, 4), (2, 4, 3), (3, 2, 4), (1, 3, 2)])
def test_resume_on_other_world_sizes(tmp_path: os.PathLike, stage: int, before: int, after: int) -> None:
    path = str(tmp_path / "ck")
    ref = run_ds(_train_save, before, stage, path, 2, 2, False)[0]
    got = run_ds(_load_continue, after, stage, path, 2, 2, 1, None, False)[0]
    for k, v in ref["full"].items():
        if k.startswith(("model/", "optimizer/")):
            assert torch.equal(got["full"][k], v), k
    assert _rel(got["losses"], ref["losses"]) <= REL, (got["losses"], ref["losses"])


def _bf16_check(rank: int, world: int, path: str) -> dict:
    from shardpoint.integrations.deepspeed import load

    engine = build_engine(2, bf16=True, seed=1)
    load(engine, path)
    full = full_state(engine)
    for n, p in engine.module.named_parameters():  # the bf16 weights were refreshed from the fp32 masters
        assert torch.equal(p.detach(), full[f"model/{n}"].to(torch.bfloat16)), n
    return full


def test_bf16_zero3_to_zero2_restores_masters_moments_and_weights(tmp_path: os.PathLike) -> None:
    path = str(tmp_path / "ck")
    ref = run_ds(_train_save, 2, 3, path, 2, 0, True)[0]
    got = run_ds(_bf16_check, 3, path)[0]
    for k, v in ref["full"].items():
        if k.startswith(("model/", "optimizer/")):
            assert torch.equal(got[k], v), k


def _train_state_continue(rank: int, world: int, path: str, save: bool) -> list[float]:
    import shardpoint

    engine = build_engine(2, seed=0 if save else 1, gas=1 if save else 2)
    state = shardpoint.TrainState(model=engine, scheduler=engine.lr_scheduler)
    if save:
        train(engine, 0, 2)
        shardpoint.save(state, path)
    else:
        shardpoint.load(state, path)
    return train(engine, 2, 2)


def test_train_state_with_an_engine_resumes_on_half_the_ranks(tmp_path: os.PathLike) -> None:
    path = str(tmp_path / "ck")
    ref = run_ds(_train_state_continue, 4, path, True)[0]
    got = run_ds(_train_state_continue, 2, path, False)[0]
    assert _rel(got, ref) <= REL, (got, ref)


def _plain_to_ds(rank: int, world: int, path: str) -> dict:
    from shardpoint.integrations.deepspeed import load

    engine = build_engine(2, seed=1, scheduler=False, extra={"gradient_clipping": 0.0})
    report = load(engine, path, strict=False)
    return {"missing": report.missing, "losses": train(engine, 2, 2)}


def test_plain_pytorch_checkpoint_resumes_in_a_deepspeed_engine(tmp_path: os.PathLike) -> None:
    """TrainState(model, AdamW) saved by one plain process continues under ZeRO-2 on 2 ranks."""
    import shardpoint
    from tests.integrations.ds_common import global_batch, tiny_model

    model = tiny_model(0)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-2, weight_decay=0.05)

    def step(s: int) -> float:
        x, y = global_batch(s)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return float(loss.detach())

    for s in range(2):
        step(s)
    path = str(tmp_path / "plain")
    shardpoint.save(shardpoint.TrainState(model=model, optimizer=opt, rng=False), path)
    ref = [step(s) for s in (2, 3)]
    got = run_ds(_plain_to_ds, 2, path)[0]
    assert got["missing"] == ["engine/global_samples", "engine/global_steps", "engine/skipped_steps"]
    assert _rel(got["losses"], ref) <= REL, (got["losses"], ref)


# -- the engine as one Stateful object, through the core API and the manager ---------------------
def _engine_state_save(rank: int, world: int, path: str, root: str) -> None:
    import shardpoint
    from shardpoint.integrations.deepspeed import EngineState

    engine = build_engine(2, bf16=True)
    train(engine, 0, 2)
    shardpoint.save(EngineState(engine), path)
    shardpoint.CheckpointManager(root).save(EngineState(engine), 2)


def _engine_state_load(rank: int, world: int, path: str, root: str) -> dict:
    import shardpoint
    from shardpoint.integrations.deepspeed import EngineState

    engine = build_engine(2, bf16=True, seed=1)
    out = {}

    def refreshed() -> list[str]:
        """Parameters whose bf16 weights are not their fp32 masters, rounded."""
        full = full_state(engine)
        return [n for n, p in engine.module.named_parameters() if not torch.equal(p.detach(), full[f"model/{n}"].to(torch.bfloat16))]

    out["load"] = shardpoint.load(EngineState(engine), path)
    out["after_load"] = refreshed()
    out["full"] = full_state(engine)
    with torch.no_grad():
        for p in engine.module.parameters():
            p.zero_()  # the masters stay: only a refresh brings the weights back
    out["zeroed"] = refreshed()
    out["restore"] = shardpoint.CheckpointManager(root).restore(EngineState(engine))
    out["after_restore"] = refreshed()
    return out


def test_engine_state_through_load_and_the_manager_refreshes_bf16_weights(tmp_path: os.PathLike) -> None:
    path, root = str(tmp_path / "ck"), str(tmp_path / "run")
    run_ds(_engine_state_save, 2, path, root)
    ref = run_ds(_train_save, 2, 2, str(tmp_path / "ref"), 2, 0, True)[0]["full"]
    for r in run_ds(_engine_state_load, 2, path, root):
        assert r["zeroed"], "the negative control: zeroed weights differ from the masters"
        assert r["after_load"] == [] and r["after_restore"] == [], (r["after_load"], r["after_restore"])
        assert r["restore"].step == 2 and r["load"].per_rank["rng/streams"] == "restored"
        for k, v in ref.items():
            if k.startswith(("model/", "optimizer/")):
                assert torch.equal(r["full"][k], v), k


# -- exact resume with dropout: the RNG streams travel with the engine -------------------------------
def _dropout_run(rank: int, world: int, path: str, resume: bool, rng: bool) -> dict:
    from shardpoint.integrations.deepspeed import load, save

    engine = build_engine(2, dropout=0.3, seed=1 if resume else 0)
    torch.manual_seed(1000 + rank if not resume else 7)  # per-rank streams: each rank its own dropout masks
    if not resume:
        train(engine, 0, 2)
        save(engine, path)
        return {"losses": train(engine, 2, 3)}
    report = load(engine, path, rng=rng)
    return {"losses": train(engine, 2, 3), "rng": report.per_rank.get("rng/streams")}


def test_dropout_resumes_bit_for_bit_on_the_same_ranks(tmp_path: os.PathLike) -> None:
    path = str(tmp_path / "ck")
    ref = run_ds(_dropout_run, 2, path, False, True)[0]["losses"]
    got = run_ds(_dropout_run, 2, path, True, True)
    assert [r["rng"] for r in got] == ["restored", "restored"]
    assert got[0]["losses"] == ref, (got[0]["losses"], ref)  # bitwise: the same floats
    # negative control: the same resume without the RNG streams draws other dropout masks
    control = run_ds(_dropout_run, 2, path, True, False)
    assert [r["rng"] for r in control] == [None, None]  # rng=False: nothing restored, and the report says none was
    assert control[0]["losses"][0] != ref[0], (control[0]["losses"], ref)


def test_deepspeeds_engine_subclasses_find_the_engine_adapter() -> None:
    """The registry matches by class hierarchy: DeepSpeed's own subclasses of the
    engine use its adapter, with no registration of their own."""
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.hybrid_engine import DeepSpeedHybridEngine
    from deepspeed.runtime.pipe.engine import PipelineEngine

    from shardpoint.adapters import adapter_class
    from shardpoint.integrations.deepspeed import EngineAdapter

    for cls in (DeepSpeedEngine, PipelineEngine, DeepSpeedHybridEngine):
        assert adapter_class(cls.__new__(cls)) is EngineAdapter, cls
