"""The pure planning code against brute force: box intersection and runs, flat
ranges, save plans (one writer per distinct box, balanced replicated bytes, named
layout errors), partition checks and read plans."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardpoint import errors
from shardpoint.errors import ShardpointError
from shardpoint.plan import (
    Box,
    ChunkTable,
    PlanError,
    box_runs,
    choose_writers,
    intersect,
    plan_reads,
    validate_partition,
)
from shardpoint.plan.boxes import flat_range_boxes

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# --- strategies ---------------------------------------------------------------------

shapes = st.lists(st.integers(1, 6), min_size=1, max_size=3).map(tuple)


@st.composite
def box_in(draw, shape: tuple[int, ...], allow_empty: bool = False) -> Box:
    offs, sizes = [], []
    for d in shape:
        o = draw(st.integers(0, d if allow_empty else d - 1))
        s = draw(st.integers(0 if allow_empty else 1, d - o))
        offs.append(o)
        sizes.append(s)
    return Box(tuple(offs), tuple(sizes))


@st.composite
def tiling(draw, shape: tuple[int, ...], max_depth: int = 4) -> list[Box]:
    """A random guillotine partition of ``shape`` (not only grids)."""

    def split(off: tuple[int, ...], size: tuple[int, ...], depth: int) -> list[Box]:
        dims = [d for d, s in enumerate(size) if s >= 2]
        if depth == 0 or not dims or draw(st.booleans()):
            return [Box(off, size)]
        d = draw(st.sampled_from(dims))
        cut = draw(st.integers(1, size[d] - 1))
        a_size = size[:d] + (cut,) + size[d + 1 :]
        b_off = off[:d] + (off[d] + cut,) + off[d + 1 :]
        b_size = size[:d] + (size[d] - cut,) + size[d + 1 :]
        return split(off, a_size, depth - 1) + split(b_off, b_size, depth - 1)

    return split((0,) * len(shape), shape, max_depth)


def cells(b: Box) -> set[tuple[int, ...]]:
    return set(itertools.product(*(range(o, o + s) for o, s in zip(b.offsets, b.sizes, strict=False))))


def flat_index(cell: tuple[int, ...], within: Box) -> int:
    i = 0
    for c, o, s in zip(cell, within.offsets, within.sizes, strict=False):
        i = i * s + (c - o)
    return i


# --- boxes --------------------------------------------------------------------------

@SETTINGS
@given(st.data())
def test_intersect_matches_cell_sets(data) -> None:  # type: ignore[no-untyped-def]
    shape = data.draw(shapes)
    a, b = data.draw(box_in(shape, allow_empty=True)), data.draw(box_in(shape, allow_empty=True))
    r = intersect(a, b)
    want = cells(a) & cells(b)
    if not want:
        assert r is None
    else:
        assert r is not None and r.within(shape) and cells(r) == want
    assert intersect(b, a) == r


def test_intersect_scalar_and_touching() -> None:
    assert intersect(Box((), ()), Box((), ())) == Box((), ())
    assert intersect(Box((0, 0), (2, 3)), Box((2, 0), (2, 3))) is None  # touching is not overlapping


@SETTINGS
@given(st.data())
def test_box_runs_matches_brute_force(data) -> None:  # type: ignore[no-untyped-def]
    shape = data.draw(shapes)
    within = data.draw(box_in(shape))
    rel = data.draw(box_in(within.sizes))
    region = Box(tuple(o + w for o, w in zip(rel.offsets, within.offsets, strict=False)), rel.sizes)
    first, last, run, count = box_runs(region, within)
    idx = sorted(flat_index(c, within) for c in cells(region))
    assert first == idx[0] and last == idx[-1] + 1
    # maximal contiguous runs of the region's elements in the row-major layout of `within`
    runs, start = [], idx[0]
    for a, b in zip(idx, idx[1:] + [None], strict=False):
        if b != a + 1:
            runs.append(a + 1 - start)
            start = b
    assert count == len(runs) and all(n == run for n in runs), (region, within, runs, run, count)


def test_box_runs_scalar() -> None:
    assert box_runs(Box((), ()), Box((), ())) == (0, 1, 1, 1)


@SETTINGS
@given(st.data())
def test_flat_range_boxes_tile_the_range_in_order(data) -> None:  # type: ignore[no-untyped-def]
    shape = tuple(data.draw(st.lists(st.integers(1, 5), min_size=1, max_size=4)))
    numel = int(np.prod(shape))
    start = data.draw(st.integers(0, numel))
    stop = data.draw(st.integers(start, numel))
    boxes = flat_range_boxes(shape, start, stop)
    whole = Box((0,) * len(shape), shape)
    got: list[int] = []
    for b in boxes:
        assert b.within(shape) and b.numel > 0
        # each box is one contiguous range of the flattening, and they follow each other
        first, last, _run, count = box_runs(b, whole)
        assert count == 1 and last - first == b.numel
        got.extend(range(first, last))
    assert got == list(range(start, stop))
    assert len(boxes) <= 2 * len(shape) + 1


def test_flat_range_boxes_scalar_and_empty() -> None:
    assert flat_range_boxes((), 0, 1) == [Box((), ())]
    assert flat_range_boxes((3, 4), 5, 5) == []
    assert flat_range_boxes((3, 4), 0, 12) == [Box((0, 0), (3, 4))]


# --- validate_partition against a rasteriser ------------------------------------------

def raster_problems(keys: list[int], boxes: list[Box], key_shapes: list[tuple[int, ...]]) -> set[int]:
    bad = set()
    for k, shape in enumerate(key_shapes):
        cover = np.zeros(shape, dtype=np.int64)
        for kk, b in zip(keys, boxes, strict=False):
            if kk == k:
                cover[tuple(slice(o, o + s) for o, s in zip(b.offsets, b.sizes, strict=False))] += 1
        if (cover != 1).any():
            bad.add(k)
    return bad


def pad_arrays(keys: list[int], boxes: list[Box], key_shapes: list[tuple[int, ...]]):  # type: ignore[no-untyped-def]
    D = max(len(s) for s in key_shapes)
    off = np.array([list(b.offsets) + [0] * (D - len(b.offsets)) for b in boxes], dtype=np.int64).reshape(-1, D)
    siz = np.array([list(b.sizes) + [1] * (D - len(b.sizes)) for b in boxes], dtype=np.int64).reshape(-1, D)
    shp = np.array([list(s) + [1] * (D - len(s)) for s in key_shapes], dtype=np.int64)
    return np.array(keys, dtype=np.int64), off, siz, shp


@st.composite
def box_sets(draw):  # type: ignore[no-untyped-def]
    """Several keys, each a tiling, perhaps damaged: a box dropped, grown, moved or
    replaced by random boxes."""
    nkeys = draw(st.integers(1, 4))
    key_shapes, keys, boxes = [], [], []
    for k in range(nkeys):
        shape = draw(shapes)
        bs = draw(tiling(shape))
        how = draw(st.sampled_from(["ok", "ok", "drop", "grow", "move", "dup", "random"]))
        if how == "drop" and len(bs) > 1:
            bs.pop(draw(st.integers(0, len(bs) - 1)))
        elif how == "grow":
            i = draw(st.integers(0, len(bs) - 1))
            b = bs[i]
            d = draw(st.integers(0, len(shape) - 1))
            if b.offsets[d] + b.sizes[d] < shape[d]:
                bs[i] = Box(b.offsets, b.sizes[:d] + (b.sizes[d] + 1,) + b.sizes[d + 1 :])
        elif how == "move":
            i = draw(st.integers(0, len(bs) - 1))
            bs[i] = draw(box_in(shape)) if draw(st.booleans()) else bs[i]
        elif how == "dup":
            bs.append(bs[draw(st.integers(0, len(bs) - 1))])
        elif how == "random":
            bs = draw(st.lists(box_in(shape), min_size=1, max_size=5))
        key_shapes.append(shape)
        keys += [k] * len(bs)
        boxes += bs
    order = draw(st.permutations(range(len(boxes))))
    return [keys[i] for i in order], [boxes[i] for i in order], key_shapes


@SETTINGS
@given(box_sets())
def test_validate_partition_matches_rasteriser(case) -> None:  # type: ignore[no-untyped-def]
    keys, boxes, key_shapes = case
    want = raster_problems(keys, boxes, key_shapes)
    if not want:
        validate_partition(*pad_arrays(keys, boxes, key_shapes))
        return
    with pytest.raises(PlanError) as ei:
        validate_partition(*pad_arrays(keys, boxes, key_shapes))
    assert set(ei.value.problems) == want
    for k in want:
        assert f"key {k}:" in str(ei.value)


def test_validate_partition_pairwise_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    """Huge grids fall back to a pairwise overlap check; it must agree."""
    import shardpoint.plan.save as ps

    monkeypatch.setattr(ps, "_GRID_CELL_LIMIT", 1)
    shape = (4, 4)
    ok = [Box((0, 0), (2, 4)), Box((2, 0), (2, 2)), Box((2, 2), (2, 2))]
    validate_partition(*pad_arrays([0] * 3, ok, [shape]))
    overlap = [Box((0, 0), (3, 4)), Box((2, 0), (2, 2)), Box((2, 2), (2, 2))]
    with pytest.raises(PlanError, match="overlap"):
        validate_partition(*pad_arrays([0] * 3, overlap, [shape]))
    gap = ok[:2]
    with pytest.raises(PlanError, match="gap"):
        validate_partition(*pad_arrays([0] * 2, gap, [shape]))


# --- choose_writers ----------------------------------------------------------------------

def even_split(n: int, parts: int) -> list[tuple[int, int]]:
    """torch.chunk-style split of n into `parts` (offset, size) pieces; trailing
    pieces may be empty, like uneven DTensor shards."""
    step = -(-n // parts)
    return [(min(i * step, n), max(0, min(n, (i + 1) * step) - min(i * step, n))) for i in range(parts)]


@st.composite
def layouts(draw, stages: bool = True):  # type: ignore[no-untyped-def]
    """What every rank holds of a few tensors: FSDP-like dim-0 shards, 2-D mesh
    layouts with Shard/Replicate per mesh dim (one pattern per example, so the
    replica groups partition the ranks), and tensors replicated on all ranks or on a
    subset (pipeline stages)."""
    a = draw(st.integers(1, 3))
    b = draw(st.integers(1, 3))
    world = a * b
    pattern = draw(st.sampled_from(["RS", "SR", "RR", "SS"]))
    rows: list[tuple[int, int, Box]] = []  # (key, rank, box)
    key_shapes: list[tuple[int, ...]] = []
    itemsizes: list[int] = []
    kinds: list[str] = []
    for k in range(draw(st.integers(1, 6))):
        shape = (draw(st.integers(1, 9)), draw(st.integers(1, 7)))
        kinds_ok = ["fsdp", "mesh"]
        if stages or pattern in ("RR", "SS"):  # else whole-job replicas would straddle the mesh's replica sets
            kinds_ok.append("replicated")
        if stages:
            kinds_ok.append("stage")
        kind = draw(st.sampled_from(kinds_ok))
        key_shapes.append(shape)
        itemsizes.append(draw(st.sampled_from([1, 2, 4, 8])))
        kinds.append(kind)
        if kind == "fsdp":
            for r, (o, s) in enumerate(even_split(shape[0], world)):
                rows.append((k, r, Box((o, 0), (s, shape[1]))))
        elif kind == "mesh":
            for i, j in itertools.product(range(a), range(b)):
                r = i * b + j
                o0, s0 = even_split(shape[0], a)[i] if pattern[0] == "S" else (0, shape[0])
                o1, s1 = even_split(shape[1], b)[j] if pattern[1] == "S" else (0, shape[1])
                rows.append((k, r, Box((o0, o1), (s0, s1))))
        elif kind == "replicated":
            for r in range(world):
                rows.append((k, r, Box((0, 0), shape)))
        else:
            holders = draw(st.lists(st.integers(0, world - 1), min_size=1, max_size=world, unique=True))
            for r in holders:
                rows.append((k, r, Box((0, 0), shape)))
    rows = [rows[i] for i in draw(st.permutations(range(len(rows))))]
    rows.sort(key=lambda x: x[1])  # rows come grouped by rank, as in make_plan
    return world, rows, key_shapes, itemsizes, kinds


def table_of(rows, key_shapes, itemsizes):  # type: ignore[no-untyped-def]
    keys = [k for k, _r, _b in rows]
    k_arr, off, siz, shp = pad_arrays(keys, [b for _k, _r, b in rows], key_shapes)
    t = ChunkTable(key=k_arr, rank=np.array([r for _k, r, _b in rows], dtype=np.int64), offsets=off, sizes=siz,
                   itemsize=np.array([itemsizes[k] for k in keys], dtype=np.int64))
    return t, shp


@SETTINGS
@given(layouts())
def test_plan_save_one_writer_per_distinct_box(case) -> None:  # type: ignore[no-untyped-def]
    world, rows, key_shapes, itemsizes, _kinds = case
    t, shp = table_of(rows, key_shapes, itemsizes)
    plan = choose_writers(t, shp, world)
    by_box: dict[tuple, list[int]] = {}
    for i, (k, _r, b) in enumerate(rows):
        by_box.setdefault((k, b.offsets, b.sizes), []).append(i)
    for ident, idx in by_box.items():
        writers = [i for i in idx if plan.writer[i]]
        assert len(writers) == 1, f"box {ident} has writers {writers}"
        assert len({int(plan.group[i]) for i in idx}) == 1
        assert all(bool(plan.replicated[i]) == (len(idx) > 1) for i in idx)
    assert len(np.unique(plan.group)) == len(by_box)
    load = np.zeros(world, dtype=np.int64)
    for i, (k, r, b) in enumerate(rows):
        if plan.writer[i]:
            load[r] += b.numel * itemsizes[k]
    assert plan.bytes_per_rank.tolist() == load.tolist()


@SETTINGS
@given(layouts(stages=False))  # replica sets that partition the ranks
def test_plan_save_balances_replicated_bytes(case) -> None:  # type: ignore[no-untyped-def]
    """Within each set of ranks that hold the same replicas, the spread of written
    bytes is no more than the largest replicated chunk (or than the spread the
    unreplicated chunks already force)."""
    world, rows, key_shapes, itemsizes, _kinds = case
    t, shp = table_of(rows, key_shapes, itemsizes)
    plan = choose_writers(t, shp, world)
    holders: dict[int, set[int]] = {}
    for i, (_k, r, b) in enumerate(rows):
        if b.numel:  # empty shards of uneven layouts carry no bytes
            holders.setdefault(int(plan.group[i]), set()).add(r)
    rep_sets = {frozenset(h) for g, h in holders.items() if len(h) > 1}
    nb = {i: rows[i][2].numel * itemsizes[rows[i][0]] for i in range(len(rows))}
    single = np.zeros(world, dtype=np.int64)
    for i, (_k, r, _b) in enumerate(rows):
        if not plan.replicated[i]:
            single[r] += nb[i]
    for s in rep_sets:
        assert all(s == o or not (s & o) for o in rep_sets), "test layout: replica sets must partition the ranks"
        members = sorted(s)
        largest = max(nb[i] for i in range(len(rows)) if plan.replicated[i] and rows[i][1] in s)
        loads = plan.bytes_per_rank[members]
        base = single[members]
        assert loads.max() - loads.min() <= max(largest, base.max() - base.min()), (members, loads, largest)


def test_plan_save_ddp_balance_is_tight() -> None:
    """Eight equal replicated tensors on four ranks: two each, not all on rank 0."""
    rows = [(k, r, Box((0,), (10,))) for r in range(4) for k in range(8)]
    t, shp = table_of(rows, [(10,)] * 8, [4] * 8)
    plan = choose_writers(t, shp, 4)
    assert plan.bytes_per_rank.tolist() == [80, 80, 80, 80]



def test_plan_save_groups_replicas_of_huge_tensors_too() -> None:
    """Boxes of a tensor too large for one 62-bit box code are grouped column by
    column: the same replicas, writers and balance as for a small tensor."""
    for n in (12, 1 << 20):  # a box code of (n, n, n) needs 6 x 20 bits when n = 2**20: no single int64
        half = n // 2
        rows = [(0, r, Box((0, 0, 0), (half, n, n))) for r in (0, 2)] + [(0, r, Box((half, 0, 0), (n - half, n, n))) for r in (1, 3)]
        t, shp = table_of(rows, [(n, n, n)], [1])
        plan = choose_writers(t, shp, 4)
        assert plan.replicated.all() and plan.writer.sum() == 2
        assert plan.group[0] == plan.group[1] != plan.group[2] == plan.group[3]
        assert plan.bytes_per_rank.sum() == n ** 3 and (plan.bytes_per_rank > 0).sum() == 2


@SETTINGS
@given(layouts(), st.data())
def test_plan_save_names_the_broken_key(case, data) -> None:  # type: ignore[no-untyped-def]
    world, rows, key_shapes, itemsizes, _kinds = case
    k = data.draw(st.integers(0, len(key_shapes) - 1))
    mine = [i for i, x in enumerate(rows) if x[0] == k and x[2].numel > 0]
    how = data.draw(st.sampled_from(["gap", "overlap", "outside"]))
    shape = key_shapes[k]
    i = data.draw(st.sampled_from(mine))
    kk, r, b = rows[i]
    if how == "gap":
        ident = (b.offsets, b.sizes)
        rows = [x for x in rows if not (x[0] == k and (x[2].offsets, x[2].sizes) == ident)]
    elif how == "overlap":
        existing = {(x[2].offsets, x[2].sizes) for x in rows if x[0] == k}
        cands = [Box((0, 0), shape)] + [Box(c, (1, 1)) for c in itertools.product(range(shape[0]), range(shape[1]))]
        extra = next((c for c in cands if (c.offsets, c.sizes) not in existing), None)
        if extra is None:  # a 1x1 tensor held whole: nothing distinct can overlap it
            how = "outside"
        else:
            rows = rows + [(k, r, extra)]
    if how == "outside":
        rows[i] = (kk, r, Box((shape[0] - b.sizes[0] + 1, b.offsets[1]), b.sizes))
    t, shp = table_of(rows, key_shapes, itemsizes)
    with pytest.raises(PlanError) as ei:
        choose_writers(t, shp, world)
    assert k in ei.value.problems, (how, ei.value.problems)
    assert f"key {k}:" in str(ei.value)
    assert how in ei.value.problems[k]


def test_plan_save_outside_the_shape() -> None:
    rows = [(0, 0, Box((0,), (4,))), (0, 1, Box((4,), (3,)))]
    t, shp = table_of(rows, [(6,)], [4])
    with pytest.raises(PlanError, match="key 0: a chunk lies outside"):
        choose_writers(t, shp, 2)


# --- plan_reads ----------------------------------------------------------------------

@SETTINGS
@given(st.data())
def test_plan_reads_covers_targets_exactly(data) -> None:  # type: ignore[no-untyped-def]
    shape = data.draw(shapes)
    saved = data.draw(tiling(shape))
    targets = data.draw(st.one_of(tiling(shape), st.lists(box_in(shape), min_size=1, max_size=4)))
    ops = plan_reads(saved, targets)
    # brute force: element -> (saved chunk, flat index inside it)
    where = {}
    for si, s in enumerate(saved):
        for c in cells(s):
            where[c] = (si, flat_index(c, s))
    got: dict[int, list[tuple[int, ...]]] = {ti: [] for ti in range(len(targets))}
    for op in ops:
        s, t = saved[op.source], targets[op.target]
        assert op.region.numel > 0 and cells(op.region) <= cells(s) & cells(t)
        idx = [where[c][1] for c in cells(op.region)]
        assert all(where[c][0] == op.source for c in cells(op.region))
        assert op.first == min(idx) and op.last == max(idx) + 1
        got[op.target].extend(cells(op.region))
    for ti, t in enumerate(targets):
        assert sorted(got[ti]) == sorted(cells(t)), f"target {t} not covered exactly once"


@SETTINGS
@given(st.data())
def test_plan_reads_in_arrays_plans_what_box_by_box_plans(data) -> None:  # type: ignore[no-untyped-def]
    from shardpoint.plan import read as plan_read

    shape = data.draw(shapes)
    saved = data.draw(tiling(shape))
    targets = data.draw(st.one_of(tiling(shape), st.lists(box_in(shape), min_size=1, max_size=4)))
    old = plan_read.ARRAY_MIN
    try:
        plan_read.ARRAY_MIN = 1 << 30
        by_box = plan_reads(saved, targets)
        plan_read.ARRAY_MIN = 1
        assert plan_reads(saved, targets) == by_box
    finally:
        plan_read.ARRAY_MIN = old


def test_plan_reads_many_chunks_into_a_few_targets() -> None:
    # Shard(0) over 1,024 saving ranks, read by 3 ranks (rows cut where no saved chunk is)
    saved = [Box((4 * r, 0), (4, 6)) for r in range(1024)]
    targets = [Box((0, 0), (1366, 6)), Box((1366, 0), (1365, 6)), Box((2731, 0), (1365, 6))]
    ops = plan_reads(saved, targets)
    assert [sum(op.region.numel for op in ops if op.target == t) for t in range(3)] == [b.numel for b in targets]
    first = [op for op in ops if op.target == 1][0]  # row 1366 lies in the chunk of rows 1364..1367
    assert first.source == 341 and first.region == Box((1366, 0), (2, 6)) and (first.first, first.last) == (12, 24)
    assert len(ops) == 1024 + 2  # two chunks are cut between two targets


def test_plan_reads_raises_on_uncovered_target() -> None:
    with pytest.raises(ValueError, match="only partly covered"):
        plan_reads([Box((0,), (3,))], [Box((0,), (5,))])


# --- the coordinator's plan cache (pure: messages as they arrive on rank 0) -----------------

def _coord_msgs(world: int, rows: int, held: str | None = None, changed: int | None = None) -> list[dict]:
    """Messages of ``world`` ranks, each holding rows [r*rows, (r+1)*rows) of one tensor
    (rank ``changed`` holds one row fewer at the end: a different layout)."""
    from shardpoint.saving.coordinator import layout_message

    ref = None
    out = []
    for r in range(world):
        n = rows - 1 if r == changed else rows
        layout = {"containers": {"": "dict"}, "tensors": {"w": {"dtype": "float32", "shape": [world * rows, 2], "numpy": False}},
                  "chunks": {"key": ["w"], "off": [[r * rows, 0]], "size": [[n, 2]]}, "per_rank": {}}
        if r == changed:  # the rest of its rows as a second chunk
            layout["chunks"] = {"key": ["w", "w"], "off": [[r * rows, 0], [r * rows + n, 0]], "size": [[n, 2], [1, 2]]}
        digest, lay = layout_message(layout, ref)
        ref = ref or lay["sd"]
        out.append({"digest": digest, "plan": held, "layout": None if held else lay, "values": {"values": {}, "per_rank": {}}})
    return out


def test_coordinator_reuses_its_plan_only_for_the_same_layout() -> None:
    from shardpoint.runtime import PROCESS
    from shardpoint.saving import coordinator as co

    PROCESS.forget_plans()
    first = co.Coordinator("t", 4).plan_round(_coord_msgs(4, 3))
    plan_id = first[0]["plan_id"]
    assert all(r["assign"] == {"write": [[0, 1]], "check": []} for r in first)
    # only rank 0 sent its structure; the others left theirs out
    assert [m["layout"]["s"] is None for m in _coord_msgs(4, 3)] == [False, True, True, True]
    again = co.Coordinator("t", 4)
    second = again.plan_round(_coord_msgs(4, 3, held=plan_id))
    assert again.reused and [r["assign"] for r in second] == [None] * 4 and second[0]["plan_id"] == plan_id
    # one rank's layout changed: planned afresh, every rank told its new assignment
    msgs = _coord_msgs(4, 3, changed=2)
    for m in msgs[:2] + msgs[3:]:
        m.update(layout=None, plan=plan_id)
    changed = co.Coordinator("t", 4)
    third = changed.plan_round(msgs)
    assert not changed.reused and third[0]["plan_id"] != plan_id
    assert third[2]["assign"] == {"write": [[0, 2]], "check": []} and third[0]["assign"] == {"write": [[0, 1]], "check": []}
    # the coordinator lost its cache (a restarted rank 0): ranks that sent only a digest are asked again
    PROCESS.forget_plans()
    lost = co.Coordinator("t", 4)
    ask = lost.plan_round(_coord_msgs(4, 3, held=third[0]["plan_id"]))
    assert ask == [{"resend": True}] * 4
    full = _coord_msgs(4, 3)
    answer = lost.plan_round([{"layout": dict(m["layout"], s=full[0]["layout"]["s"])} for m in full])
    assert all(r["assign"] == {"write": [[0, 1]], "check": []} for r in answer)
    PROCESS.forget_plans()


def _layout(tensors: dict, keys: list, offs: list, sizes: list) -> dict:
    return {"containers": {"": "dict"}, "tensors": tensors, "chunks": {"key": keys, "off": offs, "size": sizes},
            "per_rank": {}}


def test_coordinator_errors_name_the_rank_and_the_key() -> None:
    """The coordinator's two structural errors name the rank (and key) and what to do."""
    from shardpoint.saving import coordinator as co

    t = {"w": {"dtype": "float32", "shape": [4], "numpy": False}}
    good = _layout(t, ["w"], [[0]], [[4]])
    # rank 1 describes a 1-D tensor's chunk with two dimensions
    bad = _layout(t, ["w"], [[0, 0]], [[4, 1]])
    with pytest.raises(errors.InternalError, match=r"rank 1 described chunks whose number of dimensions differs"):
        co.make_plan([good, bad])
    # a tensor at 'w' on rank 0, a plain value at 'w' on rank 1
    plan = co.make_plan([good, _layout({}, [], [], [])])
    with pytest.raises(ShardpointError, match=r"key 'w' is a tensor on some ranks and a plain value on rank 1"):
        co.merge_values(plan, [{"values": {}}, {"values": {"w": ["int", "3"]}}])


