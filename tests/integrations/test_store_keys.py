"""Saves leave nothing in the process group's store: 50 saves through each trainer
integration and through ``CheckpointManager`` on 2 real ranks, with the number of
keys of the default store counted before and after (a long run used to add keys at
every save), and each save arriving once (the channel's call number moves by one
per save)."""

from __future__ import annotations

import pytest

from tests._dist import run_ranks
from tests.integrations._frameworks import need

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(400)]


@pytest.mark.parametrize(("case", "framework", "min_python"), [
    ("lightning_case", "lightning", None),
    ("accelerate_case", "accelerate", None),
    ("hf_case", "transformers", (3, 11)),
    ("manager_case", None, None),
])
def test_fifty_saves_leave_the_store_as_they_found_it(tmp_path, case: str, framework: str | None,
                                                      min_python: tuple[int, int] | None) -> None:  # type: ignore[no-untyped-def]
    if framework is not None:
        need(framework, min_python)
    from tests.integrations import _store_keys_worker as w

    results = run_ranks(getattr(w, case), 2, str(tmp_path), timeout=360)
    for rank, res in enumerate(results):
        assert res["after"] == res["before"], f"rank {rank}: {res}"
        assert res["arrivals"] == w.SAVES, f"rank {rank}: one arrival per save expected, {res}"
