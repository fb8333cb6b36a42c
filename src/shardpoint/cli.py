"""shardpoint: list, inspect, verify, compare, prune and convert checkpoints.

Exit codes (every command): 0 ok; 1 the checkpoint is damaged, incomplete, or (for
diff) the two differ; 2 a usage or environment error (bad arguments, no checkpoint
at the path, a file refused). Progress bars go to stderr and only when it is a
terminal; --quiet silences them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypedDict

from typing_extensions import (
    NotRequired,  # typing has it from Python 3.11; torch depends on typing_extensions
)

if TYPE_CHECKING:
    from rich.console import Console
    from rich.tree import Tree

OK, DIFFERS, USAGE = 0, 1, 2


class CheckpointRow(TypedDict):
    """One step folder as ``shardpoint ls --json`` lists it (None: unknown, the folder is not committed)."""

    step: int
    path: str
    time: str | None
    size: int | None
    referenced: int | None
    world_size: int | None
    status: str
    latest: bool
    nonfinite: list[str] | None  # None: saved before health was recorded, or not committed
    unfit: list[str] | None  # those of nonfinite that make it unfit to resume from (shardpoint.health)
    metrics: dict[str, float] | None


class DiffResult(TypedDict):
    """What :func:`diff` returns (``shardpoint diff --json`` adds ``identical``)."""

    a: str
    b: str
    added: list[str]
    removed: list[str]
    changed: dict[str, str]
    max_abs_diff: dict[str, float]
    identical: NotRequired[bool]

_EXAMPLES = {
    "ls": "example:\n  shardpoint ls runs/exp1/ckpt\n  shardpoint ls runs/exp1/ckpt --json | jq '.[] | select(.latest)'",
    "inspect": "example:\n  shardpoint inspect runs/exp1/ckpt/step-00001000\n  shardpoint inspect CKPT --json",
    "verify": "example:\n  shardpoint verify runs/exp1/ckpt/step-00001000 && echo sound",
    "diff": "example:\n  shardpoint diff ckpt/step-00001000 ckpt/step-00002000\n  shardpoint diff A B --atol 1e-6 --json",
    "export": "example:\n  shardpoint export runs/exp1/ckpt/step-00001000 archive/step-1000   # no references left in the copy",
    "prune": "example:\n  shardpoint prune runs/exp1/ckpt --keep-last 3 --keep-every 1000 --dry-run",
    "convert": (
        "examples:\n"
        "  shardpoint convert --from deepspeed ds_ckpt/ sp_ckpt/          # ZeRO 1-3, tag from ds_ckpt/latest\n"
        "  shardpoint convert --from dcp torchtitan/step-100 sp_ckpt/     # DCP directory in\n"
        "  shardpoint convert --to dcp sp_ckpt/ dcp_out/                  # and back out\n"
        "  shardpoint convert --from torch out/ckpt.pt sp_ckpt/           # nanoGPT-style torch.save file\n"
        "  shardpoint convert --from hf gpt2-local/ sp_ckpt/              # safetensors weights -> model/<name>\n"
        "  shardpoint convert --to hf sp_ckpt/ hf_out/ --max-shard-size 2GB --dtype bfloat16 --config cfg/\n"
        "one side is always shardpoint (the default of --from and --to)."
    ),
}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="shardpoint", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")

    def cmd(name: str, help: str, aliases: tuple[str, ...] = ()) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=help, description=help, epilog=_EXAMPLES[name], aliases=list(aliases),
                              formatter_class=argparse.RawDescriptionHelpFormatter)

    ls = cmd("ls", "table of the checkpoints under a CheckpointManager root (step, time, size, world size, status)")
    ls.add_argument("root")
    ls.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
    ls.add_argument("--memory-path", default=None, help="where the memory tier keeps snapshots on this host "
                    "(MemoryTier(path=...); default /dev/shm/shardpoint): its snapshots of ROOT are listed too")

    ins = cmd("inspect", "tree of a checkpoint's keys: shape, dtype, bytes, how each tensor was sharded (manifest only)",
              aliases=("info",))
    ins.add_argument("path")
    ins.add_argument("--json", action="store_true", help="print JSON instead of a tree")

    ver = cmd("verify", "re-read every chunk and check its checksum; exit 1 naming damaged keys and files")
    ver.add_argument("path")
    ver.add_argument("--json", action="store_true", help="print JSON instead of text")

    dif = cmd("diff", "keys added, removed, changed in shape/dtype/value, and each tensor's max |a - b| (streaming)")
    dif.add_argument("a")
    dif.add_argument("b")
    dif.add_argument("--atol", type=float, default=0.0, help="tensors whose max |a - b| is at most this count as equal")
    dif.add_argument("--json", action="store_true", help="print JSON instead of text")
    dif.add_argument("-q", "--quiet", action="store_true", help="no progress bar")

    pr = cmd("prune", "delete old checkpoints under a root by CheckpointManager's retention rules")
    pr.add_argument("root")
    pr.add_argument("--keep-last", type=int, required=True, metavar="N", help="keep the newest N committed checkpoints")
    pr.add_argument("--keep-every", type=int, default=None, metavar="K", help="also keep steps that are multiples of K")
    pr.add_argument("--incomplete", action="store_true",
                    help="also delete step folders that never committed (only when no save is running)")
    pr.add_argument("--dry-run", action="store_true", help="print what would be deleted and delete nothing")

    exp = cmd("export", "copy one checkpoint to a self-contained folder: chunks stored by reference are copied in")
    exp.add_argument("src")
    exp.add_argument("dst")
    exp.add_argument("--overwrite", action="store_true", help="replace a checkpoint already at DST")

    conv = cmd("convert", "convert a checkpoint between shardpoint and DeepSpeed, DCP, torch.save or HF safetensors")
    conv.add_argument("src")
    conv.add_argument("dst")
    conv.add_argument("--from", dest="src_format", default="shardpoint", choices=["shardpoint", "deepspeed", "dcp", "torch", "hf"],
                      help="format of SRC (default shardpoint)")
    conv.add_argument("--to", dest="dst_format", default="shardpoint", choices=["shardpoint", "dcp", "hf"],
                      help="format of DST (default shardpoint)")
    conv.add_argument("--overwrite", action="store_true", help="replace an existing shardpoint checkpoint at DST")
    conv.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    conv.add_argument("--no-progress", action="store_true", help=argparse.SUPPRESS)  # the old spelling of --quiet
    g = conv.add_argument_group("--from deepspeed")
    g.add_argument("--tag", default=None, help="DeepSpeed tag (default: the one named by SRC/latest)")
    g = conv.add_argument_group("--from torch")
    g.add_argument("--key", default=None, help="put the loaded object under this key (model: a bare state_dict)")
    g = conv.add_argument_group("--from hf / --to hf")
    g.add_argument("--prefix", default="model/", help="checkpoint key prefix of the weights (default model/; '' for all)")
    g.add_argument("--rename", action="append", default=[], metavar="OLD=NEW",
                   help="rename weight-name prefixes, e.g. --rename _orig_mod.= (repeatable)")
    g.add_argument("--max-shard-size", default="5GB", help="--to hf: largest file before sharding (default 5GB)")
    g.add_argument("--dtype", default=None, help="--to hf: cast floating-point weights, e.g. bfloat16")
    g.add_argument("--config", default=None, help="--to hf: a config.json (or its folder) to copy beside the weights")
    g.add_argument("--no-tie", action="store_true", help="--from hf: do not add tied weights found from config.json")
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``shardpoint`` command; returns the exit code."""
    args = _parser().parse_args(argv)
    from .errors import CheckpointNotFoundError, CorruptCheckpointError, ShardpointError

    handler: Callable[[argparse.Namespace], int] = {
        "ls": _ls, "inspect": _inspect, "info": _inspect, "verify": _verify, "diff": _diff, "prune": _prune, "export": _export,
        "convert": _convert,
    }[args.cmd]
    try:
        return handler(args)
    except CheckpointNotFoundError as e:
        return _not_found(e, [getattr(args, n, None) for n in ("path", "a", "b", "root")])
    except CorruptCheckpointError as e:
        _err(f"damaged: {e}")
        return DIFFERS
    except (ShardpointError, ValueError, OSError) as e:
        _err(str(e))
        return USAGE
    except KeyboardInterrupt:  # pragma: no cover
        return 130


