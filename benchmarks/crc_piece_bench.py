"""What a CRC after each read costs, by the size of the read: the choice of
``Storage.read_piece``.

Each process reads a file of ``--size-mb`` from the page cache into distinct memory
(one buffer as large as the file: a load's targets), in pieces of each size, with
``preadv`` alone and with shardpoint's CRC-32 (zlib-ng's) of each piece right after
its read. Best of ``--repeat``, each process its own file; ``--procs 2`` runs two at
once (two ranks of a load on this 2-core machine). A CRC costs little while the bytes
it reads are still in the CPU's cache, and a large kernel copy leaves less of its
destination there.

    PYTHONPATH=src python benchmarks/crc_piece_bench.py [--size-mb 300] [--procs 1]
"""

from __future__ import annotations

import argparse
import mmap
import multiprocessing as mp
import os
import tempfile
import time

PIECES = [64 << 10, 256 << 10, 512 << 10, 1 << 20, 2 << 20, 4 << 20]


def _run(path: str, n: int, repeat: int, out: dict[int, tuple[float, float]]) -> None:
    from shardpoint.format.datafile import crc32

    buf = memoryview(mmap.mmap(-1, n))
    fd = os.open(path, os.O_RDONLY)
    try:
        os.preadv(fd, [buf], 0)  # the file in the page cache, the buffer's pages made

        def once(piece: int, crc: bool) -> float:
            t = time.perf_counter()
            pos = 0
            while pos < n:
                v = buf[pos : pos + piece]
                got = os.preadv(fd, [v], pos)
                if crc:
                    crc32(v[:got])
                pos += got
            return time.perf_counter() - t

        for piece in PIECES:
            out[piece] = (min(once(piece, False) for _ in range(repeat)), min(once(piece, True) for _ in range(repeat)))
    finally:
        os.close(fd)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size-mb", type=int, default=300)
    ap.add_argument("--procs", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=7)
    args = ap.parse_args()
    n = args.size_mb << 20
    with tempfile.TemporaryDirectory() as d:
        paths = []
        for i in range(args.procs):
            paths.append(os.path.join(d, f"f{i}"))
            with open(paths[-1], "wb") as f:
                f.write(os.urandom(n))
        with mp.Manager() as m:
            outs = [m.dict() for _ in paths]
            procs = [mp.Process(target=_run, args=(p, n, args.repeat, o)) for p, o in zip(paths, outs)]
            for p in procs:
                p.start()
            for p in procs:
                p.join(timeout=600)
            results = [dict(o) for o in outs]
    print(f"\n{args.size_mb} MB from the page cache into distinct memory, {args.procs} process(es) at once, best of "
          f"{args.repeat} (the slowest process)\n")
    print("| piece | read ms | read + CRC of each piece ms | the CRC adds |")
    print("|---:|---:|---:|---:|")
    for piece in PIECES:
        plain = max(r[piece][0] for r in results)
        crc = max(r[piece][1] for r in results)
        print(f"| {piece >> 10} KiB | {plain * 1e3:.1f} | {crc * 1e3:.1f} | {(crc / plain - 1) * 100:.0f}% |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
