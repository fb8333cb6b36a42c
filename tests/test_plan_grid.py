"""The save planner's fast paths against the rule they implement: a grid of ranks by
keys planned once per pattern, and replicated writers chosen in batches, give
exactly the plan of the sequential definition (groups numbered by key and box, one
writer per group, largest replicated group first onto its least-loaded holder, ties
to the lowest rank and the first such row), the same errors, and the same manifest."""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import shardpoint.plan.save as ps
from shardpoint.errors import ShardpointError
from shardpoint.plan import Box, PlanError, Writers, balance, choose_writers
from shardpoint.plan import grid as pgrid
from shardpoint.saving import coordinator as co
from shardpoint.saving.records import IndexRecord, WriteStatus

from .test_plan import SETTINGS, _rank_layouts, _runs, even_split, layouts, pad_arrays, table_of

Rows = list[tuple[int, int, Box]]  # (key, rank, box), rank by rank


# --- the definition -------------------------------------------------------------------------

def reference(world: int, rows: Rows, key_shapes: list[tuple[int, ...]], itemsizes: list[int]) -> dict[str, Any]:
    """The save plan by its definition, one row at a time."""
    dims = max(len(s) for s in key_shapes)

    def ident(k: int, b: Box) -> tuple[int, tuple[int, ...]]:  # boxes ordered by (o0, s0, o1, s1, ...)
        o = list(b.offsets) + [0] * (dims - len(b.offsets))
        s = list(b.sizes) + [1] * (dims - len(b.sizes))
        return k, tuple(x for pair in zip(o, s, strict=True) for x in pair)

    gid = {x: i for i, x in enumerate(sorted({ident(k, b) for k, _r, b in rows}))}
    group = [gid[ident(k, b)] for k, _r, b in rows]
    members: dict[int, list[int]] = {}
    for i, g in enumerate(group):
        members.setdefault(g, []).append(i)
    replicated = [len(members[g]) > 1 for g in group]
    writer = [not x for x in replicated]
    nbytes = [b.numel * itemsizes[k] for k, _r, b in rows]
    load = [0] * world
    for i, (_k, r, _b) in enumerate(rows):
        if not replicated[i]:
            load[r] += nbytes[i]
    for g in sorted((g for g, m in members.items() if len(m) > 1), key=lambda g: (-nbytes[members[g][0]], g)):
        holders = [rows[i][1] for i in members[g]]
        r = min(holders, key=lambda q: (load[q], q))
        writer[members[g][holders.index(r)]] = True
        load[r] += nbytes[members[g][0]]
    placed: dict[int, list[tuple[tuple[int, ...], tuple[int, ...], int]]] = {k: [] for k in range(len(key_shapes))}
    for i in sorted((i for i, (_k, _r, b) in enumerate(rows) if writer[i] and b.numel), key=lambda i: group[i]):
        k, r, b = rows[i]
        o = tuple(b.offsets) + (0,) * (dims - len(b.offsets))
        s = tuple(b.sizes) + (1,) * (dims - len(b.sizes))
        placed[k].append((o, s, r))
    return {"group": group, "writer": writer, "replicated": replicated, "load": load, "placed": placed}


def observed(w: Writers, nkeys: int) -> dict[str, Any]:
    """A :class:`Writers` in the reference's terms (the placement resolved key by key)."""
    pl = w.placement
    placed = {}
    for k in range(nkeys):
        src = int(pl.same_as[k])
        idx = np.flatnonzero(pl.key == src)
        placed[k] = [(tuple(pl.offsets[i].tolist()), tuple(pl.sizes[i].tolist()), int(pl.rank[i])) for i in idx]
    return {"group": w.group.tolist(), "writer": w.writer.tolist(), "replicated": w.replicated.tolist(),
            "load": w.bytes_per_rank.tolist(), "placed": placed}


@contextlib.contextmanager
def by_rows() -> Iterator[None]:
    """Plan every table row by row (no grid path)."""
    original = ps.find_grid
    ps.find_grid = lambda *a: None  # type: ignore[assignment]
    try:
        yield
    finally:
        ps.find_grid = original  # type: ignore[assignment]


@contextlib.contextmanager
def patched(module: Any, name: str, value: Any) -> Iterator[None]:
    original = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, original)


def on_grid() -> contextlib.AbstractContextManager[None]:
    """Plan every grid by pattern, however few of its columns repeat (the small grids
    drawn here are mostly distinct columns, which the planner would plan row by row)."""
    return patched(pgrid, "_MAX_PATTERNS_PER_COLUMN", 1.0)


# --- grids ------------------------------------------------------------------------------------

