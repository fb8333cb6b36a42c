"""How long reading a checkpoint's manifest takes, and what its seal costs.

    python benchmarks/manifest_bench.py [--tensors 2000] [--ranks 8] [--repeat 30] [--json out.json]

Writes a checkpoint of ``--tensors`` small tensors (a 2,000-parameter model's keys)
and a few plain values, as ``--ranks`` ranks would (``save_offline``; each rank
holds its share of the keys), then times, on the manifest's bytes, the median of
``--repeat`` runs of:

- ``parse``: ``Manifest.parse`` as a load calls it (seal check, JSON, validation);
- ``json only``: ``json.loads`` of the same bytes (the floor any JSON manifest pays);
- ``seal check``: the seal alone (``format.digest.unseal``), when the format has one.

Not a test: figures depend on the machine; compare rows of one run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def _median_ms(fn: Any, repeat: int) -> float:
    fn()
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1000


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tensors", type=int, default=2000)
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=30)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    import torch

    from shardpoint.api import save_offline
    from shardpoint.format import manifest as mf

    per_rank = max(1, args.tensors // args.ranks)
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "ckpt"
        states = [(r, {"model": {f"layers.{r * per_rank + i}.weight": torch.zeros(4, 4) for i in range(per_rank)},
                       "optimizer": {"step": 100, "lr": 1e-4, "betas": (0.9, 0.999)}})
                  for r in range(args.ranks)]
        save_offline(states, path, world_size=args.ranks)
        data = (path / mf.MANIFEST_NAME).read_bytes()

    rows: list[tuple[str, float]] = [("parse", _median_ms(lambda: mf.Manifest.parse(data), args.repeat))]
    try:
        from shardpoint.format import digest
    except ImportError:
        digest = None  # type: ignore[assignment]
    if digest is not None and digest.is_sealed(data):
        body = digest.unseal(data, "bench")
        rows.append(("seal check", _median_ms(lambda: digest.unseal(data, "bench"), args.repeat)))
        rows.append(("json only", _median_ms(lambda: json.loads(body), args.repeat)))
    else:
        rows.append(("json only", _median_ms(lambda: json.loads(data), args.repeat)))
    print(f"manifest: {len(data):,} bytes, {args.tensors} tensors from {args.ranks} ranks, format version "
          f"{mf.FORMAT_VERSION}, median of {args.repeat}")
    print("| step | ms |\n|---|---|")
    for name, ms in rows:
        print(f"| {name} | {ms:.2f} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"bytes": len(data), "rows": dict(rows), "version": mf.FORMAT_VERSION}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
