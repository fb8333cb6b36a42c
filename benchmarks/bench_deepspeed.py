"""DeepSpeed checkpoint -> training on another world size, three ways, on one
DeepSpeed ZeRO-2 checkpoint (CPU, gloo, torch AdamW):

1. DeepSpeed's way: ``ds_to_universal.py --inject_missing_state`` (one process), then
   ``engine.load_checkpoint`` with ``load_universal`` on 2 ranks;
2. shardpoint import: ``shardpoint convert --from deepspeed`` (one process), then
   ``shardpoint.integrations.deepspeed.load`` on 2 ranks;
3. shardpoint native: the same engine state saved by shardpoint on the 4 ranks that
   trained it, loaded on 2 ranks (no conversion at all).

Every load is verified against a fingerprint of the saved fp32 masters and Adam
moments. Prints a markdown table with ratios against shardpoint import + load.

    python benchmarks/bench_deepspeed.py [--size-mb 200] [--keep]

Timings are wall seconds of the operation alone (engines are built before the clock
starts); memory is the peak RSS of the converter process, and for loads the largest
per-rank growth of RSS during the load. Reads may come from the page cache (dropping
it needs root); the table says which.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from datetime import timedelta
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("OMP_NUM_THREADS", "1")

from _common import MB, JobFailed, MiB, PeakRss, drop_caches, fsync_tree, launch, run_timed, tree_bytes  # noqa: E402

TAG = "step1"


# -- the ranks ------------------------------------------------------------------------------------
def _engine(cfg: dict[str, Any], universal: bool = False, seed: int = 0) -> Any:
    import logging

    import deepspeed
    from compare_model import build

    deepspeed.utils.logger.setLevel(logging.WARNING)
    model = build(cfg["size_mb"], seed=seed)
    ds_cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 8,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        "zero_optimization": {"stage": 2},
        "steps_per_print": 1 << 30,
    }
    if universal:
        ds_cfg["checkpoint"] = {"load_universal": True}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_cfg)
    return engine


def _fingerprint(engine: Any) -> float:
    """Weighted sum of every full fp32 master and Adam moment (collective)."""
    import torch
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    acc = 0.0
    for i, (_, p) in enumerate(sorted(engine.module.named_parameters())):
        for j, t in enumerate((safe_get_full_fp32_param(p), safe_get_full_optimizer_state(p, "exp_avg"),
                               safe_get_full_optimizer_state(p, "exp_avg_sq"))):
            full = t.reshape(-1).to(torch.float64)
            w = (torch.arange(full.numel(), dtype=torch.int64) % 1021 + 1).to(torch.float64)
            acc += float((full * w).sum()) * (i + 1) * (j + 1)
    return acc


def _write(cfg: dict[str, Any], role: str, rank: int, out: dict[str, Any]) -> None:
    with open(os.path.join(cfg["workdir"], f"{role}.rank{rank}.json"), "w") as f:
        json.dump(out, f)


def role_make(cfg: dict[str, Any]) -> None:
    """4 ranks: one training step, DeepSpeed's save_checkpoint, shardpoint's save."""
    import torch
    import torch.distributed as dist
    from compare_model import batch

    from shardpoint.integrations import deepspeed as spds

    rank = dist.get_rank()
    engine = _engine(cfg)
    loss = engine(batch(cfg["size_mb"], rank)).pow(2).mean()
    engine.backward(loss)
    engine.step()
    out: dict[str, Any] = {"fingerprint": _fingerprint(engine)}
    dist.barrier()
    t0 = time.perf_counter()
    engine.save_checkpoint(cfg["ds"], tag=TAG)
    dist.barrier()
    if rank == 0:
        fsync_tree(cfg["ds"])  # DeepSpeed does not fsync; shardpoint does
    dist.barrier()
    out["ds_save_s"] = time.perf_counter() - t0
    with PeakRss() as mem:
        t0 = time.perf_counter()
        spds.save(engine, cfg["native"])
        out["sp_save_s"] = time.perf_counter() - t0
    out["sp_save_mem"] = mem.growth
    del torch
    _write(cfg, "make", rank, out)


def role_load(cfg: dict[str, Any]) -> None:
    """2 ranks: build a fresh engine, time the load of ``cfg['what']``, verify."""
    import torch.distributed as dist

    from shardpoint.integrations import deepspeed as spds

    rank, what = dist.get_rank(), cfg["what"]
    engine = _engine(cfg, universal=what == "universal", seed=1)
    dist.barrier()
    with PeakRss() as mem:
        t0 = time.perf_counter()
        if what == "universal":
            engine.load_checkpoint(cfg["ds"], tag=TAG + "_universal")
        else:
            spds.load(engine, cfg[what])
        dist.barrier()
        dt = time.perf_counter() - t0
    got = _fingerprint(engine)
    ok = abs(got - cfg["fingerprint"]) <= 1e-9 * max(abs(cfg["fingerprint"]), 1.0)
    _write(cfg, "load", rank, {"s": dt, "mem": mem.growth, "verified": ok})


def worker(role: str, cfg_path: str) -> None:
    import torch

    with open(cfg_path) as f:
        cfg = json.load(f)
    torch.set_num_threads(1)
    import deepspeed
    import torch.distributed as dist

    deepspeed.init_distributed(dist_backend="gloo", timeout=timedelta(seconds=900))
    {"make": role_make, "load": role_load}[role](cfg)
    dist.barrier()
    dist.destroy_process_group()


# -- the orchestrator ------------------------------------------------------------------------------
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-mb", type=int, default=200, help="fp32 params + Adam moments, MB (default 200)")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--keep", action="store_true", help="keep the checkpoints")
    args = ap.parse_args()
    work = args.workdir or tempfile.mkdtemp(prefix="bench_ds_")
    os.makedirs(work, exist_ok=True)
    cfg: dict[str, Any] = {
        "size_mb": args.size_mb, "workdir": work, "ds": os.path.join(work, "ds"),
        "native": os.path.join(work, "sp_native"), "imported": os.path.join(work, "sp_imported"),
    }
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONPATH=HERE + os.pathsep + os.environ.get("PYTHONPATH", ""))
    limit = 300 + 2.0 * args.size_mb
    script = os.path.abspath(__file__)
    rows: dict[str, dict[str, Any]] = {}
    try:
        made = launch(script, "make", 4, cfg, work, limit, env)
        cfg["fingerprint"] = made[0]["fingerprint"]
        ds_bytes = tree_bytes(os.path.join(cfg["ds"], TAG))

        import importlib.util

        spec = importlib.util.find_spec("deepspeed.checkpoint.ds_to_universal")
        assert spec is not None and spec.origin
        cached = not drop_caches()
        dt, rss = run_timed([sys.executable, spec.origin, "--input_folder", os.path.join(cfg["ds"], TAG),
                             "--output_folder", os.path.join(cfg["ds"], TAG + "_universal"), "--inject_missing_state"],
                            limit, os.path.join(work, "ds_to_universal.log"), env=env)
        uni_bytes = tree_bytes(os.path.join(cfg["ds"], TAG + "_universal"))
        drop_caches()
        ld = launch(script, "load", 2, dict(cfg, what="universal"), work, limit, env)
        rows["ds"] = {"conv_s": dt, "conv_rss": rss, "load": ld, "bytes": uni_bytes,
                      "base": run_timed([sys.executable, "-c", "import deepspeed.checkpoint.ds_to_universal"], limit,
                                        os.path.join(work, "base_ds.log"), env=env)}

        drop_caches()
        dt, rss = run_timed([sys.executable, "-m", "shardpoint.cli", "convert", "--from", "deepspeed", "--no-progress",
                             cfg["ds"], cfg["imported"]], limit, os.path.join(work, "convert.log"), env=env)
        drop_caches()
        ld = launch(script, "load", 2, dict(cfg, what="imported"), work, limit, env)
        rows["imp"] = {"conv_s": dt, "conv_rss": rss, "load": ld, "bytes": tree_bytes(cfg["imported"]),
                       "base": run_timed([sys.executable, "-c", "import shardpoint.cli, shardpoint.interop.deepspeed"],
                                         limit, os.path.join(work, "base_sp.log"), env=env)}

        drop_caches()
        ld = launch(script, "load", 2, dict(cfg, what="native"), work, limit, env)
        rows["nat"] = {"conv_s": 0.0, "conv_rss": 0, "load": ld, "bytes": tree_bytes(cfg["native"])}
    except JobFailed as e:
        print(f"benchmark failed: {e}", file=sys.stderr)
        sys.exit(1)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    print(table(rows, made, ds_bytes, args.size_mb, cached))


def table(rows: dict[str, dict[str, Any]], made: list[dict[str, Any]], ds_bytes: int, size_mb: int, cached: bool) -> str:
    def load_s(r: dict[str, Any]) -> float:
        return max(x["s"] for x in r["load"])

    def load_mem(r: dict[str, Any]) -> int:
        return max(x["mem"] for x in r["load"])

    base = rows["imp"]["conv_s"] + load_s(rows["imp"])
    names = {
        "ds": "`ds_to_universal --inject_missing_state` + universal load",
        "imp": "`shardpoint convert --from deepspeed` + `deepspeed.load`",
        "nat": "shardpoint native (saved by `deepspeed.save` on 4 ranks) + `deepspeed.load`",
    }
    out = [
        f"DeepSpeed ZeRO-2 checkpoint of a {size_mb} MB model+optimizer (fp32 + AdamW), saved on 4 ranks, "
        f"loaded on 2 ranks; DeepSpeed files {ds_bytes / MB:.0f} MB.",
        "",
        "| path | convert s (of it: start + imports) | convert peak RSS (imports alone) | load on 2 ranks s | load RSS growth / rank "
        "| total s | total / shardpoint import | output MB | verified |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for k in ("ds", "imp", "nat"):
        r = rows[k]
        total = r["conv_s"] + load_s(r)
        conv = "-" if k == "nat" else f"{r['conv_s']:.2f} ({r['base'][0]:.2f})"
        rss = "-" if k == "nat" else f"{r['conv_rss'] / MiB:.0f} MiB ({r['base'][1] / MiB:.0f} MiB)"
        ok = all(x["verified"] for x in r["load"])
        out.append(f"| {names[k]} | {conv} | {rss} | {load_s(r):.2f} | {load_mem(r) / MiB:.0f} MiB | {total:.2f} | "
                   f"{total / base:.2f}x | {r['bytes'] / MB:.0f} | {'yes' if ok else 'NO'} |")
    ds_save = max(m["ds_save_s"] for m in made)
    sp_save = max(m["sp_save_s"] for m in made)
    out += [
        "",
        f"Save on 4 ranks: DeepSpeed `save_checkpoint` + fsync {ds_save:.2f} s, shardpoint `deepspeed.save` "
        f"{sp_save:.2f} s ({sp_save / ds_save:.2f}x).",
        "Reads " + ("come from the page cache (dropping it was not permitted)." if cached else "start from a dropped page cache."),
    ]
    return "\n".join(out)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] in ("make", "load"):
        worker(sys.argv[1], sys.argv[2])
    else:
        main()