POOL = [(6, 4), (6, 4), (5, 3), (9,), (4, 2), (7,), (3, 5, 2)]


@st.composite
def grid_layouts(draw):  # type: ignore[no-untyped-def]
    """Every rank holds one piece of every key and lists the keys in one order: dim-0
    shards (uneven, empty at the end; or with the last two ranks' pieces swapped),
    2-D mesh layouts (Shard/Replicate per mesh dim), whole replicas, and random cuts
    given to ranks in a random order. Shapes repeat, so keys share patterns; item
    sizes differ between keys of one pattern."""
    a, b = draw(st.integers(1, 4)), draw(st.integers(1, 4))
    world = a * b
    mesh = draw(st.sampled_from(["RS", "SR", "RR", "SS"]))
    key_shapes, itemsizes, boxes = [], [], []
    for _ in range(draw(st.integers(1, 8))):
        shape = draw(st.sampled_from(POOL))
        kind = draw(st.sampled_from(["fsdp", "swapped", "mesh", "replicated", "cuts"]))
        rest_o, rest_s = (0,) * (len(shape) - 1), tuple(shape[1:])
        if kind in ("fsdp", "swapped"):
            col = [Box((o, *rest_o), (s, *rest_s)) for o, s in even_split(shape[0], world)]
            if kind == "swapped":  # as "fsdp" but on the last two ranks: alike on a sample of the first
                col[-2:] = col[-2:][::-1]
        elif kind == "mesh":
            col = []
            for i, j in itertools.product(range(a), range(b)):
                o0, s0 = even_split(shape[0], a)[i] if mesh[0] == "S" else (0, shape[0])
                if len(shape) > 1:
                    o1, s1 = even_split(shape[1], b)[j] if mesh[1] == "S" else (0, shape[1])
                    col.append(Box((o0, o1, *rest_o[1:]), (s0, s1, *rest_s[1:])))
                else:
                    col.append(Box((o0,), (s0,)))
        elif kind == "replicated":
            col = [Box((0,) * len(shape), shape)] * world
        else:
            cuts = sorted(draw(st.lists(st.integers(0, shape[0]), min_size=world - 1, max_size=world - 1)))
            edges = [0, *cuts, shape[0]]
            pieces = [Box((lo, *rest_o), (hi - lo, *rest_s)) for lo, hi in zip(edges, edges[1:])]
            col = [pieces[p] for p in draw(st.permutations(range(world)))]
        key_shapes.append(shape)
        itemsizes.append(draw(st.sampled_from([1, 2, 4])))
        boxes.append(col)
    order = draw(st.permutations(range(len(key_shapes))))
    rows = [(k, r, boxes[k][r]) for r in range(world) for k in order]
    return world, rows, key_shapes, itemsizes


@SETTINGS
@given(grid_layouts(), st.sampled_from([64, 2, 1]))
def test_grid_plans_are_the_sequential_rule(case, sample) -> None:  # type: ignore[no-untyped-def]
    """A grid is planned per pattern (proposed from ``sample`` ranks, then checked on
    every rank), and gives what the definition and the row-by-row planner give."""
    world, rows, key_shapes, itemsizes = case
    t, shp = table_of(rows, key_shapes, itemsizes)
    with patched(pgrid, "_SAMPLE_RANKS", sample), on_grid():
        grid = pgrid.find_grid(t, shp, world)
        assert grid is not None
        got = observed(choose_writers(t, shp, world), len(key_shapes))
    assert got == reference(world, rows, key_shapes, itemsizes)
    with by_rows():
        assert observed(choose_writers(t, shp, world), len(key_shapes)) == got


@SETTINGS
@given(layouts())
def test_row_plans_are_the_sequential_rule(case) -> None:  # type: ignore[no-untyped-def]
    """Tables that are no grid (pipeline stages, keys listed in different orders)."""
    world, rows, key_shapes, itemsizes, _kinds = case
    t, shp = table_of(rows, key_shapes, itemsizes)
    assert observed(choose_writers(t, shp, world), len(key_shapes)) == reference(world, rows, key_shapes, itemsizes)