def _err(msg: str) -> None:
    print(f"shardpoint: error: {msg}", file=sys.stderr)


def _not_found(e: Exception, paths: list[str | None]) -> int:
    """An incomplete checkpoint (a folder of data files whose save never committed) is
    damage (1); nothing at all at the path is a usage error (2)."""
    from .format.manifest import MANIFEST_NAME

    for path in paths:
        if path and os.path.isdir(path) and not os.path.exists(os.path.join(path, MANIFEST_NAME)) and any(os.scandir(path)):
            _err(f"{path} is incomplete: it has files but no {MANIFEST_NAME}, so its save never committed; "
                 "it cannot be loaded (delete it, or `shardpoint prune ROOT --incomplete`)")
            return DIFFERS
    _err(str(e))
    return USAGE


def _console(stderr: bool = False) -> Console:
    from rich.console import Console

    f = sys.stderr if stderr else sys.stdout
    # not a terminal (a pipe, a test): wide and plain, so nothing is cut or coloured
    return Console(file=f, width=None if f.isatty() else 200, no_color=not f.isatty(), highlight=False)


def _human(n: int | None) -> str:
    if n is None:
        return "-"
    x = float(n)
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if x < 1000 or unit == "TB":
            return f"{x:.0f} {unit}" if unit == "B" else f"{x:.1f} {unit}"
        x /= 1000
    return str(n)  # pragma: no cover


