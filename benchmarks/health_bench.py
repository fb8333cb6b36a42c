"""What recording health costs: a blocking save of the same state with the NaN/inf
check on and off, in one run.

    python benchmarks/health_bench.py [--size-mb 512] [--repeat 5] [--tmpdir DIR]

One process, no process group: fp32 tensors of about ``--size-mb`` MB written to
fresh folders (fsync as always). Runs alternate check on / check off so a busy
spell of the shared machine hits both alike; the table gives the median and best of
each and the ratio of the medians. The check runs in the same pass as the CRC-32 of
each 1 MiB block (the block is in cache), so its cost is torch.isfinite over bytes
already being read; the goal (issue 24) is at most 5% of the save.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

import shardpoint
from shardpoint.runtime import PROCESS


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-mb", type=int, default=512)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--tmpdir", default=None)
    args = ap.parse_args()
    torch.manual_seed(0)
    n = args.size_mb * (1 << 20) // 4 // 8
    state = {f"w{i}": torch.randn(n) for i in range(8)}
    nbytes = sum(t.numel() * 4 for t in state.values())
    root = Path(tempfile.mkdtemp(dir=args.tmpdir, prefix="health_bench_"))
    times: dict[bool, list[float]] = {True: [], False: []}
    check = torch.cat([t[: 1 << 18] for t in state.values()])
    t0 = time.perf_counter()
    for t in state.values():
        bool(torch.isfinite(t).all())
    whole_pass = time.perf_counter() - t0
    try:
        shardpoint.save(state, root / "warm")  # page cache, pool and allocator warm
        for i in range(args.repeat):
            for on in (True, False) if i % 2 == 0 else (False, True):
                PROCESS.seams.health_check = on
                p = root / f"r{i}-{int(on)}"
                t0 = time.perf_counter()
                shardpoint.save(state, p)
                times[on].append(time.perf_counter() - t0)
                shutil.rmtree(p)
    finally:
        PROCESS.seams.health_check = True
        shutil.rmtree(root, ignore_errors=True)
    assert bool(torch.isfinite(check).all())
    on, off = statistics.median(times[True]), statistics.median(times[False])
    print(f"blocking save of {nbytes / 1e6:.0f} MB, {args.repeat} runs each (s)\n")
    print("| check | median | best | MB/s (median) |")
    print("|---|---|---|---|")
    for k, label in ((True, "NaN/inf check on"), (False, "off")):
        print(f"| {label} | {statistics.median(times[k]):.3f} | {min(times[k]):.3f} | "
              f"{nbytes / 1e6 / statistics.median(times[k]):.0f} |")
    print(f"\nratio on/off (medians): {on / off:.3f} (goal <= 1.05); best: {min(times[True]) / min(times[False]):.3f}")
    print(f"a separate torch.isfinite pass over the same tensors: {whole_pass:.3f} s "
          f"({whole_pass / off:.1%} of a save)")
    # the two per-block costs side by side, away from the disk: what the check adds to the CRC pass
    from shardpoint.format.datafile import crc32
    from shardpoint.saving.write import _finite

    block = memoryview(state["w0"][: 1 << 18].numpy()).cast("B")
    reps = 2000
    t0 = time.perf_counter()
    for _ in range(reps):
        crc32(block)
    crc_us = (time.perf_counter() - t0) / reps * 1e6
    t0 = time.perf_counter()
    for _ in range(reps):
        _finite(block, torch.float32)
    fin_us = (time.perf_counter() - t0) / reps * 1e6
    print(f"per 1 MiB block: CRC-32 {crc_us:.1f} us, finite check {fin_us:.1f} us; "
          f"blocks in the save: {nbytes >> 20}, so the check adds {fin_us * (nbytes >> 20) / 1e6:.3f} s "
          f"= {fin_us * (nbytes >> 20) / 1e6 / off:.1%} of the median save without it")


if __name__ == "__main__":
    main()