@SETTINGS
@given(grid_layouts(), st.data())
def test_grid_errors_name_the_keys_row_plans_name(case, data) -> None:  # type: ignore[no-untyped-def]
    """One rank's piece moved, shrunk or grown, in one key or in every key of its
    pattern: the grid path names the same keys, for the same reasons."""
    world, rows, key_shapes, itemsizes = case
    i = data.draw(st.integers(0, len(rows) - 1))
    k0, r0, b = rows[i]
    column = [bb for kk, _r, bb in sorted(rows, key=lambda x: x[1]) if kk == k0]
    alike = [k for k in range(len(key_shapes)) if key_shapes[k] == key_shapes[k0]
             and [bb for kk, _r, bb in sorted(rows, key=lambda x: x[1]) if kk == k] == column]
    hit = set(data.draw(st.sampled_from([[k0], alike])))
    how = data.draw(st.sampled_from(["outside", "shrink", "grow", "move"]))
    shape = key_shapes[k0]

    def damage(box: Box) -> Box:
        o, s = list(box.offsets), list(box.sizes)
        if how == "outside":
            o[0] = shape[0] - s[0] + 1
        elif how == "shrink" and s[0] > 0:
            s[0] -= 1
        elif how == "grow" and o[0] + s[0] < shape[0]:
            s[0] += 1
        elif how == "grow" and o[0] > 0:
            o[0], s[0] = o[0] - 1, s[0] + 1
        else:
            o[0] = (o[0] + 1) % (shape[0] - s[0] + 1)
        return Box(tuple(o), tuple(s))

    rows = [(k, r, damage(bb) if k in hit and r == r0 else bb) for k, r, bb in rows]
    t, shp = table_of(rows, key_shapes, itemsizes)
    outcome: list[tuple[str, Any]] = []
    for ctx in (on_grid(), by_rows()):
        with ctx:
            try:
                outcome.append(("planned", observed(choose_writers(t, shp, world), len(key_shapes))))
            except PlanError as e:
                outcome.append(("refused", e.problems))
    assert outcome[0] == outcome[1]
    if how == "outside":
        assert outcome[0][0] == "refused" and hit <= set(outcome[0][1]), outcome[0]


def test_a_grid_with_no_pattern_shared_and_a_scalar() -> None:
    """Scalars (no dims) and keys of one element per rank: each key its own pattern."""
    world = 3
    rows = [(k, r, Box((), ())) if k == 0 else (k, r, Box((r,), (1,))) for r in range(world) for k in (1, 0)]
    t, shp = table_of(rows, [(), (3,)], [8, 4])
    assert pgrid.find_grid(t, shp, world) is None  # all columns distinct: planned row by row
    with on_grid():
        assert pgrid.find_grid(t, shp, world) is not None
        assert observed(choose_writers(t, shp, world), 2) == reference(world, rows, [(), (3,)], [8, 4])


def test_a_grid_is_planned_by_pattern_when_its_columns_repeat() -> None:
    """Ten keys, two layouts (dim-0 shards, whole replicas): two patterns."""
    world = 4
    rows = [(k, r, Box((2 * r, 0), (2, 3)) if k % 2 else Box((0, 0), (8, 3))) for r in range(world) for k in range(10)]
    t, shp = table_of(rows, [(8, 3)] * 10, [4] * 10)
    grid = pgrid.find_grid(t, shp, world)
    assert grid is not None and len(grid.rep_col) == 2
    assert observed(choose_writers(t, shp, world), 10) == reference(world, rows, [(8, 3)] * 10, [4] * 10)


# --- the batched balance ------------------------------------------------------------------------

@SETTINGS
@given(st.data())
def test_batched_choice_is_the_sequential_rule(data) -> None:  # type: ignore[no-untyped-def]
    """Groups with overlapping, disjoint, shared and repeated holders, ties and empty
    groups: batches of disjoint groups choose what one group at a time chooses."""
    world = data.draw(st.integers(1, 6))
    disjoint = data.draw(st.booleans())  # holder lists that partition the ranks (HSDP's replica sets)
    if disjoint:
        perm = data.draw(st.permutations(range(world)))
        cuts = sorted(set(data.draw(st.lists(st.integers(1, max(1, world - 1)), max_size=3))) | {0, world})
        lists = [list(perm[a:b]) for a, b in zip(cuts, cuts[1:]) if b > a]
        lists += [list(h) for h in data.draw(st.lists(st.sampled_from(lists), max_size=2))]  # equal lists, other ids
    else:
        lists = data.draw(st.lists(st.lists(st.integers(0, world - 1), min_size=1, max_size=5), min_size=1, max_size=8))
    sets = data.draw(st.lists(st.integers(0, len(lists) - 1), max_size=14))  # each group's holder list
    nbytes = data.draw(st.lists(st.sampled_from([0, 1, 2, 5, 8]), min_size=len(sets), max_size=len(sets)))
    start = data.draw(st.lists(st.integers(0, 9), min_size=world, max_size=world))
    load, want = list(start), []
    for g in sorted(range(len(sets)), key=lambda g: -nbytes[g]):
        holders = lists[sets[g]]
        r = min(holders, key=lambda q: (load[q], q))
        want.append((g, holders.index(r)))
        load[r] += nbytes[g]
    starts = np.concatenate([[0], np.cumsum([len(h) for h in lists])]).astype(np.int64)
    flat = np.array([q for h in lists for q in h], dtype=np.int64)
    for small in (balance._SMALL_BATCH, 0):
        for shared in (True, False):  # one list per group, or the lists named by ``sets``
            got_load = np.array(start, dtype=np.int64)
            if shared:
                holders, at, group_sets = flat, starts, np.array(sets, dtype=np.int64)
            else:
                holders = np.array([q for g in sets for q in lists[g]], dtype=np.int64)
                at = np.concatenate([[0], np.cumsum([len(lists[g]) for g in sets])]).astype(np.int64)
                group_sets = None
            with patched(balance, "_SMALL_BATCH", small):
                pick = balance.choose(got_load, holders, at, np.array(nbytes, dtype=np.int64), group_sets)
            first = at[group_sets] if shared else at[:-1]
            assert sorted((g, int(pick[g] - first[g])) for g in range(len(sets))) == sorted(want)
            assert got_load.tolist() == load


