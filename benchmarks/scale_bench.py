"""Coordination against world size: what a save and a load cost in messages, not in
data.

    python benchmarks/scale_bench.py [--real 2,4,8,16] [--sim 1024,8192] [--tensors 2000]
                                     [--sim-tensors-8192 250] [--skip-dcp] [--json out.json]

Real runs: fresh gloo processes on this machine, each holding ``--tensors`` tiny
tensors sharded ``Shard(0)`` over all ranks (so the run measures coordination, not
I/O). Per world size: bytes each rank receives through shardpoint's collectives
(counted at the Comm layer; coordinator and the largest other rank), store
operations per rank, wall time of a first save, of a second save of the same
layout, and of a load, and the manifest's size. DCP (``torch.distributed.checkpoint``)
saves and loads the same state in the same processes: its times and the size of
its ``.metadata``.

Simulated runs: the coordinator (``shardpoint._coordinator``) driven in one process
for 1,024 and 8,192 ranks with the layouts ``plan_bench.py`` builds (60% Shard(0),
20% HSDP, 20% FSDP x TP), every message serialised as on the wire: bytes the
coordinator receives, the largest per-rank reply, planning and manifest build
time on one core, manifest size (without the CRC indexes, which are per data
file), and the same for a second save of the same layout (cached plan).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))


# -- real ranks ------------------------------------------------------------------------

def _count_store_ops() -> list[int]:
    """Wrap every Comm's store so that its calls are counted (this process only)."""
    from shardpoint import collective

    counter = [0]
    init = collective.Comm.__init__

    class Counting:
        def __init__(self, inner: Any) -> None:
            self._inner = inner

        def __getattr__(self, name: str) -> Any:
            attr = getattr(self._inner, name)
            if not callable(attr):
                return attr

            def call(*a: Any, **k: Any) -> Any:
                counter[0] += 1
                return attr(*a, **k)

            return call

    def patched(self: Any, *a: Any, **k: Any) -> None:
        init(self, *a, **k)
        if self.store is not None:
            self.store = Counting(self.store)

    collective.Comm.__init__ = patched  # type: ignore[method-assign]
    return counter


def _received() -> Any:
    """A function returning the bytes this process received so far through the
    checkpoint collectives: the Comm layer's own counter, or (for the code before
    it had one) a wrapper around ``Comm._run`` that sums the output tensors."""
    from shardpoint import collective

    try:
        from shardpoint.runtime import PROCESS

        t = PROCESS.seams.traffic
    except ImportError:  # before the runtime owner
        t = getattr(collective, "traffic", None)
    if t is not None:
        return lambda: t.received
    total = [0]
    run = collective.Comm._run

    def counted(self: Any, fn: Any, *args: Any, **kw: Any) -> None:
        run(self, fn, *args, **kw)
        name = getattr(fn, "__name__", "")
        if name == "all_gather":
            total[0] += sum(x.numel() * x.element_size() for x in args[0])
        elif name in ("all_reduce", "broadcast"):
            total[0] += args[0].numel() * args[0].element_size()

    collective.Comm._run = counted  # type: ignore[method-assign]
    return lambda: total[0]


def _rank(rank: int, world: int, root: str, n: int, dcp: bool) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    import shardpoint

    store_ops = _count_store_ops()
    received = _received()
    mesh = init_device_mesh("cpu", (world,))

    def state(fill: float) -> dict[str, Any]:
        return {f"layer{i}": DTensor.from_local(torch.full((2, 2), fill + i), mesh, [Shard(0)], run_check=False,
                                                shape=torch.Size((2 * world, 2)), stride=(2, 1)) for i in range(n)}

    out: dict[str, Any] = {}
    path = Path(root) / f"sp{world}"
    for name, fill, kw in (("save1", 1.0, {}), ("save2", 2.0, {"overwrite": True})):
        s = state(fill)
        dist.barrier()
        r0, o0, t0 = received(), store_ops[0], time.perf_counter()
        shardpoint.save(s, path, **kw)
        out[name] = {"s": time.perf_counter() - t0, "recv": received() - r0, "store_ops": store_ops[0] - o0}
    target = state(0.0)
    dist.barrier()
    r0, o0, t0 = received(), store_ops[0], time.perf_counter()
    shardpoint.load(target, path)
    out["load"] = {"s": time.perf_counter() - t0, "recv": received() - r0, "store_ops": store_ops[0] - o0}
    out["manifest"] = (path / "manifest.json").stat().st_size
    out["indexes"] = sum(p.stat().st_size for p in path.glob("*.index.json"))
    if dcp:
        import torch.distributed.checkpoint as dcp_mod

        dpath = str(Path(root) / f"dcp{world}")
        s = state(1.0)
        dist.barrier()
        t0 = time.perf_counter()
        dcp_mod.save(s, checkpoint_id=dpath)
        out["dcp_save"] = time.perf_counter() - t0
        dist.barrier()
        t0 = time.perf_counter()
        dcp_mod.save(state(2.0), checkpoint_id=dpath)
        out["dcp_save2"] = time.perf_counter() - t0
        target = state(0.0)
        dist.barrier()
        t0 = time.perf_counter()
        dcp_mod.load(target, checkpoint_id=dpath)
        out["dcp_load"] = time.perf_counter() - t0
        out["dcp_metadata"] = os.path.getsize(os.path.join(dpath, ".metadata"))
    return out