def _dtype(d: object) -> str:
    return str(d).removeprefix("torch.")


# -- ls -----------------------------------------------------------------------------------------------
def _ls(args: argparse.Namespace) -> int:
    from .storage import storage_for
    from .tiers.config import DEFAULT_PATH
    from .tiers.shm import snapshot_rows

    rows: list[dict[str, Any]] = [{**r, "tier": "durable"} for r in _checkpoints(args.root)]
    rows += snapshot_rows(storage_for(args.root).url, args.memory_path or DEFAULT_PATH)  # the memory tier's
    if args.json:
        print(json.dumps(rows, indent=2))
        return OK
    from rich.table import Table

    t = Table(title=f"checkpoints under {args.root}")
    for c in ("step", "tier", "time (UTC)", "size", "referenced", "world size", "status", "health", "metrics", "latest"):
        t.add_column(c, justify="right" if c in ("step", "size", "referenced", "world size") else "left")
    for r in rows:
        t.add_row(str(r["step"]), r["tier"], r["time"] or "-", _human(r["size"]), _human(r["referenced"]) if r["referenced"] else "-",
                  str(r["world_size"] or "-"), r["status"], _health(r["nonfinite"], r.get("unfit")),
                  " ".join(f"{k}={v:.4g}" for k, v in (r["metrics"] or {}).items()) or "-",
                  "<- latest" if r["latest"] else "")
    _console().print(t)
    if not rows:
        print(f"no step-* folders under {args.root}")
    return OK


def _health(nonfinite: list[str] | None, unfit: list[str] | None = None) -> str:
    """A checkpoint's health in a table cell: the keys holding a NaN or an infinity, and
    whether they make it unfit to resume from (an infinity in a buffer or an extra does not)."""
    if nonfinite is None:
        return "-"  # saved before health was recorded
    if not nonfinite:
        return "finite"
    if unfit is None:  # the rule not applied here
        return f"NaN/inf in {len(nonfinite)} key(s)"
    if unfit:
        return f"unfit: NaN/inf in {len(unfit)} key(s)"
    return f"fit: inf in {len(nonfinite)} buffer/extra key(s)"


def _checkpoints(root: str) -> list[CheckpointRow]:
    import re

    from .errors import CheckpointNotFoundError
    from .format.manifest import MANIFEST_NAME
    from .manager import CheckpointManager, referenced_files

    if "://" not in root and not os.path.isdir(root):
        raise CheckpointNotFoundError(f"{root} is not a directory")
    mgr = CheckpointManager(root)
    committed = {i.step: i for i in mgr.list()}
    latest = mgr.latest()
    needed = referenced_files(mgr.storage, [mgr.step_dir(s) for s, i in committed.items() if not i.damaged]) or {}
    rows: list[CheckpointRow] = []
    for name in mgr.storage.list_dirs():
        m = re.fullmatch(r"step-(\d+)", name)
        if not m:
            continue
        step = int(m.group(1))
        info = committed.get(step)
        if info is not None:
            rows.append({"step": step, "path": info.path, "time": info.time.strftime("%Y-%m-%d %H:%M:%S"),
                         "size": info.size, "referenced": info.referenced, "world_size": info.world_size,
                         "status": "committed", "latest": latest is not None and latest.step == step,
                         "nonfinite": None if info.nonfinite is None else list(info.nonfinite),
                         "unfit": list(info.unfit), "metrics": dict(info.metrics)})
        else:
            status = "unreadable manifest" if mgr.storage.child(name).exists(MANIFEST_NAME) else "incomplete"
            if status == "incomplete" and name in needed:
                status = "referenced data only"  # retention dropped it; kept checkpoints still read these files
            rows.append({"step": step, "path": mgr.storage.child(name).url, "time": None, "size": None,
                         "referenced": None, "world_size": None, "status": status, "latest": False,
                         "nonfinite": None, "unfit": None, "metrics": None})
    return sorted(rows, key=lambda r: r["step"])


