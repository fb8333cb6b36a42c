"""How fast the kernel copies a file's cached bytes into memory, by where the
destination lies against the source: a verified read's inner loop (``preadv`` of a
256 KiB piece, then its CRC-32, as ``LocalStorage.read_into_crcs`` does) into the same
buffer at several offsets, so that the destination address minus the file offset is
each of a few values modulo the 4 KiB page. Also into a tensor as torch allocated it,
and into the same tensor moved to the page-congruent offset.

Why: ``load_floor_bench.py``'s floor reads each rank's first file into a buffer that
starts on a page, so that file's bytes go to a page-congruent destination; a load's
destinations are the user's tensors, wherever torch put them. The difference between
the two is part of what a load cannot win back against that floor.

    OMP_NUM_THREADS=1 PYTHONPATH=src:. python benchmarks/copy_alignment_bench.py [--mb 256] [--rounds 15]

Page cache warm (each case runs once untimed first), cases in turn each round, best of
``--rounds``, in milliseconds.
"""

from __future__ import annotations

import argparse
import mmap
import os
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mb", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args()
    import torch

    from shardpoint.format.datafile import crc32
    from shardpoint.load.read import _bytes_of
    from shardpoint.storage.base import Storage

    piece = Storage.read_piece
    assert piece is not None
    n = args.mb << 20
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "data")
        with open(path, "wb") as f:
            for _ in range(args.mb):
                f.write(os.urandom(1 << 20))
            f.write(b"\0" * 8192)
        fd = os.open(path, os.O_RDONLY)
        try:
            src = 4096  # the file offset read from: page aligned

            def read(view: memoryview) -> None:
                p = 0
                while p < n:
                    v = view[p : p + piece]
                    p += os.preadv(fd, [v], src + p)
                    crc32(v)

            buf = memoryview(mmap.mmap(-1, n + 8192))  # page aligned
            t = torch.empty(n + 8192, dtype=torch.uint8)
            t.fill_(0)
            tb = _bytes_of(t)
            skew = t.data_ptr() % 4096
            cases = {f"buffer, destination - source = {k} mod 4096": buf[k : k + n] for k in (0, 64, 1024, 2048, 4032)}
            cases[f"a tensor as torch allocated it (address = {skew} mod 4096)"] = tb[:n]
            cases["the same tensor from its first page-congruent byte"] = tb[(4096 - skew) % 4096 :][:n]
            times: dict[str, list[float]] = {k: [] for k in cases}
            for v in cases.values():
                read(v)
            for _ in range(args.rounds):
                for k, v in cases.items():
                    t0 = time.perf_counter()
                    read(v)
                    times[k].append(time.perf_counter() - t0)
        finally:
            os.close(fd)
    best0 = min(next(iter(times.values())))
    print(f"{args.mb} MiB read in {piece >> 10} KiB pieces, each CRC-32'd; best of {args.rounds}\n")
    print("| destination | ms | / page-congruent |")
    print("|---|---:|---:|")
    for k, v in times.items():
        print(f"| {k} | {min(v) * 1e3:.1f} | {min(v) / best0:.3f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
