"""accumulation_steps and the pure batch arithmetic the sampler is built on."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from shardpoint.elastic import accumulation_steps
from shardpoint.elastic.batch import advance, epoch_order, global_batch


@pytest.mark.parametrize(
    ("gbs", "mbs", "world", "expected"),
    [(256, 64, 4, 1), (256, 64, 2, 2), (256, 16, 4, 4), (32, 4, 1, 8), (6, 2, 3, 1), (7, 7, 1, 1)],
)
def test_accumulation_steps(gbs: int, mbs: int, world: int, expected: int) -> None:
    assert accumulation_steps(gbs, mbs, world) == expected


def test_accumulation_steps_error_names_nearest_settings() -> None:
    with pytest.raises(ValueError) as err:
        accumulation_steps(100, 8, 4)
    msg = str(err.value)
    assert "global_batch_size 100 is not divisible by micro_batch_size 8 x world_size 4 = 32" in msg
    assert "global_batch_size 96 (accumulation 3) or 128 (accumulation 4)" in msg
    # 100 / 4 ranks = 25 samples per rank: micro-batches of 5 (or 1) divide it
    assert "micro_batch_size 1 (accumulation 25) or 5 (accumulation 5) on 4 ranks" in msg


def test_accumulation_steps_error_suggests_world_sizes() -> None:
    with pytest.raises(ValueError) as err:
        accumulation_steps(24, 4, 5)  # 24 / 4 = 6 micro-batches: 3 or 6 ranks
    msg = str(err.value)
    assert "global_batch_size 20 (accumulation 1) or 40 (accumulation 2)" in msg
    assert "world_size 3 (accumulation 2) or 6 (accumulation 1)" in msg
    assert "micro_batch_size" in msg


def test_accumulation_steps_error_when_global_batch_too_small() -> None:
    with pytest.raises(ValueError, match=r"Nearest valid settings: global_batch_size 32 \(accumulation 1\)"):
        accumulation_steps(16, 8, 4)


@pytest.mark.parametrize("bad", [0, -4, 2.0, True, None])
def test_accumulation_steps_rejects_non_positive_ints(bad: object) -> None:
    with pytest.raises(ValueError, match="must be a positive int"):
        accumulation_steps(bad, 1, 1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="micro_batch_size must be a positive int"):
        accumulation_steps(8, bad, 1)  # type: ignore[arg-type]


@given(st.integers(1, 200), st.integers(1, 16), st.integers(1, 16))
def test_accumulation_steps_property(gbs: int, mbs: int, world: int) -> None:
    try:
        a = accumulation_steps(gbs, mbs, world)
    except ValueError as e:
        assert gbs % (mbs * world) != 0
        # every suggested global batch size is valid for the given micro-batch and world size
        import re

        for g in re.findall(r"global_batch_size (\d+) \(accumulation (\d+)\)", str(e)):
            assert int(g[0]) == int(g[1]) * mbs * world
        for m, acc in re.findall(r"micro_batch_size (\d+) \(accumulation (\d+)\)", str(e)):
            assert int(m) * world * int(acc) == gbs
        for w, acc in re.findall(r"world_size (\d+) \(accumulation (\d+)\)", str(e)):
            assert mbs * int(w) * int(acc) == gbs
    else:
        assert a * mbs * world == gbs


def test_epoch_order_is_seed_plus_epoch_permutation() -> None:
    g = torch.Generator()
    g.manual_seed(7 + 3)
    assert torch.equal(epoch_order(50, 3, seed=7, shuffle=True), torch.randperm(50, generator=g))
    assert epoch_order(5, 3, seed=7, shuffle=False).tolist() == [0, 1, 2, 3, 4]
    assert not torch.equal(epoch_order(50, 0, seed=7, shuffle=True), epoch_order(50, 1, seed=7, shuffle=True))


def test_advance_drops_the_tail_or_runs_on() -> None:
    # 10 samples, batches of 4: steps at offsets 0 and 4; the tail [8, 10) is dropped
    assert advance(10, 0, 0, 4, drop_last=True) == (0, 4)
    assert advance(10, 0, 4, 4, drop_last=True) == (1, 0)
    # continuous stream: 0, 4, 8 (runs 2 into epoch 1), then 2 in epoch 1
    assert advance(10, 0, 4, 4, drop_last=False) == (0, 8)
    assert advance(10, 0, 8, 4, drop_last=False) == (1, 2)
    assert advance(3, 0, 2, 7, drop_last=False) == (3, 0)


def test_global_batch_spans_epochs() -> None:
    e0, e1 = (epoch_order(10, e, seed=1, shuffle=True).tolist() for e in (0, 1))
    assert global_batch(10, 0, 8, 4, seed=1, shuffle=True).tolist() == e0[8:] + e1[:2]
    assert global_batch(10, 0, 2, 4, seed=1, shuffle=True).tolist() == e0[2:6]
