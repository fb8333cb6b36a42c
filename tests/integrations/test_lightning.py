"""PyTorch Lightning through ``ShardpointDDPStrategy``, end to end: ``Trainer.fit`` on
2 real gloo ranks, stopped after 6 of 12 steps by ``max_steps``, resumed with
``fit(ckpt_path="last")`` on 2 ranks (bitwise, dropout on) and on 1 rank (the global
batch kept, dropout off), every sample consumed once; a resume without the optimizer
breaks the bound; a save only rank 0 makes ends in the named error, not a hang."""

from __future__ import annotations

import shutil

import pytest
import torch

from tests._dist import run_ranks
from tests.integrations._frameworks import check_same_world, global_ids, need, rel

pytestmark = pytest.mark.distributed
K, STEPS = 6, 12


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):  # type: ignore[no-untyped-def]
    need("lightning")
    from tests.integrations import _lightning_worker as w

    tmp = str(tmp_path_factory.mktemp("lightning"))
    return tmp, run_ranks(w.same_world, 2, tmp, timeout=400)


_ONE: dict[str, dict] = {}


def _one_rank(tmp: str) -> dict:
    """The 1-rank resumes (DDP, its negative control, FSDP2), run once for the module."""
    if tmp not in _ONE:
        from tests.integrations import _lightning_worker as w

        shutil.copytree(f"{tmp}/run0", f"{tmp}/run0_neg")
        shutil.copytree(f"{tmp}/run0", f"{tmp}/run0_acc")
        [_ONE[tmp]] = run_ranks(w.other_world, 1, tmp, timeout=400)
    return _ONE[tmp]


@pytest.mark.timeout(500)
def test_resume_on_the_same_ranks_is_exact(two_ranks) -> None:  # type: ignore[no-untyped-def]
    _, res = two_ranks
    check_same_world(res, K, STEPS)  # at_k here holds the RNG and the step too
    for r in res:
        resumed = r["resumed"]
        assert resumed["at_k"]["step"] == K and resumed["at_k"]["sched"]["last_epoch"] == K
    ids = global_ids([r["base"]["ids"] for r in res])
    epoch0, epoch1 = sum(ids[:8], []), sum(ids[8:], [])  # 64 samples: 8 steps of 8 per epoch
    assert sorted(epoch0) == list(range(64)) and len(set(epoch1)) == len(epoch1) == 8 * (STEPS - 8)
    # ModelCheckpoint's naming and top-k removal work on checkpoint directories
    assert res[0]["listing"] == ["epoch=0-step=6.ckpt", "last.ckpt"]
    assert res[0]["listing_after"] == ["epoch=1-step=12.ckpt", "last.ckpt"]
    # what each save cost reaches the Trainer's loggers (rank 0's figures, at the step it was made)
    logged = res[0]["logged"]
    assert [step for step, _ in logged] and all(step % 3 == 0 for step, _ in logged), logged
    assert all(row["checkpoint/save_seconds"] >= row["checkpoint/stall_seconds"] > 0 and row["checkpoint/gb"] > 0
               for _, row in logged), logged
    assert res[1]["logged"] == []  # Lightning's loggers write on rank 0 only


@pytest.mark.timeout(500)
def test_misuse_on_rank_0_names_the_absent_rank_and_the_next_save_works(two_ranks) -> None:  # type: ignore[no-untyped-def]
    _, res = two_ranks
    for found in ([r for r in res], [r["fsdp_misuse"] for r in res]):  # DDP, then ModelParallelStrategy
        assert found[0]["misuse"]["ranks"] == [1], found[0]["misuse"]
        assert "did not call it" in found[0]["misuse"]["msg"] and "is_global_zero" in found[0]["misuse"]["msg"]
        assert found[1]["misuse"] is None
        assert all(r["after_committed"] and not r["misuse_committed"] for r in found)


