"""The per-tensor cost of a load against a save: many small sharded tensors.

2 real gloo ranks, ``--tensors`` DTensors of 64 x 16 fp32 with ``Shard(0)`` (each rank
holds its 32-row half). shardpoint's save and load against DCP's, in the same run;
the page cache is warm (``--repeat`` rounds of save, load, load without verifying,
in turn; best of each), so what is left is each library's Python work per tensor. Prints a markdown table with ratios.

    OMP_NUM_THREADS=1 PYTHONPATH=src:. python benchmarks/small_tensors_bench.py [--tensors 20000] [--skip-dcp]
    ... --profile out.prof   # cProfile of rank 0's last shardpoint load
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _rank(rank: int, world: int, root: str, n: int, repeat: int, dcp: bool, profile: str | None) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    import shardpoint

    mesh = init_device_mesh("cpu", (world,))
    rows, cols = 64, 16

    def state(fill: float) -> dict[str, Any]:
        return {f"layers.{i}.weight": DTensor.from_local(torch.full((rows // world, cols), fill + i), mesh, [Shard(0)],
                                                         run_check=False, shape=torch.Size((rows, cols)),
                                                         stride=(cols, 1)) for i in range(n)}

    def best(fns: dict[str, Any], before: Any = None) -> dict[str, float]:
        """``repeat`` rounds of all of ``fns`` in turn (a machine that gets busier or
        quieter meanwhile weighs on each alike); the best time of each."""
        times: dict[str, list[float]] = {k: [] for k in fns}
        for _ in range(repeat):
            for k, fn in fns.items():
                if before is not None:
                    before()
                dist.barrier()
                t0 = time.perf_counter()
                fn()
                dist.barrier()
                times[k].append(time.perf_counter() - t0)
        return {k: min(v) for k, v in times.items()}

    out: dict[str, Any] = {}
    src = state(1.0)
    dst = state(0.0)
    path = Path(root) / "sp"
    shardpoint.save(src, path)  # the first save plans; later ones find the plan cached, as a training loop does
    out.update(best({"sp_save": lambda: shardpoint.save(src, path, overwrite=True),
                     "sp_load": lambda: shardpoint.load(dst, path),
                     "sp_load_noverify": lambda: shardpoint.load(dst, path, verify=False)}))
    assert all(torch.equal(dst[k].to_local(), src[k].to_local()) for k in list(src)[:: max(1, n // 100)])
    if profile and rank == 0:
        import cProfile

        pr = cProfile.Profile()
        pr.enable()
        shardpoint.load(dst, path)
        pr.disable()
        pr.dump_stats(profile)
    elif profile:
        shardpoint.load(dst, path)
    if dcp:
        import shutil

        import torch.distributed.checkpoint as dcp_mod

        dpath = str(Path(root) / "dcp")

        def fresh() -> None:
            if rank == 0 and os.path.isdir(dpath):
                shutil.rmtree(dpath)

        saved = best({"dcp_save": lambda: dcp_mod.save(src, checkpoint_id=dpath)}, before=fresh)
        out.update(saved)
        out.update(best({"dcp_load": lambda: dcp_mod.load(dst, checkpoint_id=dpath)}))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tensors", type=int, default=20_000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--skip-dcp", action="store_true")
    ap.add_argument("--profile", default=None, help="write a cProfile of rank 0's shardpoint load here")
    args = ap.parse_args()
    from tests._dist import run_ranks

    with tempfile.TemporaryDirectory() as d:
        res = run_ranks(_rank, 2, d, args.tensors, args.repeat, not args.skip_dcp, args.profile, timeout=1800)
    row = {k: max(r[k] for r in res) for k in res[0]}
    sp_save, sp_load = row["sp_save"], row["sp_load"]
    print(f"\n{args.tensors} DTensors of 64x16 fp32, Shard(0) on 2 gloo ranks, warm cache, best of {args.repeat}\n")
    print("| operation | seconds | per tensor (us) | vs shardpoint save |")
    print("|---|---|---|---|")
    for k, label in (("sp_save", "shardpoint save"), ("sp_load", "shardpoint load (verified)"),
                     ("sp_load_noverify", "shardpoint load (verify=False)"), ("dcp_save", "DCP save"),
                     ("dcp_load", "DCP load")):
        if k in row:
            print(f"| {label} | {row[k]:.2f} | {row[k] / args.tensors * 1e6:.0f} | {row[k] / sp_save:.2f}x |")
    print(f"\nload / save: {sp_load / sp_save:.2f} (goal: <= 1.0)")
    if "dcp_load" in row:
        print(f"DCP load / shardpoint load: {row['dcp_load'] / sp_load:.1f}x; DCP save / shardpoint save: "
              f"{row['dcp_save'] / sp_save:.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
