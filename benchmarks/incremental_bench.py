"""Incremental checkpoints: bytes written and time per save, side by side.

1. LoRA-style: a frozen base (``--base-mb``, default 1024 MB of fp32 Linear
   weights) and a small trainable adapter with Adam; ``--saves`` saves (default
   10), each after an optimizer step on the adapter. Peers in the same run:
   ``CheckpointManager(incremental=True)``, the same with the feature off,
   ``torch.distributed.checkpoint.save`` (DCP) and ``torch.save``.
2. Full fine-tune: every parameter changes before every save (``--ft-mb``):
   incremental on vs off, to show what detection costs when nothing can be skipped.

One process (world size 1). Prints markdown tables with ratios; not a test.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/incremental_bench.py [--base-mb 1024] [--saves 10] [--ft-mb 512]
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
import warnings
from pathlib import Path

import torch
from torch import nn

import shardpoint

MB = 1 << 20


def _size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def lora_model(base_mb: int, rank: int = 16, width: int = 4096) -> tuple[nn.Module, list[nn.Parameter]]:
    per_layer = width * width * 4
    layers = max(1, round(base_mb * MB / per_layer))
    m = nn.Module()
    m.base = nn.ParameterList([nn.Parameter(torch.empty(width, width).uniform_(-0.01, 0.01), requires_grad=False)
                               for _ in range(layers)])
    m.a = nn.ParameterList([nn.Parameter(torch.randn(rank, width) * 0.01) for _ in range(layers)])
    m.b = nn.ParameterList([nn.Parameter(torch.zeros(width, rank)) for _ in range(layers)])
    return m, [*m.a, *m.b]


def step(params: list[nn.Parameter], opt: torch.optim.Optimizer) -> None:
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()


def run(kind: str, model: nn.Module, params: list[nn.Parameter], opt: torch.optim.Optimizer, saves: int,
        tmp: Path) -> dict[str, list[float]]:
    """Save ``saves`` times with ``kind``; bytes written and seconds per save."""
    out: dict[str, list[float]] = {"bytes": [], "secs": []}
    root = tmp / kind
    mgr = None
    if kind.startswith("shardpoint"):
        mgr = shardpoint.CheckpointManager(root, keep_last=2, incremental=kind.endswith("incremental"))
    prev: Path | None = None
    for i in range(saves):
        step(params, opt)
        state = {"model": model.state_dict(), "optim": opt.state_dict()}
        t0 = time.perf_counter()
        if mgr is not None:
            mgr.save(state, i)
            where = root / mgr.step_dir(i)
        elif kind == "dcp":
            import torch.distributed.checkpoint as dcp

            where = root / str(i)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                dcp.save(state, checkpoint_id=str(where))
        else:
            where = root / f"{i}.pt"
            where.parent.mkdir(parents=True, exist_ok=True)
            torch.save(state, where)
        out["secs"].append(time.perf_counter() - t0)
        out["bytes"].append(_size(where))
        if mgr is None and prev is not None:  # the peers keep one checkpoint (disk)
            shutil.rmtree(prev) if prev.is_dir() else prev.unlink()
        prev = where
    shutil.rmtree(root, ignore_errors=True)
    return out


def _row(name: str, r: dict[str, list[float]], ref: dict[str, list[float]]) -> str:
    b_first, b_later = r["bytes"][0], sum(r["bytes"][1:]) / max(1, len(r["bytes"]) - 1)
    t_first, t_later = r["secs"][0], sum(r["secs"][1:]) / max(1, len(r["secs"]) - 1)
    rb = sum(ref["bytes"][1:]) / max(1, len(ref["bytes"]) - 1)
    rt = sum(ref["secs"][1:]) / max(1, len(ref["secs"]) - 1)
    return (f"| {name} | {b_first / MB:,.1f} | {b_later / MB:,.1f} | {b_later / rb:.3f} | {t_first:.2f} | "
            f"{t_later:.3f} | {t_later / rt:.3f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base-mb", type=int, default=1024)
    ap.add_argument("--saves", type=int, default=10)
    ap.add_argument("--ft-mb", type=int, default=512)
    ap.add_argument("--ft-saves", type=int, default=5)
    ap.add_argument("--tmpdir", default=None)
    ap.add_argument("--skip-peers", action="store_true", help="only shardpoint with the feature on and off")
    args = ap.parse_args()
    torch.manual_seed(0)
    tmp = Path(tempfile.mkdtemp(prefix="incr-bench-", dir=args.tmpdir))
    try:
        model, params = lora_model(args.base_mb)
        opt = torch.optim.Adam(params, lr=1e-3)
        step(params, opt)  # optimizer state exists from the first save on
        adapter = sum(p.numel() * 4 for p in params) * 3  # weights + Adam's two moments
        base = sum(p.numel() * 4 for p in model.base)
        kinds = ["shardpoint-incremental", "shardpoint-full"] + ([] if args.skip_peers else ["dcp", "torch.save"])
        res = {k: run(k, model, params, opt, args.saves, tmp) for k in kinds}
        ref = res["shardpoint-full"]
        print(f"\n## LoRA-style: frozen base {base / MB:,.0f} MiB, adapter + Adam state {adapter / MB:,.1f} MiB, "
              f"{args.saves} saves\n")
        print("| save | first save MiB | later saves MiB (mean) | vs full | first save s | later saves s (mean) | vs full |")
        print("|---|---|---|---|---|---|---|")
        for k in kinds:
            print(_row(k, res[k], ref))
        del model, params, opt, res

        torch.manual_seed(1)
        n = max(1, round(args.ft_mb * MB / (4096 * 4096 * 4)))
        ps = [nn.Parameter(torch.randn(4096, 4096) * 0.01) for _ in range(n)]
        fmodel = nn.ParameterList(ps)
        fopt = torch.optim.SGD(ps, lr=1e-3)
        ft = {}
        for k in ("shardpoint-full", "shardpoint-incremental", "shardpoint-full", "shardpoint-incremental"):
            r = run(k, fmodel, ps, fopt, args.ft_saves, tmp)
            ft.setdefault(k, {"bytes": [], "secs": []})
            for key in ("bytes", "secs"):
                ft[k][key] += r[key]
        print(f"\n## Full fine-tune: {n * 64} MiB of parameters, all changed before each save, "
              f"{2 * args.ft_saves} saves each (interleaved)\n")
        print("| save | first save MiB | later saves MiB (mean) | vs off | first save s | later saves s (mean) | vs off |")
        print("|---|---|---|---|---|---|---|")
        for k, name in (("shardpoint-full", "incremental off"), ("shardpoint-incremental", "incremental on")):
            print(_row(name, ft[k], ft["shardpoint-full"]))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