@pytest.mark.timeout(500)
def test_resume_on_one_rank_keeps_the_global_batch(two_ranks) -> None:  # type: ignore[no-untyped-def]
    tmp, res = two_ranks
    r1 = _one_rank(tmp)
    one, neg = r1["one"], r1["neg"]
    base = [(a + b) / 2 for a, b in zip(res[0]["base0"]["losses"], res[1]["base0"]["losses"])]  # the global loss
    assert len(one["losses"]) == STEPS - K
    worst = max(rel(a, b) for a, b in zip(one["losses"], base[K:]))
    assert worst < 1e-4, (one["losses"], base[K:])
    neg_worst = max(rel(a, b) for a, b in zip(neg["losses"], base[K:]))
    assert neg_worst > 1e-4  # the negative control: without the optimizer the bound breaks
    # the data: the first 6 steps on 2 ranks and the last 6 on 1 rank consumed the uninterrupted run's samples
    first = global_ids([r["first0"]["ids"] for r in res])
    assert first + one["ids"] == global_ids([r["base0"]["ids"] for r in res])


@pytest.mark.timeout(500)
def test_fsdp2_model_parallel_strategy_resumes_on_two_ranks_and_on_one(two_ranks) -> None:  # type: ignore[no-untyped-def]
    """ModelParallelStrategy with FSDP2 on the CPU: each rank writes its own shards; the
    resume is bitwise on 2 ranks and within 1e-4 (the global batch kept) on 1."""
    tmp, res = two_ranks
    for r in res:
        assert r["fsdp_first"]["losses"] + r["fsdp_resumed"]["losses"] == r["fsdp_base"]["losses"]
        assert r["fsdp_first"]["ids"] + r["fsdp_resumed"]["ids"] == r["fsdp_base"]["ids"]
    assert sum(f.endswith(".safetensors") for f in res[0]["fsdp_files"]) == 2  # both ranks wrote shards
    base = [(a + b) / 2 for a, b in zip(res[0]["fsdp_base"]["losses"], res[1]["fsdp_base"]["losses"])]
    one = _one_rank(tmp)["fsdp"]
    assert max(rel(a, b) for a, b in zip(one["losses"], base[K:])) < 1e-4
    assert global_ids([r["fsdp_first"]["ids"] for r in res]) + one["ids"] == global_ids(
        [r["fsdp_base"]["ids"] for r in res])


@pytest.mark.timeout(500)
def test_resume_on_one_rank_with_gradient_accumulation(two_ranks) -> None:  # type: ignore[no-untyped-def]
    """2 ranks x 4 samples -> 1 rank x 2 micro-batches of 4 (accumulate_grad_batches=2):
    Lightning's micro-batch counters are rescaled, the run continues on the same samples."""
    tmp, res = two_ranks
    acc = _one_rank(tmp)["acc"]
    base = [(a + b) / 2 for a, b in zip(res[0]["base0"]["losses"], res[1]["base0"]["losses"])]
    assert len(acc["losses"]) == 2 * (STEPS - K)  # two micro-batches per step
    # batch_idx counts this run's micro-batches: 12 done in epoch 0 (6 steps x 2), 16 in an epoch
    assert acc["batch_idx"] == [12, 13, 14, 15] + list(range(8)), acc["batch_idx"]
    steps = [(acc["losses"][i] + acc["losses"][i + 1]) / 2 for i in range(0, len(acc["losses"]), 2)]
    assert max(rel(a, b) for a, b in zip(steps, base[K:])) < 1e-4, (steps, base[K:])
    ids = [acc["ids"][i] + acc["ids"][i + 1] for i in range(0, len(acc["ids"]), 2)]
    assert global_ids([r["first0"]["ids"] for r in res]) + ids == global_ids([r["base0"]["ids"] for r in res])


def test_load_from_checkpoint_reads_a_shardpoint_checkpoint(two_ranks) -> None:  # type: ignore[no-untyped-def]
    """Lightning's own LightningModule.load_from_checkpoint reads a file; the integration's
    reads the checkpoint folder the strategy wrote on 2 ranks, in one process."""
    import shardpoint
    from shardpoint.integrations.lightning import load_from_checkpoint
    from tests.integrations import _lightning_worker as w

    tmp, _ = two_ranks
    path = f"{tmp}/run/last.ckpt"
    module = load_from_checkpoint(type(w._module(0.0)), path)
    saved = shardpoint.load_full(path, keys="model")["model"]
    got = module.state_dict()
    assert sorted(got) == sorted(saved) and all(torch.equal(got[k], saved[k]) for k in saved)
