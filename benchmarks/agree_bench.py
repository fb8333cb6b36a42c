"""An agreement's wall time on real gloo ranks: the coordinator round of a load
(``shardpoint.collective.agree``) with its payloads sent point to point after the
sizes (``rendezvous=True``, what a save's commit needs) and carried in the gather and
the scatter (``rendezvous=False``, a load's), with a gloo barrier as the floor of one
collective round. The two forms run in turn, so a machine that gets busier weighs on
both alike. Best and median of ``--rounds`` rounds, slowest rank, in milliseconds.

    OMP_NUM_THREADS=1 PYTHONPATH=src:. python benchmarks/agree_bench.py [--worlds 2,4] [--rounds 400]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))


def _rounds(rank: int, world: int, rounds: int) -> dict[str, list[float]]:
    import torch.distributed as dist

    from shardpoint.collective import Comm, agree

    comm = Comm()
    comm.arrive("load", "/warm-up")  # the channel's lanes made
    payload = ["cffddb129b14", ""]  # a load's key agreement: its save id, all keys held

    def merge(everyone: list[Any]) -> str:
        return everyone[0][1]

    forms = {
        "barrier": lambda: dist.barrier(),
        "rendezvous": lambda: agree(comm, payload, None, merge),
        "inline": lambda: agree(comm, payload, None, merge, rendezvous=False),
    }
    times: dict[str, list[float]] = {k: [] for k in forms}
    for _ in range(20):
        for fn in forms.values():
            fn()
    for _ in range(rounds):
        for k, fn in forms.items():
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
    return times


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worlds", default="2,4")
    ap.add_argument("--rounds", type=int, default=400)
    args = ap.parse_args()
    from tests._dist import run_ranks

    print("| ranks | barrier ms (best / median) | agree, rendezvous ms | agree, payloads inline ms | inline / rendezvous "
          "(median) |")
    print("|---|---|---|---|---|")
    for w in (int(x) for x in args.worlds.split(",")):
        res = run_ranks(_rounds, w, args.rounds, timeout=600)
        # each round's slowest rank
        per = {k: [max(r[k][i] for r in res) for i in range(args.rounds)] for k in res[0]}
        cell = {k: f"{min(v) * 1e3:.2f} / {statistics.median(v) * 1e3:.2f}" for k, v in per.items()}
        ratio = statistics.median(per["inline"]) / statistics.median(per["rendezvous"])
        print(f"| {w} | {cell['barrier']} | {cell['rendezvous']} | {cell['inline']} | {ratio:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
