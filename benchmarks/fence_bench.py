"""What fencing costs a manager's save (issue 31): time on the local disk, and object-store
requests on the loopback S3 server, for this code and a baseline checkout, in one run.

- local: two gloo ranks, a ``FlatShard`` of ``--mb`` MB (split between them) and a
  small replicated tensor, ``CheckpointManager(root, keep_last=2)``; ``--saves`` saves
  one after the other, each timed from a barrier to a barrier (retention included). The
  median of the saves after the first two (the plan cached), best of ``--repeat`` runs,
  alternating the two codes.
- s3: one process on the moto server through the counting proxy (tests/s3proxy.py); the
  requests of saves 3-6 by method, per save (the data file's upload, its index, the
  manifest, ``latest``, retention's listings and reads, and now the fence's look-ups).

    git worktree add /tmp/sp-base 10e86cc      # the code before fencing
    python benchmarks/fence_bench.py --baseline /tmp/sp-base/src
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)


def _state(rank: int, world: int, mb: int) -> dict[str, Any]:
    import torch

    from shardpoint.layout import FlatShard

    n = mb * 1_000_000 // 4 // world
    return {"w": FlatShard(torch.randn(n), (n * world,), rank * n), "b": torch.ones(1000), "step": 0}


def _rank(rank: int, world: int, port: int, root: str, mb: int, saves: int, out: str) -> None:
    import time
    from datetime import timedelta

    import torch.distributed as dist

    import shardpoint

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=300))
    state = _state(rank, world, mb)
    mgr = shardpoint.CheckpointManager(root, keep_last=2)
    times = []
    for s in range(saves):
        state["step"] = s
        dist.barrier()
        t0 = time.perf_counter()
        mgr.save(state, s)
        dist.barrier()
        times.append(time.perf_counter() - t0)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(times, f)
    dist.destroy_process_group()


def child_local(mb: int, saves: int) -> dict[str, Any]:
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR")) as tmp:
        out = os.path.join(tmp, "times.json")
        mp.spawn(_rank, args=(2, port, os.path.join(tmp, "root"), mb, saves, out), nprocs=2, join=True)
        with open(out) as f:
            times = json.load(f)
    return {"median": statistics.median(times[2:]), "times": times}


def child_s3(saves: int) -> dict[str, Any]:
    import torch
    from tests.s3proxy import FaultProxy
    from tests.s3server import s3_server

    import shardpoint

    with s3_server() as s3, FaultProxy(s3.endpoint_url) as proxy:
        bucket = s3.new_bucket()
        mgr = shardpoint.CheckpointManager(f"s3://{bucket}/run", keep_last=2, storage_options=proxy.storage_options)
        state = {"w": torch.randn(250_000), "step": 0}
        counts: dict[str, float] = {}
        for s in range(saves):
            state["step"] = s
            if s == 2:
                proxy.arm(None)  # count only, from the third save on
            mgr.save(state, s)
        seen = list(proxy.requests)
        proxy.disarm()
        for method, path in seen:
            kind = "LIST" if method == "GET" and ("list-type" in path or "prefix=" in path) else method
            counts[kind] = counts.get(kind, 0) + 1
        n = saves - 2
        return {k: v / n for k, v in sorted(counts.items())} | {"total": len(seen) / n}


def run_child(src: str, what: str, args: argparse.Namespace) -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([src, REPO]), OMP_NUM_THREADS="1")
    cmd = [sys.executable, os.path.abspath(__file__), "--child", what, "--mb", str(args.mb), "--saves", str(args.saves)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise SystemExit(f"{what} run with {src} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", help="the src/ folder of a checkout to compare with (e.g. before fencing)")
    ap.add_argument("--mb", type=int, default=64, help="MB of state saved by the two ranks together (default 64)")
    ap.add_argument("--saves", type=int, default=12, help="saves per run (default 12)")
    ap.add_argument("--repeat", type=int, default=3, help="local runs per code, alternating (default 3)")
    ap.add_argument("--skip-s3", action="store_true")
    ap.add_argument("--child", choices=["local", "s3"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child == "local":
        print(json.dumps(child_local(args.mb, args.saves)))
        return
    if args.child == "s3":
        print(json.dumps(child_s3(min(args.saves, 6))))
        return
    codes = [("this", os.path.join(REPO, "src"))] + ([("baseline", args.baseline)] if args.baseline else [])
    local: dict[str, list[float]] = {name: [] for name, _ in codes}
    for _ in range(args.repeat):
        for name, src in codes:
            local[name].append(run_child(src, "local", args)["median"])
    print(f"\nmanager save, local disk, 2 ranks, {args.mb} MB, keep_last=2 (median of saves 3-{args.saves}; "
          f"best of {args.repeat}; all runs)\n")
    print("| code | seconds per save | runs |")
    print("|---|---:|---|")
    for name, _ in codes:
        print(f"| {name} | {min(local[name]):.4f} | {', '.join(f'{t:.4f}' for t in local[name])} |")
    if args.baseline:
        print(f"\nthis / baseline: {min(local['this']) / min(local['baseline']):.3f}x")
    if args.skip_s3:
        return
    s3 = {name: run_child(src, "s3", args) for name, src in codes}
    kinds = sorted({k for c in s3.values() for k in c if k != "total"}) + ["total"]
    print("\nrequests per manager save on the S3 loopback server (1 rank; saves 3-6)\n")
    print("| code | " + " | ".join(kinds) + " |")
    print("|---|" + "---:|" * len(kinds))
    for name, _ in codes:
        print(f"| {name} | " + " | ".join(f"{s3[name].get(k, 0):g}" for k in kinds) + " |")


if __name__ == "__main__":
    main()
