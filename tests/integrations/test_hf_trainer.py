"""The Hugging Face Trainer through ``ShardpointTrainer``, end to end: ``Trainer.train``
on 2 real gloo ranks stopped after 6 of 12 steps, resumed with
``resume_from_checkpoint=True`` (which skips a newer folder that never committed) on
2 ranks (bitwise, dropout on) and on 1 rank (the global batch kept, dropout off),
every sample consumed once; a resume without the optimizer breaks the bound; a save
only rank 0 makes ends in the named error, not a hang, and the next save works."""

from __future__ import annotations

import shutil

import pytest

from tests._dist import run_ranks
from tests.integrations._frameworks import check_other_world, check_same_world, global_ids, need

pytestmark = pytest.mark.distributed
K, STEPS = 6, 12


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):  # type: ignore[no-untyped-def]
    need("transformers", min_python=(3, 11))
    from tests.integrations import _hf_worker as w

    tmp = str(tmp_path_factory.mktemp("hf"))
    return tmp, run_ranks(w.same_world, 2, tmp, timeout=400)


@pytest.mark.timeout(500)
def test_resume_on_the_same_ranks_is_exact(two_ranks) -> None:  # type: ignore[no-untyped-def]
    _, res = two_ranks
    check_same_world(res, K, STEPS)
    for r in res:
        base, resumed = r["base"], r["resumed"]
        assert resumed["rng"] == base["rng"][K:]  # RNG at every step after the resume
        assert resumed["at_k"] == base["at_k"] and resumed["at_k"]["step"] == K  # params, optimizer, scheduler, lr
        assert resumed["step"] == STEPS
    ids = global_ids([r["base"]["ids"] for r in res])
    assert sorted(sum(ids[:8], [])) == list(range(64))  # one epoch: each sample once
    # rotation (save_total_limit=2) keeps the newest committed checkpoints and never the one the run
    # resumed from (checkpoint-6); the never-committed checkpoint-9 that the resume skipped was replaced
    # by the resumed run's own save at step 9
    assert res[0]["first"]["listing"] == ["checkpoint-3", "checkpoint-6"]
    assert res[0]["resumed"]["listing"] == ["checkpoint-12", "checkpoint-6", "checkpoint-9"]
    # what each save cost reaches the Trainer's own log (its reporters), at the step it was made
    for rank, r in enumerate(res):
        logs = r["base"]["ckpt_logs"]
        assert [h["step"] for h in logs] == [3, 6, 9, 12], logs
        assert all(h["checkpoint_save_seconds"] >= h["checkpoint_stall_seconds"] > 0 for h in logs), logs
        assert all(("checkpoint_gb" in h) == (rank == 0) for h in logs), logs


@pytest.mark.timeout(500)
def test_misuse_on_rank_0_names_the_absent_rank_and_the_next_save_works(two_ranks) -> None:  # type: ignore[no-untyped-def]
    _, res = two_ranks
    m = res[0]["first"]["misuse"]
    assert m["ranks"] == [1] and "did not call it" in m["msg"] and "checkpoint-2" in m["msg"], m
    assert res[1]["first"]["misuse"] is None
    assert "checkpoint-2" not in res[0]["first"]["listing"]  # and the saves at steps 3 and 6 worked


@pytest.mark.timeout(500)
def test_resume_on_one_rank_keeps_the_global_batch(two_ranks) -> None:  # type: ignore[no-untyped-def]
    from tests.integrations import _hf_worker as w

    tmp, res = two_ranks
    shutil.copytree(f"{tmp}/run0", f"{tmp}/run0_neg")
    [r1] = run_ranks(w.other_world, 1, f"{tmp}/run0", f"{tmp}/run0_neg", timeout=400)
    check_other_world(res, r1["one"], r1["neg"], K, STEPS)
