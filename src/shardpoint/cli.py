"""``shardpoint`` command line: inspect, verify and convert checkpoints."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``shardpoint`` command."""
    p = argparse.ArgumentParser(prog="shardpoint", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    info = sub.add_parser("info", help="print a checkpoint's keys, shapes, dtypes and layout (reads the manifest only)")
    info.add_argument("path")
    ver = sub.add_parser("verify", help="re-read every chunk and check its checksum; exit 1 listing damaged keys and files")
    ver.add_argument("path")
    conv = sub.add_parser("convert", help="convert another framework's checkpoint into a shardpoint checkpoint")
    conv.add_argument("--from", dest="src_format", required=True, choices=["deepspeed"])
    conv.add_argument("--tag", default=None, help="DeepSpeed tag (default: the one named by SRC/latest)")
    conv.add_argument("--no-progress", action="store_true")
    conv.add_argument("src")
    conv.add_argument("dst")
    args = p.parse_args(argv)

    from .errors import ShardpointError

    try:
        if args.cmd == "info":
            return _info(args.path)
        if args.cmd == "verify":
            from .verify import main as verify_main

            return verify_main([args.path])
        from .integrations.deepspeed import convert

        convert(args.src, args.dst, tag=args.tag, progress=not args.no_progress)
        print(f"converted {args.src} -> {args.dst}")
        return 0
    except ShardpointError as e:
        print(f"shardpoint: error: {e}", file=sys.stderr)
        return 2


def _info(path: str) -> int:
    from .api import metadata

    m = metadata(path)
    print(f"checkpoint {path}: format v{m.version}, saved by {m.world_size} rank(s) at {m.created.isoformat()}, {m.nbytes} bytes")
    for k, t in m.tensors.items():
        print(f"  {k}: {str(t.dtype).removeprefix('torch.')}{list(t.shape)} in {len(t.chunks)} chunk(s)")
    for k, v in m.values.items():
        print(f"  {k} = {v!r}")
    for k, ranks in m.per_rank.items():
        print(f"  {k}: per rank, saved by ranks {ranks}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