# -- inspect ------------------------------------------------------------------------------------------
def _sharding(shape: tuple[int, ...], chunks: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]) -> str:
    """How a tensor was split when saved, in words."""
    if len(chunks) <= 1:
        return "whole"
    dims = {d for _, sizes in chunks for d, (s, n) in enumerate(zip(sizes, shape)) if s != n}
    if len(dims) == 1:
        d = dims.pop()
        sizes = sorted({sz[d] for _, sz in chunks})
        even = "even" if len(sizes) == 1 else f"{sizes[0]}..{sizes[-1]}"
        return f"{len(chunks)} shards on dim {d} ({even})"
    return f"{len(chunks)} boxes on dims {sorted(dims)}"


def _inspect(args: argparse.Namespace) -> int:
    from .api import metadata
    from .tree import decode_key

    m = metadata(args.path)
    if args.json:
        out = {
            "path": args.path, "format_version": m.version, "world_size": m.world_size, "created": m.created.isoformat(),
            "nbytes": m.nbytes, "referenced_nbytes": m.referenced, "nonfinite": m.nonfinite, "metrics": m.metrics,
            "tensors": {k: {"shape": list(t.shape), "dtype": _dtype(t.dtype), "nbytes": t.nbytes,
                            "sharding": _sharding(t.shape, t.chunks),
                            "chunks": [{"offsets": list(o), "sizes": list(s)} for o, s in t.chunks]}
                        for k, t in m.tensors.items()},
            "values": m.values,
            "per_rank": m.per_rank,
        }
        print(json.dumps(out, indent=2, default=repr))
        return OK
    from rich.markup import escape
    from rich.tree import Tree

    tree = Tree(f"{escape(args.path)}: format v{m.version}, saved by {m.world_size} rank(s) at "
                f"{m.created.strftime('%Y-%m-%d %H:%M:%S')} UTC, {_human(m.nbytes)} in files"
                + (f", {_human(m.referenced)} by reference to earlier checkpoints" if m.referenced else "")
                + (f"; {_health(m.nonfinite)}" if m.nonfinite is not None else "")
                + "".join(f", {k}={v:.4g}" for k, v in m.metrics.items()))
    nodes: dict[tuple[str | int, ...], Tree] = {(): tree}

    def parent(path: tuple[str | int, ...]) -> Tree:
        if path not in nodes:
            nodes[path] = parent(path[:-1]).add(escape(str(path[-1])) + "/")
        return nodes[path]

    leaves: list[tuple[tuple[str | int, ...], str]] = []
    for k, t in m.tensors.items():
        leaves.append((decode_key(k), f"{_dtype(t.dtype)}{list(t.shape)}  {_human(t.nbytes)}  {_sharding(t.shape, t.chunks)}"))
    for k, v in m.values.items():
        leaves.append((decode_key(k), f"= {v!r}"))
    for k, ranks in m.per_rank.items():
        leaves.append((decode_key(k), f"per rank, saved by ranks {ranks}"))
    for path, text in sorted(leaves, key=lambda x: tuple(str(s) for s in x[0])):
        name = str(path[-1]) if path else "(root)"
        parent(path[:-1]).add(f"{escape(name)}  {escape(text)}")
    _console().print(tree)
    return OK


# -- verify -------------------------------------------------------------------------------------------
def _verify(args: argparse.Namespace) -> int:
    from .verify import verify

    res = verify(args.path)
    if args.json:
        print(json.dumps({"path": res.path, "ok": res.ok, "tensors": res.tensors, "checked_bytes": res.checked_bytes,
                          "problems": [{"file": p.file, "key": p.key, "rank": p.rank, "reason": p.reason} for p in res.problems],
                          "damaged_files": res.damaged_files, "damaged_keys": res.damaged_keys,
                          "unlisted": res.unlisted}, indent=2))
    else:
        print(res.summary())
    return OK if res.ok else DIFFERS


