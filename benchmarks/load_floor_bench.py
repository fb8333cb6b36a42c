"""A load against its floor: FSDP2 + AdamW state saved on 4 ranks, loaded on 1, 2 and 4.

The floor of a rank's load is the time to read its share of the checkpoint's bytes
(the data files ``files[rank::world]``, a 1/world share, what a resharding FSDP load
reads) into one preallocated buffer, with plain ``readinto`` calls and no other work.
Each file's bytes start on a 64-byte boundary of the buffer, as they do in the file: the
kernel copies from the page cache fastest into a destination aligned like its source
(on this machine's AMD EPYC a copy into a bytearray, whose first byte lies 16 bytes past
a boundary, is about a quarter slower; the "unaligned floor" column measures that one).
Page cache warm (each is run once untimed first), best of ``--repeat`` rounds that run
the floor and the load in turn, timed between barriers, slowest rank (DCP's row has
its own floor, measured in turn with it). Checksums are verified (``shardpoint.load`` default); DCP's
load of the same state is the row beside it. Below the table, the stages of shardpoint's
fastest load (``LoadStats.phases``): what it spends before its reads and beside them.

    OMP_NUM_THREADS=1 PYTHONPATH=src:. python benchmarks/load_floor_bench.py [--size-mb 1300] [--worlds 1,2,4]

With 2 cores, 4 ranks compete for CPU: the 4-rank figures measure that too.
"""

from __future__ import annotations

import argparse
import mmap
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))


def _save(rank: int, world: int, root: str, size_mb: int, dcp: bool) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp_mod
    from compare_fsdp import make_fsdp, state_bytes
    from torch.distributed.checkpoint.state_dict import get_state_dict

    import shardpoint

    model, opt = make_fsdp(size_mb, world, seed=0, step=True)
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    shardpoint.save(state, os.path.join(root, "sp"))
    if dcp:
        dcp_mod.save(state, checkpoint_id=os.path.join(root, "dcp"))
    return {"bytes": state_bytes(state)[1]}


