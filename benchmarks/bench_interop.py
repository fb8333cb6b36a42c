"""Exporting a shardpoint checkpoint to Hugging Face safetensors shards, and importing
them back: time and peak memory, against the way one does it without a streaming
exporter (``shardpoint.load_full`` of the whole checkpoint, then
``safetensors.torch.save_file`` per shard, as ``save_pretrained`` does from a model in
memory).

    python benchmarks/bench_interop.py [--size-mb 256] [--shard-mb 32]

Each operation runs in a fresh process; memory is its RSS growth across the operation
(peak minus before; see ``_common.PeakRss``), and the anonymous part of it
(``RssAnon``: memory that is not file pages). Reads may come from the page cache.
Prints a markdown table with ratios against shardpoint's exporter.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
os.environ.setdefault("OMP_NUM_THREADS", "1")

from _common import MiB, PeakRss  # noqa: E402


def _child(mode: str, src: str, dst: str, shard: int) -> dict[str, float]:
    import shardpoint
    from shardpoint.interop import export_hf, import_hf

    if mode != "import":
        shardpoint.metadata(src)  # imports and first-touch costs outside the measurement
    import threading

    def anon() -> int:
        with open("/proc/self/status") as f:
            return next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith("RssAnon:"))

    anon0, anon_peak, stop = anon(), [0], threading.Event()

    def sample() -> None:
        while not stop.is_set():
            anon_peak[0] = max(anon_peak[0], anon())
            stop.wait(0.002)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    t0 = time.perf_counter()
    with PeakRss() as m:
        if mode == "export":
            export_hf(src, dst, prefix="", max_shard_size=shard, progress=False)
        elif mode == "import":
            import_hf(src, dst, prefix="model/", tie=False, progress=False)
        else:  # the peer: the whole state in memory, then one save_file per shard
            from safetensors.torch import save_file

            full = shardpoint.load_full(src)
            os.makedirs(dst, exist_ok=True)
            group: dict[str, object] = {}
            size, n = 0, 0
            for k in sorted(full):
                t = full[k]
                if group and size + t.nbytes > shard:
                    save_file(group, os.path.join(dst, f"model-{n:05d}.safetensors"), metadata={"format": "pt"})
                    group, size, n = {}, 0, n + 1
                group[k] = t
                size += t.nbytes
            save_file(group, os.path.join(dst, f"model-{n:05d}.safetensors"), metadata={"format": "pt"})
    stop.set()
    sampler.join()
    return {"seconds": time.perf_counter() - t0, "rss_growth": m.growth, "anon_growth": max(0, max(anon_peak[0], anon()) - anon0)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-mb", type=int, default=256)
    ap.add_argument("--shard-mb", type=int, default=32)
    ap.add_argument("--child", nargs=4, metavar=("MODE", "SRC", "DST", "SHARD"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        mode, src, dst, shard = args.child
        print(json.dumps(_child(mode, src, dst, int(shard))))
        return

    import torch

    import shardpoint

    tmp = tempfile.mkdtemp(prefix="bench_interop_")
    try:
        n = 32
        numel = args.size_mb * MiB // 4 // n
        shardpoint.save({f"layer{i:02d}.weight": torch.full((numel,), float(i)) for i in range(n)}, f"{tmp}/sp")
        shard = args.shard_mb * MiB

        def run(mode: str, src: str, dst: str) -> dict[str, float]:
            out = subprocess.run([sys.executable, __file__, "--child", mode, src, dst, str(shard)], capture_output=True,
                                 text=True, check=True, timeout=1800)
            return json.loads(out.stdout.splitlines()[-1])

        rows = {
            "shardpoint export_hf (streaming)": run("export", f"{tmp}/sp", f"{tmp}/hf"),
            "load_full + save_file per shard": run("peer", f"{tmp}/sp", f"{tmp}/peer"),
            "shardpoint import_hf": run("import", f"{tmp}/hf", f"{tmp}/back"),
        }
        base = rows["shardpoint export_hf (streaming)"]
        print(f"\n{args.size_mb} MiB checkpoint ({n} tensors), {args.shard_mb} MiB shards; page cache warm\n")
        print("| operation | seconds | RSS growth (MiB) | of it anonymous (MiB) | RSS growth / one shard | RSS growth vs export_hf |")
        print("|---|---:|---:|---:|---:|---:|")
        for name, r in rows.items():
            print(f"| {name} | {r['seconds']:.2f} | {r['rss_growth'] / MiB:.1f} | {r['anon_growth'] / MiB:.1f} | "
                  f"{r['rss_growth'] / shard:.2f} | {r['rss_growth'] / max(base['rss_growth'], 1):.2f}x |")
        print("\nimport_hf memory-maps the source files: its growth is file pages (page cache, reclaimable), "
              "not anonymous memory.")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
