"""A restore from memory at a thousand hosts, planned: who reads which byte ranges
from whom (issue 32, items 2-3). Pure and simulated, one core.

    python benchmarks/restore_plan_bench.py [--hosts 1024] [--per-host 8] [--tensors 2000]
                                            [--lost 511] [--placement spread,ring] [--order kept,shuffled]
                                            [--json out.json]

A snapshot of ``--tensors`` tensors sharded ``Shard(0)`` (FSDP2) over hosts x per-host
ranks, shapes of a 70B-parameter Llama-style model in fp32 (embedding and head
(128256, 8192); per layer q and o (8192, 8192), k and v (1024, 8192), gate and up
(28672, 8192), down (8192, 28672), two norms (8192,)), its chunks laid out back to
back in each saving rank's data file as a save writes them. Every host holds its
ranks' files and, with ``replicas=1``, the replicas the placement gives it:
``spread`` (``shardpoint.plan.replicas.replica_hosts``: a host's ranks' files on its
next eight hosts, one each) or ``ring`` (the tier's placement today: all of them on
the next host). Host ``--lost`` is lost; the others are present and serve what they
hold. The restore is planned (``shardpoint.plan.restore.plan_restore``) for

* the same world less the lost host: hosts - 1 hosts x per-host ranks;
* another world size: hosts / 2 hosts x per-host ranks (the first of the survivors
  run ranks; every survivor still serves its memory),

with the new hosts in the survivors' order (``kept``: a launcher that keeps the node
order) or in a random order (``shuffled``: a rendezvous that does not). Asserted and
printed per plan: every host receives (from peers and the durable root) at most 1.1x
the bytes its ranks' shards occupy; no host serves more than 2x the mean of the hosts
that serve; planned in under 5 s of CPU (one core; the wall time is printed beside it,
larger when other work shares the core). "Today" is what the tier's restore moves now: every
present host gets every file of the snapshot it lacks.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))

from shardpoint.plan.replicas import replica_hosts  # noqa: E402
from shardpoint.plan.restore import (  # noqa: E402
    DURABLE,
    Inventory,
    NewWorld,
    SnapshotLayout,
    choose_sources,
    needed_ranges,
    shard0_targets,
)

LAYER = [(8192, 8192), (1024, 8192), (1024, 8192), (8192, 8192), (28672, 8192), (28672, 8192), (8192, 28672),
         (8192, 1), (8192, 1)]
HEADER = 4096  # bytes before the first chunk of a data file (its safetensors header)


def shapes(n: int) -> np.ndarray:
    """(n, 2) shapes: the embedding, layers, the head; the same three times over for the
    parameters and AdamW's two moments (in that order, as a state dict has them)."""
    model: list[tuple[int, int]] = [(128256, 8192)]
    while len(model) < n // 3 - 1:
        model += LAYER
    model = model[: max(1, n // 3 - 1)] + [(128256, 8192)]
    out = (model * 3 + LAYER * n)[:n]
    return np.array(out, dtype=np.int64)


def snapshot(n_tensors: int, world: int) -> SnapshotLayout:
    """The saved layout: every tensor Shard(0) over ``world`` ranks, rank r's chunks in
    file r back to back in key order after a header."""
    shape = shapes(n_tensors)
    boxes = shard0_targets(shape, world)  # the saving ranks' boxes are what they loaded
    itemsize = np.full(len(shape), 4, dtype=np.int64)
    length = boxes.sizes[:, 0] * boxes.sizes[:, 1] * 4
    order = np.argsort(boxes.rank, kind="stable")  # by file, then key
    ends = np.cumsum(length[order])
    per_file = np.bincount(boxes.rank, weights=length, minlength=world).astype(np.int64)
    file_start = np.concatenate([[0], np.cumsum(per_file)[:-1]])
    offset = np.empty_like(length)
    offset[order] = ends - length[order] - file_start[boxes.rank[order]] + HEADER
    return SnapshotLayout(shape, itemsize, boxes.tensor, boxes.rank, offset, boxes.offsets, boxes.sizes,
                          per_file + HEADER)


def inventories(hosts: int, per_host: int, lost: int, placement: str) -> list[Inventory]:
    files: list[set[int]] = [set(range(h * per_host, (h + 1) * per_host)) for h in range(hosts)]
    width = None if placement == "spread" else 1
    for h in range(hosts):
        for i in range(per_host):
            for g in replica_hosts(hosts, h, i, 1, width, per_host):
                files[g].add(h * per_host + i)
    return [Inventory(h, frozenset(files[h])) for h in range(hosts) if h != lost]


def measure(layout: SnapshotLayout, invs: list[Inventory], world: NewWorld, per_host: int) -> dict[str, Any]:
    gc.collect()
    cpu0 = time.process_time()
    t0 = time.perf_counter()
    targets = shard0_targets(layout.shape, len(world))
    t1 = time.perf_counter()
    needs = needed_ranges(layout, targets)
    t2 = time.perf_counter()
    plan = choose_sources(layout, needs, world, invs)
    t3 = time.perf_counter()
    cpu = time.process_time() - cpu0
    received, served, needed = plan.received(), plan.served(), plan.needed
    readers = np.unique(world.host)
    present = np.array(sorted(i.host for i in invs))
    ratio = np.where(needed[readers] > 0, received[readers] / np.maximum(needed[readers], 1), 0.0)
    ratio[(needed[readers] == 0) & (received[readers] > 0)] = np.inf
    serving = served[present][served[present] > 0]
    mean_serving = float(serving.mean()) if len(serving) else 0.0
    mean_all = float(served[present].mean())
    total = int(layout.file_size.sum())
    held = {i.host: int(layout.file_size[list(i.files)].sum()) for i in invs}
    today = sum(total - held[int(h)] for h in readers)  # every reader host gets every file it lacks
    share = total / len(present)
    return {
        "ranges": len(plan), "targets_s": t1 - t0, "needs_s": t2 - t1, "sources_s": t3 - t2, "plan_s": t3 - t0, "cpu_s": cpu,
        "recv_ratio_max": float(ratio.max()), "recv_max": int(received.max()), "need_max": int(needed.max()),
        "served_max": int(served.max()), "served_over_mean_serving": float(served.max() / mean_serving) if mean_serving else 0.0,
        "served_over_mean_all": float(served.max() / mean_all) if mean_all else 0.0, "serving_hosts": len(serving),
        "served_max_over_share": float(served.max() / share), "network": int(received.sum()),
        "durable": plan.from_durable(), "local": plan.local(), "needed": int(needed.sum()), "today": today,
        "snapshot": total, "durable_reads": int((plan.source == DURABLE).sum()),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hosts", type=int, default=1024)
    ap.add_argument("--per-host", type=int, default=8)
    ap.add_argument("--tensors", type=int, default=2000)
    ap.add_argument("--lost", type=int, default=511, help="the host lost")
    ap.add_argument("--placement", default="spread,ring")
    ap.add_argument("--order", default="kept,shuffled")
    ap.add_argument("--json")
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    H, R = args.hosts, args.per_host
    t0 = time.perf_counter()
    layout = snapshot(args.tensors, H * R)
    print(f"   snapshot: {H} hosts x {R} ranks, {args.tensors} tensors, {len(layout.tensor):,} chunks, "
          f"{layout.file_size.sum() / 1e12:.2f} TB ({time.perf_counter() - t0:.1f}s to build)", file=sys.stderr)
    survivors = [h for h in range(H) if h != args.lost]
    rows = []
    failures = []
    for placement in args.placement.split(","):
        invs = inventories(H, R, args.lost, placement)
        for order in args.order.split(","):
            hosts = list(survivors)
            if order == "shuffled":
                np.random.default_rng(32).shuffle(hosts)
            for new in (hosts, hosts[: H // 2]):
                world = NewWorld.even(new, R)
                m = measure(layout, invs, world, R)
                m.update(placement=placement, order=order, world=f"{len(new)} x {R}")
                rows.append(m)
                print(f"   {placement} {order} {m['world']}: {m['plan_s']:.2f}s ({m['cpu_s']:.2f}s CPU)", file=sys.stderr)
                tag = f"{placement}/{order}/{m['world']}"
                if m["recv_ratio_max"] > 1.1:
                    failures.append(f"{tag}: a host receives {m['recv_ratio_max']:.3f}x its ranks' bytes")
                if m["served_over_mean_serving"] > 2:
                    failures.append(f"{tag}: a host serves {m['served_over_mean_serving']:.2f}x the mean")
                if m["cpu_s"] > 5:
                    failures.append(f"{tag}: planned in {m['cpu_s']:.1f}s of CPU")
    md = markdown(rows, H, R, args.tensors, args.lost, layout)
    print(md)
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "markdown": md}, indent=1))
    if failures:
        print("BOUNDS NOT MET (spread placement is the one proposed):\n  " + "\n  ".join(failures))
    spread_fail = [f for f in failures if f.startswith("spread/")]
    return 1 if spread_fail else 0


def _gb(x: float) -> str:
    return f"{x / 1e12:,.1f} TB" if x >= 1e13 else f"{x / 1e9:,.1f} GB" if x >= 1e8 else f"{x / 1e6:,.1f} MB"


def markdown(rows: list[dict[str, Any]], H: int, R: int, n: int, lost: int, layout: SnapshotLayout) -> str:
    lines = [f"### Restore planned: {H} hosts x {R} ranks saved, {n} tensors Shard(0), replicas=1, host {lost} lost "
             f"({_gb(layout.file_size.sum())} snapshot, {len(layout.tensor):,} chunks); one core", "",
             "| placement | new hosts | new world | ranges | plan s: CPU (wall: needs + sources) | max host recv / its ranks' bytes "
             "| max served / mean of serving hosts (of all) | serving hosts | max served / host share "
             "| network | local | durable | today's restore moves |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['placement']} | {r['order']} | {r['world']} | {r['ranges']:,} | {r['cpu_s']:.2f} ({r['plan_s']:.2f}: "
            f"{r['targets_s'] + r['needs_s']:.2f} + {r['sources_s']:.2f}) | {r['recv_ratio_max']:.3f} "
            f"| {r['served_over_mean_serving']:.2f} ({r['served_over_mean_all']:.2f}) | {r['serving_hosts']} "
            f"| {r['served_max_over_share']:.2f} | {_gb(r['network'])} | {_gb(r['local'])} | {_gb(r['durable'])} "
            f"| {_gb(r['today'])} ({r['today'] / r['network']:,.0f}x) |" if r["network"] else f"| {_gb(r['today'])} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
