"""ElasticBatchSampler: ranks simulated in one process. Across any change of world
size and micro-batch size, at any step, the job consumes exactly the uninterrupted
run's global batches, step by step, across epoch boundaries."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader, Dataset

from shardpoint.elastic import ElasticBatchSampler


def reference(n: int, gbs: int, steps: int, *, seed: int, drop_last: bool, shuffle: bool = True) -> list[list[int]]:
    """The uninterrupted run's global batches, from the documented definition:
    epoch e visits randperm(n) drawn from seed + e; with drop_last the tail of each
    epoch that does not fill a global batch is skipped, without it the epochs form
    one stream."""
    stream: list[int] = []
    e = 0
    while len(stream) < steps * gbs:
        g = torch.Generator()
        g.manual_seed(seed + e)
        order = torch.randperm(n, generator=g).tolist() if shuffle else list(range(n))
        stream += order[: (n // gbs) * gbs] if drop_last else order
        e += 1
    return [sorted(stream[k * gbs : (k + 1) * gbs]) for k in range(steps)]


def run_segment(state: dict | None, n: int, gbs: int, mbs: int, world: int, steps: int, **kw) -> tuple[list[list[int]], dict]:  # type: ignore[no-untyped-def]
    """``world`` simulated ranks run ``steps`` optimizer steps from ``state``;
    returns each step's global multiset (sorted) and the state after."""
    samplers = [ElasticBatchSampler(n, gbs, mbs, rank=r, world_size=world, **kw) for r in range(world)]
    if state is not None:
        for s in samplers:
            s.load_state_dict(state)
    iters = [iter(s) for s in samplers]
    acc = samplers[0].accumulation_steps
    consumed: list[list[int]] = []
    for _ in range(steps):
        batch: list[int] = []
        for r in range(world):
            for _ in range(acc):
                try:
                    mb = next(iters[r])
                except StopIteration:  # end of epoch: a new iterator continues from the position
                    iters[r] = iter(samplers[r])
                    mb = next(iters[r])
                assert len(mb) == mbs
                batch += mb
        consumed.append(sorted(batch))
        for s in samplers:
            s.step()
    states = [s.state_dict() for s in samplers]
    assert all(st == states[0] for st in states), "the sampler's state must be the same on every rank"
    return consumed, states[0]


@st.composite
def elastic_runs(draw):  # type: ignore[no-untyped-def]
    mbs0 = draw(st.integers(1, 3))
    world0 = draw(st.integers(1, 4))
    gbs = mbs0 * world0 * draw(st.integers(1, 3))
    drop_last = draw(st.booleans())
    n = draw(st.integers(gbs if drop_last else 1, 4 * gbs + 7))
    layouts = [(m, w) for m in range(1, gbs + 1) for w in range(1, 9) if gbs % (m * w) == 0]
    segments = [(mbs0, world0, draw(st.integers(0, 8)))]
    for _ in range(draw(st.integers(1, 3))):
        m, w = draw(st.sampled_from(layouts))
        segments.append((m, w, draw(st.integers(0, 8))))
    return n, gbs, drop_last, segments, draw(st.integers(0, 2**31))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(elastic_runs())
def test_resume_on_any_world_size_consumes_the_uninterrupted_sequence(run) -> None:  # type: ignore[no-untyped-def]
    n, gbs, drop_last, segments, seed = run
    total = sum(s for _, _, s in segments)
    expected = reference(n, gbs, total, seed=seed, drop_last=drop_last)
    got: list[list[int]] = []
    state = None
    for mbs, world, steps in segments:
        batches, state = run_segment(state, n, gbs, mbs, world, steps, seed=seed, drop_last=drop_last)
        got += batches
    assert got == expected
    assert state["step"] == total and state["samples_consumed"] == total * gbs


def test_every_sample_once_per_epoch_and_the_tail_dropped() -> None:
    n, gbs = 23, 6  # 3 steps per epoch, 5 samples dropped per epoch
    batches, state = run_segment(None, n, gbs, 1, 3, 3 * 4, seed=5)
    for e in range(4):
        epoch = [i for b in batches[3 * e : 3 * e + 3] for i in b]
        assert len(epoch) == len(set(epoch)) == 18
    assert (state["epoch"], state["offset"]) == (4, 0)


