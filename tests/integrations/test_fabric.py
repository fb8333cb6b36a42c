"""Lightning Fabric through ``ShardpointFabricDDPStrategy``, end to end on real gloo
ranks: ``fabric.save`` / ``fabric.load`` of a dict of a module, its optimizer, a
scheduler and plain values; a resume into fresh objects on the same 2 ranks continues
bit for bit; a 1-rank checkpoint resumes on 2 ranks with the global batch kept;
``fabric.load(path)`` returns the checkpoint under its saved names,
``fabric.load_raw`` reads the weights alone, a file Fabric itself wrote still loads and
``fabric.save(filter=...)`` is refused on every rank."""

from __future__ import annotations

import pytest

from tests._dist import run_ranks
from tests.integrations._frameworks import need, rel

pytestmark = pytest.mark.distributed


@pytest.mark.timeout(400)
def test_save_and_load_on_two_ranks_resume_exactly(tmp_path) -> None:  # type: ignore[no-untyped-def]
    need("lightning")
    from tests.integrations import _fabric_worker as w

    res = run_ranks(w.same_world, 2, str(tmp_path), timeout=300)
    for r in res:
        assert r["first"] == r["base"][: w.K] and r["resumed"] == r["base"][w.K :]  # bitwise
        assert r["loaded"] == r["at_k"]  # parameters, AdamW moments and lr, into an optimizer that never stepped
        assert r["step"] == w.K and r["remainder"] == {"note": "hello"}  # plain values back in the dict
        assert r["sched"]["last_epoch"] == w.STEPS
        assert r["full"] == {"keys": ["model", "note", "optimizer", "scheduler", "step"],
                             "model": ["0.bias", "0.weight", "2.bias", "2.weight"], "note": "hello", "step": w.K}
        assert list(r["raw"].values()) == list(r["at_k"]["params"].values())  # load_raw: the weights alone
        assert r["stock"] == [7, r["raw"]]  # a file Fabric's own CheckpointIO wrote: Fabric's loader reads it
        assert "filter=" in r["refused"] and "only=" in r["refused"]
    assert not (tmp_path / "filtered").exists()
    assert res[0]["base"] == res[1]["base"]


@pytest.mark.timeout(400)
def test_a_one_rank_checkpoint_resumes_on_two_ranks(tmp_path) -> None:  # type: ignore[no-untyped-def]
    need("lightning")
    from tests.integrations import _fabric_worker as w

    [one] = run_ranks(w.one_rank, 1, str(tmp_path), timeout=300)
    two = run_ranks(w.other_world, 2, str(tmp_path), timeout=300)
    for r in two:
        assert r["loaded"]["params"] == one["at_k"]["params"]  # bitwise, whatever the world size
        assert r["loaded"]["opt"] == one["at_k"]["opt"] and r["step"] == w.K
        # the same global batches, split over 2 ranks: the 1-rank run's losses, to rounding
        assert max(rel(a, b) for a, b in zip(r["resumed"], one["base"][w.K :])) < 1e-5, (r["resumed"], one["base"])