# -- diff ---------------------------------------------------------------------------------------------
#: Bytes of tensors read from each side per step of ``diff``.
DIFF_BUDGET = 128 << 20


def diff(a: str, b: str, *, atol: float = 0.0, progress: bool = False) -> DiffResult:
    """Compare two checkpoints, reading a group of at most :data:`DIFF_BUDGET` bytes
    of tensors from each side at a time. Returns ``added`` / ``removed`` keys,
    ``changed`` ({key: what changed}) and ``max_abs_diff`` ({tensor key: value} for
    every tensor present in both with the same shape and dtype)."""
    import torch

    from .api import load_full, metadata
    from .interop._progress import Progress
    from .tree import decode_key

    ma, mb = metadata(a), metadata(b)
    ka = set(ma.tensors) | set(ma.values) | set(ma.per_rank)
    kb = set(mb.tensors) | set(mb.values) | set(mb.per_rank)
    changed: dict[str, str] = {}
    same: list[str] = []
    for k in sorted(ka & kb):
        ta, tb = ma.tensors.get(k), mb.tensors.get(k)
        if (ta is None) != (tb is None) or (k in ma.per_rank) != (k in mb.per_rank):
            changed[k] = "kind (tensor / value / per-rank) differs"
        elif ta is not None and tb is not None:
            if ta.shape != tb.shape or ta.dtype != tb.dtype:
                changed[k] = f"{_dtype(ta.dtype)}{list(ta.shape)} -> {_dtype(tb.dtype)}{list(tb.shape)}"
            else:
                same.append(k)
        elif k in ma.values and ma.values[k] != mb.values[k] and not (ma.values[k] != ma.values[k] and mb.values[k] != mb.values[k]):
            changed[k] = f"{ma.values[k]!r} -> {mb.values[k]!r}"
        elif k in ma.per_rank and ma.per_rank[k] != mb.per_rank[k]:
            changed[k] = f"saved by ranks {ma.per_rank[k]} -> {mb.per_rank[k]}"
    diffs: dict[str, float] = {}
    total = sum(ma.tensors[k].nbytes for k in same)
    with Progress(total, f"comparing {a} and {b}", enabled=progress) as bar:
        i = 0
        while i < len(same):
            group: list[str] = []
            size = 0
            while i < len(same) and (not group or size + ma.tensors[same[i]].nbytes <= DIFF_BUDGET):
                group.append(same[i])
                size += ma.tensors[same[i]].nbytes
                i += 1
            ga, gb = load_full(a, keys=group), load_full(b, keys=group)
            for k in group:
                x, y = _at(ga, decode_key(k)), _at(gb, decode_key(k))
                if x.dtype == torch.bool:
                    x, y = x.to(torch.uint8), y.to(torch.uint8)
                d = (x.to(torch.float64) - y.to(torch.float64)).abs()
                if x.is_floating_point():
                    d[torch.isnan(x) & torch.isnan(y)] = 0.0
                diffs[k] = float(d.max()) if d.numel() else 0.0
                if not (diffs[k] <= atol):
                    changed[k] = f"max |a - b| = {diffs[k]:.6g}"
                bar.advance(ma.tensors[k].nbytes)
            del ga, gb
    return {"a": a, "b": b, "added": sorted(kb - ka), "removed": sorted(ka - kb), "changed": dict(sorted(changed.items())),
            "max_abs_diff": diffs}


def _at(tree: Any, path: tuple[str | int, ...]) -> Any:  # Any: a loaded tree, indexed along a path it has
    for seg in path:
        tree = tree[seg]
    return tree


def _diff(args: argparse.Namespace) -> int:
    res = diff(args.a, args.b, atol=args.atol, progress=not args.quiet)
    differs = bool(res["added"] or res["removed"] or res["changed"])
    if args.json:
        res["identical"] = not differs
        print(json.dumps(res, indent=2, default=repr))
        return DIFFERS if differs else OK
    for k in res["added"]:
        print(f"+ {k}")
    for k in res["removed"]:
        print(f"- {k}")
    for k, what in res["changed"].items():
        print(f"~ {k}: {what}")
    n = len(res["max_abs_diff"])
    print(f"{'differ' if differs else 'identical'}: {len(res['added'])} added, {len(res['removed'])} removed, "
          f"{len(res['changed'])} changed; {n} tensor(s) compared")
    return DIFFERS if differs else OK


