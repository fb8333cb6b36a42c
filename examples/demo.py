"""shardpoint's main demo: change the number of ranks mid-run and keep the loss curve.

    python examples/demo.py

1. a baseline of ``--steps`` steps on 4 CPU ranks (FSDP2 over gloo, launched by
   torchrun), saving a checkpoint at the midpoint;
2. a resume from that checkpoint on 2 ranks, with twice the gradient accumulation;
3. a resume from it on 4 ranks.

It prints a markdown table of the largest loss difference to the baseline after
the resume, and writes a PNG of the three loss curves. ``--control`` adds a fourth
run that restores everything except the data position, to show what that costs.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
TRAIN = HERE / "train_elastic.py"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(nproc: int, args: list[str], timeout: float) -> float:
    """Run train_elastic.py on ``nproc`` ranks; kill the whole group on timeout."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
           "--master_addr", "127.0.0.1", "--master_port", str(free_port()), str(TRAIN), *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)
    try:
        rc = proc.wait(timeout=timeout)
    except BaseException:  # timeout or Ctrl-C: leave nothing behind
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise
    if rc != 0:
        raise SystemExit(f"{' '.join(cmd)} failed with exit code {rc}")
    return time.perf_counter() - t0


def losses(run_dir: Path) -> dict[int, float]:
    with open(run_dir / "losses.jsonl") as f:
        return {d["step"]: d["loss"] for d in map(json.loads, f)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/demo", help="folder for the runs, checkpoints and plot")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--train-batch-size", type=int, default=32)
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--plot", default=None, help="PNG path (default: <out>/elastic_resume.png)")
    p.add_argument("--control", action="store_true", help="also resume without restoring the data position")
    p.add_argument("--timeout", type=float, default=300, help="seconds allowed per run")
    args = p.parse_args()

    out = Path(args.out)
    mid = args.steps // 2
    common = ["--train-batch-size", str(args.train_batch_size), "--micro-batch-size", str(args.micro_batch_size),
              "--steps", str(args.steps), "--out", str(out)]
    resume = ["--resume", "--resume-step", str(mid), "--checkpoint-dir", str(out / "baseline" / "checkpoints")]
    runs = [  # name, ranks, extra flags
        ("baseline", 4, ["--checkpoint-every", str(mid)]),
        ("resume-2ranks", 2, resume),
        ("resume-4ranks", 4, resume),
    ]
    if args.control:
        runs.append(("resume-2ranks-no-data-position", 2, [*resume, "--no-restore-data"]))
    for name, _, _ in runs:
        shutil.rmtree(out / name, ignore_errors=True)

    t_all = time.perf_counter()
    for name, nproc, extra in runs:
        print(f"\n== {name}: {nproc} ranks ==", flush=True)
        secs = torchrun(nproc, [*common, "--run-name", name, *extra], args.timeout)
        print(f"   ({secs:.1f} s)", flush=True)
    total = time.perf_counter() - t_all

    base = losses(out / "baseline")
    rows = []
    curves = {}
    for name, nproc, _ in runs:
        curve = losses(out / name)
        curves[name] = (nproc, curve)
        if name == "baseline":
            continue
        steps = sorted(s for s in curve if s > mid)
        absd = max(abs(curve[s] - base[s]) for s in steps)
        reld = max(abs(curve[s] - base[s]) / abs(base[s]) for s in steps)
        acc = args.train_batch_size // (args.micro_batch_size * nproc)
        rows.append(f"| {name} | {nproc} | {acc} | {steps[0]}-{steps[-1]} | {absd:.2e} | {reld:.2e} |")

    acc4 = args.train_batch_size // (args.micro_batch_size * 4)
    print(f"\nBaseline: 4 ranks x {acc4} micro-batches of {args.micro_batch_size} = global batch "
          f"{args.train_batch_size}, {args.steps} steps, resumed from the step-{mid} checkpoint.\n")
    print("| run | ranks | accumulation | steps | max abs loss diff | max rel loss diff |")
    print("|---|---|---|---|---|---|")
    print("\n".join(rows))

    try:
        import matplotlib
    except ImportError:  # the base install: the table above is the result; the plot is optional
        print("\nplot: skipped (matplotlib is not installed; `pip install matplotlib` draws the loss curves)")
        print(f"total: {total:.0f} s for {len(runs)} runs")
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    styles = {"baseline": dict(lw=3.5, alpha=0.35, color="C0"), "resume-2ranks": dict(lw=1.6, ls="--", color="C1"),
              "resume-4ranks": dict(lw=1.2, ls=":", color="C2"),
              "resume-2ranks-no-data-position": dict(lw=1.2, color="C3")}
    for name, (nproc, curve) in curves.items():
        steps = sorted(curve)
        ax.plot(steps, [curve[s] for s in steps], label=f"{name} ({nproc} ranks)", **styles[name])
    ax.axvline(mid, color="grey", lw=0.8, ls="-.")
    ax.annotate(f"checkpoint (step {mid})", (mid, ax.get_ylim()[1]), xytext=(4, -12), textcoords="offset points",
                fontsize=8, color="grey")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss (mean over the global batch)")
    ax.set_title(f"Resume on another number of ranks, global batch {args.train_batch_size}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    plot = Path(args.plot) if args.plot else out / "elastic_resume.png"
    plot.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(plot)
    print(f"\nplot: {plot}")
    print(f"total: {total:.0f} s for {len(runs)} runs")


if __name__ == "__main__":
    main()
