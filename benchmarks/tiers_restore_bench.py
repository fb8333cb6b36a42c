"""A restore from peer memory against the old fetch-everything restore (issue 32, item 1).

Real hosts on this machine: network namespaces with host names of their own on one
bridge (tests/distributed/test_tiers_peer.py's setup; needs root), one torchrun node
each, FSDP2 + AdamW and a ballast of ``--mb`` MB sharded over the ranks, a memory
snapshot every step with ``replicas=1``. Two cases:

* ``rejoin``: 2 hosts x 2 ranks, host B lost; an empty replacement B' joins and the
  2 x 2 job restores (B' holds nothing);
* ``3to2``: 3 hosts x 2 ranks, host C lost; the job restores on 2 hosts x 3 ranks.

Each case runs once with this checkout's ``src`` and once with ``--old-src`` (a
checkout from before peer memory: ``git worktree add /tmp/old af31c50``), training
included, so that each restore reads a snapshot its own code wrote. Per host: the
bytes into its network interface during the restore (its namespace's
``rx_bytes``: the snapshot's bytes plus the coordination), what the new restore
says its ranks need of files the host lacked, and the restore's wall time (the
slowest rank's ``mgr.restore``).

    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/tiers_restore_bench.py --old-src /tmp/old/src --mb 48

Prints a markdown table; nothing gates on a time."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.distributed.test_tiers_hosts import _env  # noqa: E402
from tests.distributed.test_tiers_peer import hosts, resume, train_then_lose  # noqa: E402

CASES = {"rejoin": (2, 2, 1, 2, 2), "3to2": (3, 2, 2, 2, 3)}
"""case -> (hosts trained on, ranks per host, host lost, hosts restored on, ranks per host then)."""


def run(case: str, src: str, mb: float) -> dict[str, Any]:
    n, per, lost, n2, per2 = CASES[case]
    env = _env()
    env["PYTHONPATH"] = os.pathsep.join([src, env["PYTHONPATH"]])
    tmp = Path(tempfile.mkdtemp(prefix="sp-restore-bench-"))
    out, base, root = tmp / "out", f"/dev/shm/sp-restore-bench-{uuid.uuid4().hex[:8]}", tmp / "root"
    out.mkdir()
    tag = uuid.uuid4().hex[:6]
    names = [f"h{i}{tag}" for i in range(n)]
    argv = [str(out), base, str(root), str(mb)]
    try:
        with hosts(n) as ns:
            train_then_lose(tmp, ns, names, per, f"bench-{tag}", argv, env, lost, base)
            if case == "3to2":
                got = resume(tmp, ns[:n2], names, per2, 29611, f"bench-{tag}", argv, env, "r")
            else:
                got = resume(tmp, ns, names, per2, 29611, f"bench-{tag}", argv, env, "r")
        assert all(g["equal"] and g["tier"] == "memory" for g in got), got
        man = json.loads((root / "step-00000005" / "manifest.json").read_text())
        total = sum(int(e["size"]) for e in man["files"].values())
        rows: dict[str, dict[str, Any]] = {}
        for g in got:
            h = rows.setdefault(g["host"], {"rx": 0, "needed": g.get("host_needed"), "wall": 0.0})
            if g["local_rank"] == 0:
                h["rx"] = g["rx"]
            h["wall"] = max(h["wall"], g["wall_s"])
        return {"total": total, "hosts": [rows[names[i]] for i in range(n2)]}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(base, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--old-src", required=True, help="the src folder of a checkout with the old restore")
    ap.add_argument("--mb", type=float, default=48.0, help="the sharded ballast, MB")
    ap.add_argument("--cases", default="rejoin,3to2")
    args = ap.parse_args()
    new_src = str(Path(__file__).resolve().parents[1] / "src")
    print("| case | host | old: bytes in | new: bytes in | new / old | its ranks need | new / need | "
          "old restore s | new restore s | new / old |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for case in args.cases.split(","):
        old, new = run(case, args.old_src, args.mb), run(case, new_src, args.mb)
        for i, (o, w) in enumerate(zip(old["hosts"], new["hosts"])):
            need = w["needed"] or 0
            print(f"| {case} ({new['total'] / 1e6:.1f} MB of data files) | {'ABC'[i]} | {o['rx'] / 1e6:.2f} MB | "
                  f"{w['rx'] / 1e6:.2f} MB | {w['rx'] / max(1, o['rx']):.2f} | {need / 1e6:.2f} MB | "
                  f"{w['rx'] / need if need else float('nan'):.3f} | {o['wall']:.2f} | {w['wall']:.2f} | "
                  f"{w['wall'] / o['wall']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