def test_a_0d_tensor_beside_a_1_element_tensor_keeps_its_own_layout(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Their padded boxes are the same, so the plan lists them as one pattern (as AdamW's
    ``step`` and a 1-element bias are on one process); each manifest entry still has
    one cut per dimension of its own tensor, and the checkpoint reads back."""
    import torch

    import shardpoint

    state = {"a": torch.tensor(2.0), "b": torch.ones(1), "c": torch.tensor(5.0), "d": torch.full((1,), 7.0)}
    shardpoint.save(state, tmp_path / "ck")
    entries = shardpoint.metadata(tmp_path / "ck")
    assert {k: entries.tensors[k].shape for k in state} == {"a": (), "b": (1,), "c": (), "d": (1,)}
    back = shardpoint.load_full(tmp_path / "ck")
    assert all(torch.equal(back[k], v) and back[k].shape == v.shape for k, v in state.items())


def _rank_layouts(world, rows, key_shapes):  # type: ignore[no-untyped-def]
    """Per-rank layout descriptions (as ranks send them) of a ``layouts()`` case."""
    tensors = {f"k{k}": {"dtype": "float32", "shape": list(s), "numpy": False} for k, s in enumerate(key_shapes)}
    out = []
    for r in range(world):
        mine = [(k, b) for k, rr, b in rows if rr == r]
        out.append(_layout({f"k{k}": tensors[f"k{k}"] for k, _ in mine}, [f"k{k}" for k, _ in mine],
                           [list(b.offsets) for _, b in mine], [list(b.sizes) for _, b in mine]))
    return out


@SETTINGS
@given(layouts(), st.permutations(range(9)))
def test_the_manifests_fast_paths_agree_with_the_general_ones(case, perm) -> None:  # type: ignore[no-untyped-def]
    """The coordinator's vectorised paths (grids of dim-0 splits for all tensors at
    once, every rank's assignment ranges in one pass) give exactly what the per-tensor
    and per-rank code gives, ranks in any order."""
    from shardpoint.saving import coordinator as co
    from shardpoint.saving.records import IndexRecord, WriteStatus

    world, rows, key_shapes, _itemsizes, _kinds = case
    ranks = [p for p in perm if p < world]  # rank numbers shuffled: irregular rank steps
    rows = sorted(((k, ranks[r], b) for k, r, b in rows), key=lambda x: x[1])
    plan = co.make_plan(_rank_layouts(world, rows, key_shapes))
    statuses = [WriteStatus(f"f{r}", 1, IndexRecord("i", 1, "0")) for r in range(world)]
    values = [{"values": {}, "per_rank": {}}] * world
    fast = co.build_manifest(plan, values, statuses, "s").tree.entries
    original = co._row_split_grids
    co._row_split_grids = lambda *a: {}  # type: ignore[assignment]
    try:
        general = co.build_manifest(plan, values, statuses, "s").tree.entries
    finally:
        co._row_split_grids = original  # type: ignore[assignment]
    assert fast == general
    for r, a in enumerate(co.assignments(plan)):
        lo, hi = int(plan.row_start[r]), int(plan.row_start[r + 1])
        for name, mask in (("write", plan.writer[lo:hi]), ("check", plan.check[lo:hi])):
            want = [[i, j] for i, j in _runs(mask.tolist())]
            assert a[name] == want, (r, name)


def _runs(mask: list[bool]) -> list[tuple[int, int]]:
    out, start = [], None
    for i, m in enumerate(mask + [False]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            out.append((start, i))
            start = None
    return out


def test_whole_box_is_made_once_per_shape_and_bounded() -> None:
    """A save and a load describe each plain tensor with the box of its whole: one
    shared, immutable Box per shape, and the memo never grows past its bound."""
    import torch

    from shardpoint.layout import local
    from shardpoint.runtime import PROCESS

    a = local.whole_box((3, 4))
    assert a == Box((0, 0), (3, 4)) and isinstance(a, Box)
    assert local.whole_box((3, 4)) is a
    assert local.whole_box(()) == Box((), ()) and local.whole_box((3,)) == Box((0,), (3,))
    for n in range(local.WHOLE_MAX + 10):
        local.whole_box((n, 1))
    assert len(PROCESS.whole_boxes) <= local.WHOLE_MAX
    assert local.whole_box((3, 4)) == Box((0, 0), (3, 4))
    # what a load describes: a plain tensor's box is the shared one
    t = torch.zeros(3, 4)
    assert local.chunks_of("k", t).boxes[0] is local.whole_box((3, 4))
    assert local.Describe(detach=False)("k", t).boxes[0] is local.whole_box((3, 4))
