"""Accelerate through ``shardpoint.integrations.accelerate``, end to end: an Accelerate
training loop on 2 real gloo ranks saving every 3 steps, stopped after 6 of 12 steps,
resumed with ``load_state`` on 2 ranks (bitwise, dropout on) and on 1 rank (the
global batch kept, dropout off), every sample consumed once; a resume without the
optimizer breaks the bound; a save only the main process makes ends in the named
error, not a hang, and the next save works."""

from __future__ import annotations

import os

import pytest

from tests._dist import run_ranks
from tests.integrations._frameworks import check_other_world, check_same_world, global_ids, need

pytestmark = pytest.mark.distributed
K, STEPS = 6, 12


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):  # type: ignore[no-untyped-def]
    need("accelerate")
    from tests.integrations import _accelerate_worker as w

    tmp = str(tmp_path_factory.mktemp("accelerate"))
    return tmp, run_ranks(w.same_world, 2, tmp, timeout=400)


@pytest.mark.timeout(500)
def test_resume_on_the_same_ranks_is_exact(two_ranks) -> None:  # type: ignore[no-untyped-def]
    _, res = two_ranks
    check_same_world(res, K, STEPS)
    for r in res:
        base, resumed = r["base"], r["resumed"]
        assert resumed["rng"] == base["rng"][K:]
        assert resumed["at_k"] == base["at_k"]  # params, optimizer state, scheduler, lr
        assert resumed["step"] == STEPS  # a registered object
    ids = global_ids([r["base"]["ids"] for r in res])
    assert sorted(sum(ids[:8], [])) == list(range(64))
    # what each save cost reaches the accelerator's trackers (rank 0's figures; trackers log on the main process)
    logged = res[0]["logged"]
    assert len(logged) == STEPS // 3, logged
    assert all(row["checkpoint/save_seconds"] >= row["checkpoint/stall_seconds"] > 0 and row["checkpoint/gb"] > 0
               for row in logged), logged
    assert res[1]["logged"] == []


@pytest.mark.timeout(500)
def test_misuse_on_the_main_process_names_the_absent_rank_and_the_next_save_works(two_ranks) -> None:  # type: ignore[no-untyped-def]
    _, res = two_ranks
    m = res[0]["first"]["misuse"]
    assert m["ranks"] == [1] and "did not call it" in m["msg"] and "is_main_process" in m["msg"], m
    assert res[1]["first"]["misuse"] is None
    # the abandoned save left nothing; the saves of every rank at steps 3 and 6 committed
    assert res[0]["first"]["listing"] == ["step_3", "step_6"]
    assert os.path.exists(f"{two_ranks[0]}/run/step_3/manifest.json")


@pytest.mark.timeout(500)
def test_resume_on_one_rank_keeps_the_global_batch(two_ranks) -> None:  # type: ignore[no-untyped-def]
    import shutil

    from tests.integrations import _accelerate_worker as w

    tmp, res = two_ranks
    shutil.copytree(f"{tmp}/run0", f"{tmp}/run0_neg")
    [r1] = run_ranks(w.other_world, 1, f"{tmp}/run0", f"{tmp}/run0_neg", timeout=400)
    check_other_world(res, r1["one"], r1["neg"], K, STEPS)
