"""Global save planning for 1,024 simulated ranks x 2,000 sharded tensors, on one
process: DCP's planner against shardpoint's, on the same layouts.

    python benchmarks/plan_bench.py [--ranks 1024] [--tensors 2000] [--json out.json]

The layouts are what FSDP2 and 2-D meshes produce (computed as DTensor does, checked
against torch's own function on a sample of ranks):
  - 60% of the tensors: Shard(0) over a 1-D mesh of all ranks, including uneven
    shards and ranks with empty shards (e.g. 100 rows over 1,024 ranks);
  - 20%: HSDP, (Replicate, Shard(0)) over a 2-D mesh (replicated chunks to dedup);
  - 20%: FSDP x TP, (Shard(0), Shard(1)) over a 2-D mesh (2-D boxes, uneven columns).

DCP: one ``SavePlan`` per rank of ``WriteItem``s as ``DefaultSavePlanner.create_local_plan``
makes them for DTensors, then exactly what ``DefaultSavePlanner._create_global_plan``
runs on the coordinator: ``dedup_save_plans``, ``create_default_global_save_plan``,
the merge of planner data, and ``_validate_global_plan`` (bounds, overlap sweep,
coverage). shardpoint: ``shardpoint.plan.choose_writers`` on the vectorised chunk table
(dedup, bounds, overlap and coverage validation, writer balancing), and
``shardpoint.saving.coordinator.make_plan`` from the per-rank metadata dicts that ``save``
all-gathers (the whole coordinator-free planning step every rank runs).
Gathering the per-rank inputs is not timed for either.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from typing import Any

import numpy as np

KINDS = ("fsdp", "hsdp", "fsdp_tp")
SHAPES = {
    "fsdp": [(4096, 4096), (11008, 4096), (4096,), (4100, 1024), (100,), (50257, 1024)],
    "hsdp": [(4096, 4096), (11008, 4096), (4096,), (1000, 512)],
    "fsdp_tp": [(4096, 4096), (11008, 4096), (4100, 1030)],
}
ITEMSIZE = 4  # fp32


def mesh2d(world: int) -> tuple[int, int]:
    a = int(world**0.5)
    while world % a:
        a -= 1
    return a, world // a


def split(size: int, n: int, coord: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(offset, length) of chunk ``coord`` of ``n``, as torch.chunk / DTensor Shard do."""
    full = -(-size // n)
    start = np.minimum(size, full * coord)
    end = np.minimum(size, full * coord + full)
    return start, np.maximum(0, end - start)


def build_layouts(world: int, n_tensors: int) -> dict[str, Any]:
    """Arrays of every rank's chunk of every tensor: offsets/sizes (K, world, 2),
    padded as shardpoint pads (offset 0, size 1), plus names, shapes and kinds."""
    m0, m1 = mesh2d(world)
    r = np.arange(world)
    a, b = r // m1, r % m1
    names, shapes, kinds = [], [], []
    offs = np.zeros((n_tensors, world, 2), dtype=np.int64)
    sizes = np.ones((n_tensors, world, 2), dtype=np.int64)
    count = {k: 0 for k in KINDS}
    for i in range(n_tensors):
        j = i % 10
        kind = "fsdp" if j < 6 else "hsdp" if j < 8 else "fsdp_tp"
        shape = SHAPES[kind][count[kind] % len(SHAPES[kind])]
        count[kind] += 1
        names.append(f"model.layers.{i // 10}.{kind}.proj{j}.weight")
        shapes.append(shape)
        kinds.append(kind)
        if kind == "fsdp":
            o, s = split(shape[0], world, r)
        elif kind == "hsdp":
            o, s = split(shape[0], m1, b)
        else:
            o, s = split(shape[0], m0, a)
            o1, s1 = split(shape[1], m1, b)
            offs[i, :, 1], sizes[i, :, 1] = o1, s1
        offs[i, :, 0], sizes[i, :, 0] = o, s
        if len(shape) == 2 and kind != "fsdp_tp":
            sizes[i, :, 1] = shape[1]
    return {"names": names, "shapes": shapes, "kinds": kinds, "offs": offs, "sizes": sizes, "mesh2d": (m0, m1)}


def check_against_torch(lay: dict[str, Any], world: int, samples: int = 16) -> int:
    """Compare the simulated chunks with DTensor's own computation on a sample of ranks."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    m0, m1 = lay["mesh2d"]
    placements = {"fsdp": ((world,), (Shard(0),)), "hsdp": ((m0, m1), (Replicate(), Shard(0))),
                  "fsdp_tp": ((m0, m1), (Shard(0), Shard(1)))}
    rng = np.random.default_rng(0)
    checked = 0
    for k in range(min(len(lay["names"]), 30)):
        mesh_shape, pl = placements[lay["kinds"][k]]
        shape = lay["shapes"][k]
        for rank in list(rng.choice(world, samples, replace=False)) + [world - 1]:
            coord = [int(rank)] if len(mesh_shape) == 1 else [int(rank) // m1, int(rank) % m1]
            size, off = _compute_local_shape_and_global_offset(shape, mesh_shape, coord, pl)
            nd = len(shape)
            want_off, want_size = tuple(lay["offs"][k, rank, :nd].tolist()), tuple(lay["sizes"][k, rank, :nd].tolist())
            assert (tuple(off), tuple(size)) == (want_off, want_size), (lay["names"][k], rank, off, size, want_off, want_size)
            checked += 1
    return checked


# --- DCP -----------------------------------------------------------------------------


def dcp_plans(lay: dict[str, Any], world: int) -> list[Any]:
    import torch
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

    names, shapes = lay["names"], lay["shapes"]
    nds = [len(s) for s in shapes]
    gsizes = [torch.Size(s) for s in shapes]
    mapping = {n: ("model", n) for n in names}
    offs = lay["offs"].transpose(1, 0, 2).tolist()  # [rank][key][dim]
    sizes = lay["sizes"].transpose(1, 0, 2).tolist()
    plans = []
    for r in range(world):
        items = []
        for k, name in enumerate(names):
            nd = nds[k]
            off = torch.Size(offs[r][k][:nd])
            items.append(WriteItem(
                index=MetadataIndex(name, off),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=off, sizes=torch.Size(sizes[r][k][:nd])),
                    properties=TensorProperties(dtype=torch.float32),
                    size=gsizes[k],
                ),
            ))
        # each rank's plan arrives unpickled, with its own copy of the flatten mapping
        plans.append(SavePlan(items=items, planner_data=dict(mapping)))
    return plans


def time_dcp(plans: list[Any]) -> dict[str, float]:
    """What DefaultSavePlanner._create_global_plan runs, step by step."""
    import dataclasses
    from collections import ChainMap

    from torch.distributed.checkpoint import default_planner as dp
    from torch.distributed.checkpoint._dedup_save_plans import dedup_save_plans

    planner = dp.DefaultSavePlanner()
    gc.collect()
    out: dict[str, float] = {}
    t0 = time.perf_counter()
    deduped = dedup_save_plans(plans, planner.dedup_save_to_lowest_rank)
    t1 = time.perf_counter()
    global_plan, md = dp.create_default_global_save_plan(deduped)
    if planner.flatten_state_dict:
        merged = dict(ChainMap(*[p.planner_data for p in global_plan]))
        md = dataclasses.replace(md, planner_data=merged)
    t2 = time.perf_counter()
    errors = dp._validate_global_plan(global_plan, md)
    t3 = time.perf_counter()
    if errors:
        raise AssertionError(f"DCP rejected the layout: {errors[:3]}")
    out.update(dedup_s=t1 - t0, global_plan_s=t2 - t1, validate_s=t3 - t2, total_s=t3 - t0,
               items_after_dedup=sum(len(p.items) for p in global_plan))
    return out


# --- shardpoint ----------------------------------------------------------------------


def sp_table(lay: dict[str, Any], world: int) -> tuple[Any, np.ndarray]:
    from shardpoint.plan import ChunkTable

    k, w = lay["offs"].shape[:2]
    offs = lay["offs"].transpose(1, 0, 2).reshape(-1, 2)  # rank-major, as ranks report them
    sizes = lay["sizes"].transpose(1, 0, 2).reshape(-1, 2)
    table = ChunkTable(key=np.tile(np.arange(k, dtype=np.int64), w), rank=np.repeat(np.arange(w, dtype=np.int64), k),
                       offsets=np.ascontiguousarray(offs), sizes=np.ascontiguousarray(sizes),
                       itemsize=np.full(k * w, ITEMSIZE, dtype=np.int64))
    shapes = np.array([list(s) + [1] * (2 - len(s)) for s in lay["shapes"]], dtype=np.int64)
    return table, shapes


def sp_metas(lay: dict[str, Any], world: int) -> list[dict[str, Any]]:
    """Per-rank metadata in the form shardpoint.save all-gathers (see shardpoint.saving.describe)."""
    names, shapes = lay["names"], lay["shapes"]
    nds = [len(s) for s in shapes]
    offs = lay["offs"].transpose(1, 0, 2).tolist()
    sizes = lay["sizes"].transpose(1, 0, 2).tolist()
    keys = ["model/" + n for n in names]
    metas = []
    for r in range(world):
        metas.append({
            "containers": {"": "dict", "model": "dict"},
            "values": {},
            "tensors": {key: {"dtype": "float32", "shape": list(s), "numpy": False} for key, s in zip(keys, shapes, strict=True)},
            "chunks": {"key": list(keys), "off": [o[: nds[k]] for k, o in enumerate(offs[r])],
                       "size": [s[: nds[k]] for k, s in enumerate(sizes[r])]},
            "per_rank": {},
        })
    return metas


def median_time(fn: Any, repeat: int) -> tuple[float, list[float], Any]:
    times, out = [], None
    for _ in range(repeat):
        out = None
        gc.collect()
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), times, out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=1024)
    ap.add_argument("--tensors", type=int, default=2000)
    ap.add_argument("--repeat", type=int, default=3, help="runs of each shardpoint planner (median)")
    ap.add_argument("--skip-dcp", action="store_true")
    ap.add_argument("--json")
    args = ap.parse_args()
    world, n = args.ranks, args.tensors
    res: dict[str, Any] = {"ranks": world, "tensors": n, "rows": world * n}

    t0 = time.perf_counter()
    lay = build_layouts(world, n)
    res["checked_against_torch"] = check_against_torch(lay, world)
    empty = int((np.prod(lay["sizes"], axis=2) == 0).sum())
    res["empty_chunks"] = empty
    res["total_bytes"] = int(sum(np.prod(s) for s in lay["shapes"]) * ITEMSIZE)
    print(f"== {world} ranks x {n} tensors = {world * n:,} chunks ({empty:,} empty), "
          f"layouts checked against DTensor on {res['checked_against_torch']} samples; built in {time.perf_counter() - t0:.1f}s",
          file=sys.stderr)

    # shardpoint first, while the heap holds only its own inputs
    try:
        from shardpoint.plan import choose_writers
    except Exception as e:  # noqa: BLE001
        res["sp_plan_save"] = {"error": f"not available: {type(e).__name__}: {e}"}
    else:
        table, shapes = sp_table(lay, world)
        s, runs, plan = median_time(lambda: choose_writers(table, shapes, world), args.repeat)
        assert int(plan.bytes_per_rank.sum()) == res["total_bytes"], "writers do not cover every byte once"
        res["sp_plan_save"] = {"s": s, "runs_s": runs, "max_over_mean_bytes": float(plan.bytes_per_rank.max() / plan.bytes_per_rank.mean())}
        print(f"   shardpoint choose_writers: {s:.3f}s {[round(x, 3) for x in runs]}", file=sys.stderr)
        del table, plan
    try:
        from shardpoint.saving.coordinator import make_plan
    except Exception as e:  # noqa: BLE001
        res["sp_make_plan"] = {"error": f"not available: {type(e).__name__}: {e}"}
    else:
        t = time.perf_counter()
        metas = sp_metas(lay, world)
        print(f"   built shardpoint metadata in {time.perf_counter() - t:.1f}s", file=sys.stderr)
        s, runs, plan = median_time(lambda: make_plan(metas), args.repeat)
        assert int((plan.table.nbytes * plan.writer).sum()) == res["total_bytes"]
        res["sp_make_plan"] = {"s": s, "runs_s": runs}
        print(f"   shardpoint make_plan: {s:.3f}s {[round(x, 3) for x in runs]}", file=sys.stderr)
        del metas, plan
    gc.collect()

    if not args.skip_dcp:
        t = time.perf_counter()
        plans = dcp_plans(lay, world)
        print(f"   built {world} DCP SavePlans in {time.perf_counter() - t:.1f}s", file=sys.stderr)
        res["dcp"] = time_dcp(plans)
        print(f"   DCP: {res['dcp']}", file=sys.stderr)
        del plans
    gc.collect()

    def ratio(k: str) -> float | None:
        if "dcp" in res and "s" in res.get(k, {}):
            return res["dcp"]["total_s"] / res[k]["s"]
        return None

    lines = [f"### Save planning, one process: {world} ranks x {n} tensors ({world * n:,} chunks, "
             f"{empty:,} empty; 60% Shard(0) on 1-D mesh, 20% HSDP, 20% FSDPxTP on {lay['mesh2d'][0]}x{lay['mesh2d'][1]})",
             "", "| planner | seconds | DCP / this | target (< 2 s and >= 20x) |", "|---|---:|---:|---|"]
    if "dcp" in res:
        d = res["dcp"]
        lines.append(f"| DCP: dedup {d['dedup_s']:.1f} s + global plan {d['global_plan_s']:.1f} s + validate "
                     f"{d['validate_s']:.1f} s | {d['total_s']:.2f} | 1.0x | |")
    for k, label in (("sp_plan_save", "shardpoint `plan.choose_writers` (chunk table)"),
                     ("sp_make_plan", "shardpoint `make_plan` (from per-rank metadata, what save runs)")):
        row = res.get(k, {})
        if "error" in row:
            lines.append(f"| {label} | {row['error']} | | n/a |")
            continue
        r = ratio(k)
        ok = row["s"] < 2.0 and (r is not None and r >= 20)
        status = ("met" if ok else "not met") if r is not None else ("met (< 2 s; DCP skipped)" if row["s"] < 2.0 else "not met")
        lines.append(f"| {label} | {row['s']:.3f} | {'—' if r is None else f'{r:.0f}x'} | {status} |")
    res["markdown"] = "\n".join(lines)
    print(res["markdown"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