def test_ranks_split_one_global_batch() -> None:
    s = [ElasticBatchSampler(40, 12, 2, rank=r, world_size=3, seed=3) for r in range(3)]
    whole = s[0].global_batch()
    per_rank = [list(x)[:2] for x in s]  # 2 micro-batches per rank per step
    assert [i for r in per_rank for mb in r for i in mb] == whole
    assert len(s[0]) == (40 // 12) * 2


def test_iteration_follows_epochs_and_len() -> None:
    s = ElasticBatchSampler(25, 4, 2, rank=1, world_size=2, seed=0)
    for epoch in range(3):
        assert s.epoch == epoch
        mbs = list(s)
        assert len(mbs) == len(s) == 6  # 6 steps of 1 micro-batch per rank
        for _ in mbs:
            s.step()
    assert s.global_step == 18 and s.samples_consumed == 72


def test_state_is_global_and_plain() -> None:
    assert ElasticBatchSampler.shardpoint_global_state is True
    a = ElasticBatchSampler(30, 8, 2, rank=0, world_size=4, seed=9)
    b = ElasticBatchSampler(30, 8, 4, rank=1, world_size=2, seed=9)
    for s in (a, b):
        s.step()
    assert a.state_dict() == b.state_dict()
    assert all(isinstance(v, (int, bool)) for v in a.state_dict().values())


def test_position_moves_only_on_step() -> None:
    s = ElasticBatchSampler(30, 4, 1, rank=0, world_size=2)
    it = iter(s)
    for _ in range(5):
        next(it)  # handed out 2.5 steps' worth, completed none
    assert s.state_dict()["offset"] == 0 and s.global_step == 0


def test_iterator_made_before_load_keeps_its_position() -> None:
    s = ElasticBatchSampler(30, 4, 2, rank=0, world_size=2, seed=1)
    stale = iter(s)
    other = ElasticBatchSampler(30, 4, 2, rank=0, world_size=2, seed=1)
    for _ in range(3):
        other.step()
    s.load_state_dict(other.state_dict())
    assert next(stale) == ElasticBatchSampler(30, 4, 2, rank=0, world_size=2, seed=1).global_batch()[:2]
    assert next(iter(s)) == other.global_batch()[:2]


def test_load_restores_seed() -> None:
    a = ElasticBatchSampler(30, 4, 2, rank=0, world_size=1, seed=11)
    b = ElasticBatchSampler(30, 4, 2, rank=0, world_size=1, seed=0)
    b.load_state_dict(a.state_dict())
    assert b.seed == 11 and b.global_batch() == a.global_batch()


@pytest.mark.parametrize(
    ("field", "kwargs"),
    [("dataset_len", {"dataset_len": 31}), ("shuffle", {"shuffle": False}), ("drop_last", {"drop_last": False})],
)
def test_load_refuses_a_position_in_another_dataset(field: str, kwargs: dict) -> None:
    saved = ElasticBatchSampler(30, 4, 2, rank=0, world_size=1).state_dict()
    args = {"dataset_len": 30} | kwargs
    s = ElasticBatchSampler(args.pop("dataset_len"), 4, 2, rank=0, world_size=1, **args)
    with pytest.raises(ValueError, match=f"saved with {field}=.*exclude=\\['data'\\]"):
        s.load_state_dict(saved)


def test_load_refuses_a_newer_state_version() -> None:
    s = ElasticBatchSampler(30, 4, 2, rank=0, world_size=1)
    with pytest.raises(ValueError, match="upgrade shardpoint"):
        s.load_state_dict(s.state_dict() | {"version": 99})


def test_a_new_global_batch_size_continues_from_the_same_sample() -> None:
    n = 40
    old = ElasticBatchSampler(n, 4, 2, rank=0, world_size=1, seed=2)
    for _ in range(3):
        old.step()
    new = ElasticBatchSampler(n, 8, 2, rank=0, world_size=2, seed=2)
    new.load_state_dict(old.state_dict())
    order = torch.randperm(n, generator=torch.Generator().manual_seed(2)).tolist()
    assert new.global_batch() == order[12:20]
    assert new.global_step == 3 and new.samples_consumed == 12


def test_constructor_errors() -> None:
    with pytest.raises(ValueError, match="Nearest valid settings"):
        ElasticBatchSampler(100, 10, 4, rank=0, world_size=2)
    with pytest.raises(ValueError, match="drop_last=False"):
        ElasticBatchSampler(5, 8, 1, rank=0, world_size=1)
    with pytest.raises(ValueError, match="rank 2 is outside world_size 2"):
        ElasticBatchSampler(50, 8, 1, rank=2, world_size=2)
    assert len(list(ElasticBatchSampler(5, 8, 1, rank=0, world_size=1, drop_last=False))) == 8


def test_defaults_without_a_process_group() -> None:
    s = ElasticBatchSampler(20, 4, 2)
    assert (s.rank, s.world_size, s.accumulation_steps) == (0, 1, 2)


class Indices(Dataset):
    def __len__(self) -> int:
        return 1000

    def __getitem__(self, i: int) -> int:
        return i


class CountingSampler(ElasticBatchSampler):
    handed_out = 0

    def __iter__(self):  # type: ignore[no-untyped-def]
        for mb in super().__iter__():
            CountingSampler.handed_out += 1
            yield mb


@pytest.mark.timeout(60)
def test_workers_prefetching_ahead_do_not_make_a_resume_skip() -> None:
    n, gbs = 61, 8
    expected = reference(n, gbs, 20, seed=4, drop_last=True)
    world, mbs = 2, 2  # rank 0 of 2: 2 micro-batches of 2 per step
    CountingSampler.handed_out = 0
    s = CountingSampler(n, gbs, mbs, rank=0, world_size=world, seed=4)
    loader = DataLoader(Indices(), batch_sampler=s, num_workers=2, prefetch_factor=4)
    got: list[list[int]] = []
    it = iter(loader)
    for _ in range(5):
        mine = [i for _ in range(2) for i in next(it).tolist()]
        got.append(mine)
        s.step()
    assert CountingSampler.handed_out > 10, "the workers must have fetched ahead for this test to mean anything"
    state = s.state_dict()
    del it

    # resume on one rank with 4 micro-batches of 2; a fresh DataLoader iterator starts at the position
    r = ElasticBatchSampler(n, gbs, mbs, rank=0, world_size=1)
    r.load_state_dict(state)
    loader = DataLoader(Indices(), batch_sampler=r, num_workers=2, prefetch_factor=4)
    rest: list[list[int]] = []
    it = iter(loader)
    while len(rest) < 15:
        try:
            first = next(it)  # an epoch ends between steps, never inside one
        except StopIteration:
            it = iter(loader)
            continue
        rest.append(sorted(first.tolist() + [i for _ in range(3) for i in next(it).tolist()]))
        r.step()
    assert rest == expected[5:]
    # rank 0 took the first half of each of the first 5 global batches
    for k in range(5):
        assert set(got[k]) <= set(expected[k]) and len(got[k]) == gbs // 2


def test_one_of_several_processes_without_a_process_group_refuses_instead_of_guessing(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Under a launcher (WORLD_SIZE=2) before the process group exists, the sampler
    does not take rank 0 of 1: built, it waits; iterated, it refuses saying how to
    build it. Given rank and world size, it needs no process group."""
    from shardpoint import ShardpointError

    monkeypatch.setenv("WORLD_SIZE", "2")
    s = ElasticBatchSampler(20, 4, 2)  # building it is fine: nothing is decided yet
    for read in (lambda: iter(s), lambda: s.rank, lambda: s.accumulation_steps):
        with pytest.raises(ShardpointError, match="WORLD_SIZE=2.*rank= and world_size=") as ei:
            read()
        assert isinstance(ei.value, ValueError)
    assert "rank=None" in repr(s)
    given = ElasticBatchSampler(20, 4, 2, rank=1, world_size=2)
    assert (given.rank, given.world_size, given.accumulation_steps) == (1, 2, 1)
    assert next(iter(given)) == given.global_batch()[2:4]
    with pytest.raises(ValueError, match="Nearest valid settings"):  # a given world size is checked when built
        ElasticBatchSampler(20, 6, 2, world_size=2, rank=0)