# -- prune --------------------------------------------------------------------------------------------
def _export(args: argparse.Namespace) -> int:
    from ._export import export_checkpoint
    from .storage import storage_for

    export_checkpoint(storage_for(args.src), storage_for(args.dst), overwrite=args.overwrite)
    print(f"exported {args.src} -> {args.dst} (self-contained)")
    return OK


def _prune(args: argparse.Namespace) -> int:
    from .manager import CheckpointManager, drop, referenced_files

    if args.keep_last < 1 or (args.keep_every is not None and args.keep_every < 1):
        _err("--keep-last and --keep-every must be at least 1")
        return USAGE
    rows = _checkpoints(args.root)
    committed = [r["step"] for r in rows if r["status"] == "committed"]
    keep = set(sorted(committed)[-args.keep_last:])
    keep |= {r["step"] for r in rows if r["latest"]}  # never the one `latest` names
    if args.keep_every:
        keep |= {s for s in committed if s % args.keep_every == 0}
    doomed = [r for r in rows if (r["status"] == "committed" and r["step"] not in keep)
              or (r["status"] != "committed" and args.incomplete)]
    mgr = CheckpointManager(args.root)
    verb = "would remove" if args.dry_run else "removed"
    needed = referenced_files(mgr.storage, [mgr.step_dir(s) for s in committed if s in keep])
    if needed is None:
        _err("a kept checkpoint's manifest cannot be read, so which data it refers to is unknown; "
             "nothing removed (run `shardpoint ls` and `verify` on it)")
        return USAGE
    for r in doomed:
        name = mgr.step_dir(r["step"])
        if not args.dry_run:
            drop(mgr.storage.child(name), needed.get(name))  # keeps data files a kept checkpoint refers to
        print(f"{verb} {name} ({r['status']}, {_human(r['size'])})")
    kept = sorted(s for s in committed if s in keep)
    print(f"kept {len(kept)} committed checkpoint(s): steps {kept}")
    left = [r["step"] for r in rows if r["status"] != "committed" and not args.incomplete]
    if left:
        print(f"left {len(left)} incomplete folder(s) alone (steps {left}); pass --incomplete to delete them")
    return OK


# -- convert ------------------------------------------------------------------------------------------
def _convert(args: argparse.Namespace) -> int:
    src_f, dst_f = args.src_format, args.dst_format
    quiet = args.quiet or args.no_progress
    rename = dict(_pair(r) for r in args.rename) or None
    if (src_f == "shardpoint") == (dst_f == "shardpoint"):
        _err("one side of convert is shardpoint: give --from FORMAT (into shardpoint) or --to FORMAT (out of it), not both")
        return USAGE
    if src_f == "deepspeed":
        from .interop.deepspeed import convert

        convert(args.src, args.dst, tag=args.tag, progress=not quiet, overwrite=args.overwrite)
    elif src_f == "dcp":
        from .interop.dcp import import_dcp

        import_dcp(args.src, args.dst, progress=not quiet, overwrite=args.overwrite)
    elif src_f == "torch":
        from .interop.torchsave import import_torch

        import_torch(args.src, args.dst, key=args.key, overwrite=args.overwrite)
    elif src_f == "hf":
        from .interop.hf import import_hf

        import_hf(args.src, args.dst, prefix=args.prefix, key_map=rename, tie=not args.no_tie, progress=not quiet,
                  overwrite=args.overwrite)
    elif dst_f == "dcp":
        from .interop.dcp import export_dcp

        if os.path.exists(os.path.join(args.dst, ".metadata")) and not args.overwrite:
            _err(f"a DCP checkpoint already exists at {args.dst}; pass --overwrite to replace it")
            return USAGE
        left = export_dcp(args.src, args.dst, progress=not quiet)
        if left:
            print(f"left out per-rank values, which DCP cannot hold: {', '.join(left)}")
    else:
        from .interop.hf import export_hf

        files = export_hf(args.src, args.dst, prefix=args.prefix, key_map=rename, max_shard_size=args.max_shard_size,
                          dtype=args.dtype, config=args.config, progress=not quiet)
        print(f"wrote {', '.join(files)}")
    print(f"converted {args.src} ({src_f}) -> {args.dst} ({dst_f})")
    return OK


def _pair(s: str) -> tuple[str, str]:
    if "=" not in s:
        from .errors import UsageError

        raise UsageError(f"--rename {s!r}: write OLD=NEW (NEW may be empty)")
    old, new = s.split("=", 1)
    return old, new


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