def _load(rank: int, world: int, root: str, size_mb: int, repeat: int, dcp: bool) -> dict[str, Any]:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp_mod
    from compare_fsdp import make_fsdp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    import shardpoint
    from shardpoint.storage.local import LocalStorage

    model, opt = make_fsdp(size_mb, world, seed=1, step=False)
    msd, osd = get_state_dict(model, opt)  # initialises AdamW's state: a target to load into
    state = {"model": msd, "optim": osd}
    sp = os.path.join(root, "sp")
    files = sorted(os.path.join(sp, f) for f in os.listdir(sp) if f.endswith(".safetensors"))[rank::world]
    sizes = [os.path.getsize(f) for f in files]
    # each file's bytes start on a 64-byte boundary of a page-aligned buffer: the kernel's copy
    # from the page cache is fastest into a destination aligned as its source (a file from byte 0)
    starts = [sum(-(-n // 64) * 64 for n in sizes[:i]) for i in range(len(sizes))]
    buf = memoryview(mmap.mmap(-1, starts[-1] + sizes[-1]))
    unaligned = bytearray(sum(sizes))  # the floor measured until 2026-11-25: its first byte lies 16 bytes past a 64-byte boundary

    def read_all(view: memoryview, at: list[int], step: int | None, crc: bool) -> None:
        from shardpoint.format.datafile import crc32

        for f, n, pos in zip(files, sizes, at):
            end = pos + n
            with open(f, "rb", buffering=0) as fh:
                while pos < end and (got := fh.readinto(view[pos : end if step is None else min(end, pos + step)])):
                    if crc:
                        crc32(view[pos : pos + got])
                    pos += got

    def floor() -> None:
        read_all(buf, starts, None, False)

    def floor_crc() -> None:
        """The floor of a verified read: the same reads in pieces of the local storage's
        ``read_piece`` (256 KiB), each CRC-32'd (shardpoint's CRC, zlib-ng's) right
        after it is read, while it is in the CPU's cache."""
        read_all(buf, starts, LocalStorage.read_piece, True)

    def floor_unaligned() -> None:
        read_all(memoryview(unaligned), [sum(sizes[:i]) for i in range(len(sizes))], None, False)

    def best(fns: dict[str, Any]) -> dict[str, float]:
        """Each of ``fns`` once untimed (the files are in the page cache for the timed
        runs), then ``repeat`` rounds of all of them in turn: a machine that gets
        busier or quieter meanwhile weighs on each alike. Best of each."""
        for fn in fns.values():
            fn()
        times: dict[str, list[float]] = {k: [] for k in fns}
        for _ in range(repeat):
            for k, fn in fns.items():
                dist.barrier()
                t0 = time.perf_counter()
                fn()
                dist.barrier()
                times[k].append(time.perf_counter() - t0)
        return {k: min(v) for k, v in times.items()}

    phases: list[tuple[float, dict[str, float]]] = []  # each verified load's wall time and its stages (LoadStats)

    def sp_load() -> None:
        stats = shardpoint.load(state, sp).stats
        assert stats is not None
        phases.append((stats.wall_s, dict(stats.phases)))

    out = best({"floor": floor, "sp_load": sp_load, "floor_crc": floor_crc,
                "sp_noverify": lambda: shardpoint.load(state, sp, verify=False), "floor_unaligned": floor_unaligned})
    for k, v in min(phases[1:], key=lambda p: p[0])[1].items():  # the fastest timed load's stages
        out["sp_" + k] = v
    if dcp:
        out.update(best({"dcp_floor": floor, "dcp_load": lambda: dcp_mod.load(state, checkpoint_id=os.path.join(root, "dcp"))}))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size-mb", type=int, default=1300, help="fp32 params + AdamW's two moments, in MB")
    ap.add_argument("--worlds", default="1,2,4")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--skip-dcp", action="store_true")
    ap.add_argument("--tmpdir", default=None)
    args = ap.parse_args()
    from tests._dist import run_ranks

    rows = []
    with tempfile.TemporaryDirectory(dir=args.tmpdir) as d:
        saved = run_ranks(_save, 4, d, args.size_mb, not args.skip_dcp, timeout=1800)
        for w in [int(x) for x in args.worlds.split(",")]:
            res = run_ranks(_load, w, d, args.size_mb, args.repeat, not args.skip_dcp, timeout=1800)
            row = {k: max(r[k] for r in res) for k in res[0]}
            row["world"] = w
            rows.append(row)
            print(f"   loaded on {w}: {row}", file=sys.stderr)
    print(f"\nFSDP2 + AdamW, {saved[0]['bytes'] / 1e9:.2f} GB saved on 4 ranks; loads warm, best of {args.repeat}, "
          "slowest rank\n")
    print("| load ranks | floor s | shardpoint s (verified) | / floor | floor + CRC s | shardpoint / (floor + CRC) "
          "| shardpoint verify=False s | / floor | DCP s | DCP / floor | unaligned floor s | shardpoint / it |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        fl = r["floor"]
        dcp = f"{r['dcp_load']:.2f} | {r['dcp_load'] / r['dcp_floor']:.2f}x" if "dcp_load" in r else "- | -"
        print(f"| {r['world']} | {fl:.3f} | {r['sp_load']:.3f} | {r['sp_load'] / fl:.2f}x | {r['floor_crc']:.3f} | "
              f"{r['sp_load'] / r['floor_crc']:.2f}x | {r['sp_noverify']:.3f} | {r['sp_noverify'] / fl:.2f}x | {dcp} | "
              f"{r['floor_unaligned']:.3f} | {r['sp_load'] / r['floor_unaligned']:.2f}x |")
    print("\nshardpoint's fastest verified load, its stages (LoadStats.phases; the largest over the ranks): locate is the "
          "manifest, the walk, the key check, the read planning and the agreement on the keys; read is the reads and "
          "their CRCs, placing and the closing agreement")
    for r in rows:
        print(f"- {r['world']} rank(s): locate {r['sp_locate'] * 1e3:.1f} ms, read {r['sp_read'] * 1e3:.1f} ms "
              f"({(r['sp_read'] - r['floor_crc']) * 1e3:+.1f} ms against floor + CRC)")
    print("\ngoal (issue 34): shardpoint / floor <= 1.15x on 1 rank and <= 1.3x on 2 (4 ranks reported). floor: "
          "readinto a preallocated buffer, each file's bytes 64-byte aligned as in the file; floor + CRC: the same "
          "with a CRC-32 of each 256 KiB piece (DCP verifies nothing); unaligned floor: into a bytearray, the floor "
          "measured until 2026-11-25, whose first byte lies 16 bytes past a 64-byte boundary (the kernel's copy into "
          "it is slower)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