def real(worlds: list[int], n: int, dcp: bool) -> list[dict[str, Any]]:
    from tests._dist import run_ranks

    rows = []
    for w in worlds:
        with tempfile.TemporaryDirectory() as d:
            t0 = time.perf_counter()
            res = run_ranks(_rank, w, d, n, dcp, timeout=1800)
            print(f"   real {w} ranks: {time.perf_counter() - t0:.0f}s", file=sys.stderr)
        others = res[1:]
        row: dict[str, Any] = {"world": w}
        for ph in ("save1", "save2", "load"):
            row[ph] = {"coord_recv": res[0][ph]["recv"], "other_recv": max(o[ph]["recv"] for o in others),
                       "store_ops_max": max(r[ph]["store_ops"] for r in res), "s": max(r[ph]["s"] for r in res)}
        row["manifest"] = res[0]["manifest"]
        row["indexes"] = res[0]["indexes"]
        if dcp:
            for k in ("dcp_save", "dcp_save2", "dcp_load"):
                row[k] = max(r[k] for r in res)
            row["dcp_metadata"] = res[0]["dcp_metadata"]
        rows.append(row)
    return rows


# -- simulated ranks -------------------------------------------------------------------

def simulate(world: int, n: int) -> dict[str, Any]:
    import gc

    import numpy as np
    from plan_bench import build_layouts, sp_metas

    from shardpoint.runtime import PROCESS
    from shardpoint.saving import coordinator as co
    from shardpoint.saving.records import WriteStatus

    lay = build_layouts(world, n)
    metas = sp_metas(lay, world)
    del lay
    wire = []
    ref = None
    for m in metas:  # as _save._plan_phase sends them: rank 0's structure, the others' boxes
        layout = {k: m[k] for k in ("containers", "tensors", "chunks")}
        layout["per_rank"] = {p: {k: d[k] for k in ("containers", "tensors", "chunks")} for p, d in m["per_rank"].items()}
        digest, lay = co.layout_message(layout, ref)
        ref = ref or lay["sd"]
        wire.append(json.dumps({"digest": digest, "plan": None, "layout": lay, "values": {"values": m["values"], "per_rank": {p: d["values"] for p, d in m["per_rank"].items()}}},
                               separators=(",", ":")).encode())
    del metas
    gc.collect()
    out: dict[str, Any] = {"world": world, "tensors": n, "coord_recv_plan": sum(len(b) for b in wire)}
    PROCESS.forget_plans()
    coord = co.Coordinator("sim", world)
    t0 = time.perf_counter()
    msgs = [json.loads(b) for b in wire]
    t1 = time.perf_counter()
    replies = coord.plan_round(msgs)
    t2 = time.perf_counter()
    out["parse_s"], out["plan_s"] = t1 - t0, t2 - t1
    sizes = [len(json.dumps(r, separators=(",", ":"))) for r in replies]
    out["reply_max"] = max(sizes)
    plan = coord.plan
    assert plan is not None
    statuses = []
    for r in range(world):
        a, b = int(plan.row_start[r]), int(plan.row_start[r + 1])
        check = np.nonzero(plan.check[a:b])[0]
        statuses.append({"file": f"r{r:05d}-{coord.save_id}.safetensors", "size": 1 << 30,
                         "replicas": [check.tolist(), [int(plan.group[a + i]) for i in check]],
                         "index": {"name": f"r{r:05d}-{coord.save_id}.index.json", "size": 1000, "sha256": "0" * 64}})
    out["coord_recv_status"] = sum(len(json.dumps(s, separators=(",", ":"))) for s in statuses)
    statuses = [WriteStatus.from_wire(s, r) for r, s in enumerate(statuses)]
    t0 = time.perf_counter()
    co.check_replicas(plan, statuses)
    t1 = time.perf_counter()
    data = co.build_manifest(plan, coord.values, statuses, coord.save_id).to_bytes()
    t2 = time.perf_counter()
    out["replicas_s"], out["manifest_s"], out["manifest"] = t1 - t0, t2 - t1, len(data)
    forms: dict[str, int] = {}
    for e in json.loads(data)["entries"].values():
        if e["kind"] == "tensor":
            f = next(k for k in ("grid", "flat", "chunks") if k in e)
            forms[f] = forms.get(f, 0) + 1
    out["forms"] = forms
    # second save of the same layout: digests only, the cached plan
    plan_id = replies[0]["plan_id"]
    wire2 = [json.dumps({"digest": json.loads(b)["digest"], "plan": plan_id, "layout": None, "values": {"values": {}, "per_rank": {}}},
                        separators=(",", ":")).encode() for b in wire]
    del wire, msgs
    gc.collect()
    coord2 = co.Coordinator("sim", world)
    t0 = time.perf_counter()
    replies2 = coord2.plan_round([json.loads(b) for b in wire2])
    out["plan2_s"] = time.perf_counter() - t0
    assert coord2.reused
    out["coord_recv_plan2"] = sum(len(b) for b in wire2)
    out["reply2_max"] = max(len(json.dumps(r, separators=(",", ":"))) for r in replies2)
    PROCESS.forget_plans()
    return out