# --- through the coordinator ------------------------------------------------------------------------

@SETTINGS
@given(grid_layouts())
def test_grid_manifests_and_assignments_are_the_row_by_row_ones(case) -> None:  # type: ignore[no-untyped-def]
    """The coordinator on a grid (boxes packed as messages carry them, tensors of
    fewer dims padded): the same chunk table as from nested lists, and the manifest
    entries and assignments the row-by-row planner gives."""
    world, rows, key_shapes, _itemsizes = case
    nested = _rank_layouts(world, rows, key_shapes)
    packed = []
    for r, lay in enumerate(nested):
        _digest, msg = co.layout_message(lay, None)
        packed.append(co._full_layout(msg["s"], msg["b"], r))
    with on_grid():
        plan = co.make_plan(packed)
        nested_plan = co.make_plan(nested)
    for name in ("key", "rank", "offsets", "sizes", "itemsize"):
        assert np.array_equal(getattr(plan.table, name), getattr(nested_plan.table, name)), name
    _keys, off, size, _shapes = pad_arrays([k for k, _r, _b in rows], [b for _k, _r, b in rows], key_shapes)
    assert plan.table.offsets.tolist() == off.tolist() and plan.table.sizes.tolist() == size.tolist()
    assert [plan.keys[k] for k in plan.table.key.tolist()] == [f"k{k}" for k, _r, _b in rows]
    statuses = [WriteStatus(f"f{r}", 1, IndexRecord("i", 1, "0")) for r in range(world)]
    values = [{"values": {}, "per_rank": {}}] * world
    with by_rows():
        slow = co.make_plan(nested)
    assert co.build_manifest(plan, values, statuses, "s").tree.entries == \
        co.build_manifest(slow, values, statuses, "s").tree.entries
    assert co.assignments(plan) == co.assignments(slow)
    for r, a in enumerate(co.assignments(plan)):
        lo, hi = int(plan.row_start[r]), int(plan.row_start[r + 1])
        assert a["write"] == [[i, j] for i, j in _runs(plan.writer[lo:hi].tolist())]
        assert a["check"] == [[i, j] for i, j in _runs(plan.check[lo:hi].tolist())]


def test_replicas_that_differ_on_a_grid_name_the_key_and_ranks() -> None:
    """HSDP-like: two replicas of each half; rank 3's copy of key 'k1' differs."""
    rows = [(k, r, Box((r % 2 * 2, 0), (2, 2))) for r in range(4) for k in range(2)]
    plan = co.make_plan(_rank_layouts(4, rows, [(4, 2), (4, 2)]))
    good = []
    for r in range(4):
        lo, hi = int(plan.row_start[r]), int(plan.row_start[r + 1])
        rr = np.flatnonzero(plan.check[lo:hi]).tolist()
        good.append(WriteStatus(f"f{r}", 1, IndexRecord("i", 1, "0"), tuple(rr),
                                tuple(int(plan.group[lo + i]) for i in rr)))
    co.check_replicas(plan, good)
    bad = list(good)
    bad[3] = WriteStatus("f3", 1, IndexRecord("i", 1, "0"), good[3].replica_rows,
                         (good[3].replica_digests[0], 99))
    with pytest.raises(ShardpointError, match=r"key 'k1' is replicated but its bytes differ between ranks \(ranks \[1\]; ranks \[3\]"):
        co.check_replicas(plan, bad)