def _mb(x: float) -> str:
    return f"{x / 1e6:.2f} MB" if x >= 1e5 else f"{x / 1e3:.1f} KB" if x >= 1e3 else f"{int(x)} B"


def markdown(real_rows: list[dict[str, Any]], sims: list[dict[str, Any]], n: int) -> str:
    lines = []
    if real_rows:
        lines += [f"### Real gloo ranks, {n} tensors Shard(0) (tiny), this machine (2 cores)", "",
                  "| world | other rank recv, save 1 | save 2 | load | coordinator recv, save 1 | store ops/rank, save | "
                  "save 1 s | save 2 s | load s | manifest | indexes | DCP save s | DCP save 2 s | DCP load s | DCP .metadata |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in real_rows:
            d = [f"{r.get(k, float('nan')):.2f}" if k in r else "-" for k in ("dcp_save", "dcp_save2", "dcp_load")]
            lines.append(
                f"| {r['world']} | {_mb(r['save1']['other_recv'])} | {_mb(r['save2']['other_recv'])} | {_mb(r['load']['other_recv'])} "
                f"| {_mb(r['save1']['coord_recv'])} | {r['save1']['store_ops_max']} | {r['save1']['s']:.2f} | {r['save2']['s']:.2f} "
                f"| {r['load']['s']:.2f} | {_mb(r['manifest'])} | {_mb(r.get('indexes', 0))} | {' | '.join(d)} "
                f"| {_mb(r['dcp_metadata']) if 'dcp_metadata' in r else '-'} |")
        lines.append("")
    if sims:
        lines += ["### Simulated ranks: the coordinator in one process, messages serialised (one core)", "",
                  "| ranks x tensors | coordinator recv (plan) | parse s | plan s | largest reply | coordinator recv (status) "
                  "| replica check s | manifest build s | manifest | layouts | 2nd save: recv | plan s | largest reply |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for s in sims:
            lines.append(
                f"| {s['world']} x {s['tensors']} | {_mb(s['coord_recv_plan'])} | {s['parse_s']:.2f} | {s['plan_s']:.2f} "
                f"| {_mb(s['reply_max'])} | {_mb(s['coord_recv_status'])} | {s['replicas_s']:.2f} | {s['manifest_s']:.2f} "
                f"| {_mb(s['manifest'])} | {s['forms']} | {_mb(s['coord_recv_plan2'])} | {s['plan2_s']:.3f} | {_mb(s['reply2_max'])} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--real", default="2,4,8,16", help="world sizes of real gloo runs ('' for none)")
    ap.add_argument("--sim", default="1024,8192", help="simulated world sizes ('' for none)")
    ap.add_argument("--tensors", type=int, default=2000)
    ap.add_argument("--sim-tensors-8192", type=int, default=2000, help="tensors of the 8,192-rank simulation")
    ap.add_argument("--skip-dcp", action="store_true")
    ap.add_argument("--json")
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    worlds = [int(x) for x in args.real.split(",") if x]
    rows = real(worlds, args.tensors, not args.skip_dcp) if worlds else []
    sims = []
    for w in [int(x) for x in args.sim.split(",") if x]:
        t0 = time.perf_counter()
        sims.append(simulate(w, args.sim_tensors_8192 if w >= 8192 else args.tensors))
        print(f"   simulated {w} ranks: {time.perf_counter() - t0:.0f}s", file=sys.stderr)
    md = markdown(rows, sims, args.tensors)
    print(md)
    if args.json:
        Path(args.json).write_text(json.dumps({"real": rows, "sim": sims, "markdown": md}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
