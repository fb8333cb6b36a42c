"""``shardpoint diff``, ``export``, ``prune`` and ``convert``."""

from __future__ import annotations

import argparse
import os
from typing import Any, TypedDict

from typing_extensions import (
    NotRequired,  # typing has it from Python 3.11; torch depends on typing_extensions
)

from ..errors import CorruptCheckpointError
from .catalog import COMMITTED, DAMAGED, INCOMPLETE, REFERENCED, Entry, catalog
from .output import DIFFERS, OK, USAGE, error, human, print_json, progress_bar, short_dtype


class DiffResult(TypedDict):
    """What :func:`diff` returns (``shardpoint diff --json`` adds ``identical``)."""

    a: str
    b: str
    added: list[str]
    removed: list[str]
    changed: dict[str, str]
    max_abs_diff: dict[str, float]
    identical: NotRequired[bool]


# -- diff ---------------------------------------------------------------------------------------------
#: Bytes of tensors read from each side per step of ``diff``.
DIFF_BUDGET = 128 << 20


def diff(a: str, b: str, *, atol: float = 0.0, progress: bool = False) -> DiffResult:
    """Compare two checkpoints, reading a group of at most :data:`DIFF_BUDGET` bytes
    of tensors from each side at a time. Returns ``added`` / ``removed`` keys,
    ``changed`` ({key: what changed}) and ``max_abs_diff`` ({tensor key: value} for
    every tensor present in both with the same shape and dtype)."""
    import torch

    from ..api import load_full, metadata
    from ..interop._progress import Progress
    from ..tree import decode_key

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
                changed[k] = f"{short_dtype(ta.dtype)}{list(ta.shape)} -> {short_dtype(tb.dtype)}{list(tb.shape)}"
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


def diff_command(args: argparse.Namespace) -> int:
    """``shardpoint diff A B``: exit 1 when they differ."""
    res = diff(args.a, args.b, atol=args.atol, progress=not args.quiet)
    differs = bool(res["added"] or res["removed"] or res["changed"])
    if args.json:
        res["identical"] = not differs
        print_json(res)
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


# -- export -------------------------------------------------------------------------------------------
def export_command(args: argparse.Namespace) -> int:
    """``shardpoint export SRC DST``: a self-contained copy, with a progress bar on a terminal."""
    from .._export import export_checkpoint
    from ..load.locate import read_manifest
    from ..storage import storage_for

    if _refuse_same(args.src, args.dst, "export"):
        return USAGE
    src = storage_for(args.src)
    man = read_manifest(src)
    with progress_bar(f"exporting {args.src}", man.own_bytes() + man.referenced_bytes(), args.quiet) as bar:
        export_checkpoint(src, storage_for(args.dst), overwrite=args.overwrite, advance=bar.advance)
    print(f"exported {args.src} -> {args.dst} (self-contained)")
    return OK


def _refuse_same(src: str, dst: str, what: str) -> bool:
    """Refuse (True, said) a destination that is the source or inside it: writing there
    would change, or destroy, the checkpoint being read."""
    if "://" in src or "://" in dst:
        same = src.rstrip("/") == dst.rstrip("/")
        inside = dst.startswith(src.rstrip("/") + "/")
    else:
        a, b = os.path.realpath(src), os.path.realpath(dst)
        same, inside = a == b, b.startswith(a.rstrip(os.sep) + os.sep)
    if same or inside:
        where = "the source itself" if same else "inside the source"
        error(f"{what} {src} -> {dst}: the destination is {where}; writing there would change the checkpoint being read. "
              "Nothing was written; give another DST")
    return same or inside


# -- prune --------------------------------------------------------------------------------------------
def prune_command(args: argparse.Namespace) -> int:
    """``shardpoint prune ROOT``: exit 0, or 2 when it was not asked to remove anything,
    ROOT is not a manager root, or a kept checkpoint cannot be read (then nothing is removed)."""
    try:
        return _prune(args)
    except CorruptCheckpointError as e:  # never 1: a damaged checkpoint is left alone and said so
        error(str(e))
        return USAGE


def _prune(args: argparse.Namespace) -> int:
    from ..format.manifest import MANIFEST_NAME
    from ..manager import CheckpointManager, drop, referenced_files

    if args.keep_last is None and not args.incomplete:
        error("say what to remove: --keep-last N (keep the newest N checkpoints, remove older ones), "
              "--incomplete (remove folders whose save never committed), or both")
        return USAGE
    if (args.keep_last is not None and args.keep_last < 1) or (args.keep_every is not None and args.keep_every < 1):
        error("--keep-last and --keep-every must be at least 1")
        return USAGE
    cat = catalog(args.root)
    if cat.kind != "manager":
        more = (": the trainer removes its own (HF save_total_limit, Lightning save_top_k)"
                if cat.entries else "")
        error(f"{args.root} is not a CheckpointManager root (it has no step-N folders); prune removes only a "
              f"manager's step folders{more}")
        return USAGE
    entries, root = cat.entries, cat.storage
    sound = sorted(e.step for e in entries if e.status == COMMITTED and e.step is not None)
    keep = set(sound if args.keep_last is None else sound[-args.keep_last:])
    keep |= {e.step for e in entries if e.latest and e.step is not None}  # never the one `latest` names
    if args.keep_every:
        keep |= {s for s in sound if s % args.keep_every == 0}
    damaged = [e.step for e in entries if e.status == DAMAGED and e.step is not None]
    guard = max(damaged, default=-1)  # a damaged manifest hides which older data it refers to

    def wanted(e: Entry) -> bool:
        return ((e.status == COMMITTED and e.step not in keep) or (e.status == INCOMPLETE and args.incomplete)
                or e.status == REFERENCED)

    doomed = [e for e in entries if wanted(e) and e.step is not None and e.step > guard]
    held = [e for e in entries if wanted(e) and e not in doomed and e.status != REFERENCED]
    kept = sorted(s for s in sound if s in keep or any(h.step == s for h in held))
    needed = referenced_files(root, [CheckpointManager.step_dir(s) for s in kept])
    if needed is None:
        error("a kept checkpoint's manifest cannot be read, so which data it refers to is unknown; nothing removed "
              "(run `shardpoint ls` and `verify` on it)")
        return USAGE
    verb = "would remove" if args.dry_run else "removed"
    if not args.dry_run:  # every manifest first: none left behind that refers to a file removed below
        for e in doomed:
            name = CheckpointManager.step_dir(e.step or 0)
            if not (e.status == REFERENCED and needed.get(name)):
                root.child(name).remove(MANIFEST_NAME)
    for e in doomed:
        name = CheckpointManager.step_dir(e.step or 0)
        still = needed.get(name)
        if e.status == REFERENCED and still:
            continue  # still read by a kept checkpoint: reported below
        if not args.dry_run:
            drop(root.child(name), still)  # keeps the data files a kept checkpoint refers to
        size = f", {human(e.info.size)}" if e.info is not None else ""
        print(f"{verb} {name} ({e.status}{size})" + (f"; kept its {len(still)} data file(s) that kept checkpoints read"
                                                      if still else ""))
    print(f"kept {len(kept)} committed checkpoint(s): steps {kept}")
    if damaged:
        print(f"left damaged step(s) {damaged} alone: prune never removes a damaged checkpoint (`shardpoint verify` "
              "says what is wrong; restore it from a copy)")
    if held:
        print(f"left step(s) {[e.step for e in held]} alone: step {guard}'s manifest is damaged, so which older data it "
              "refers to (incremental saves) is unknown; prune them once it is repaired")
    refs = [e.step for e in entries if e.status == REFERENCED and needed.get(CheckpointManager.step_dir(e.step or 0))]
    if refs:
        print(f"kept the data of dropped step(s) {refs}: kept checkpoints read it (incremental saves)")
    left = [e.step for e in entries if e.status == INCOMPLETE and not args.incomplete]
    if left:
        print(f"left {len(left)} incomplete folder(s) alone (steps {left}); pass --incomplete to delete them "
              "(when no save is running)")
    return OK


# -- convert ------------------------------------------------------------------------------------------
def convert_command(args: argparse.Namespace) -> int:
    """``shardpoint convert``: one side is shardpoint; never into its own source."""
    src_f, dst_f = args.src_format, args.dst_format
    quiet = args.quiet or args.no_progress
    rename = dict(_pair(r) for r in args.rename) or None
    if (src_f == "shardpoint") == (dst_f == "shardpoint"):
        error("one side of convert is shardpoint: give --from FORMAT (into shardpoint) or --to FORMAT (out of it), not both")
        return USAGE
    if _refuse_same(args.src, args.dst, "convert"):
        return USAGE
    if src_f == "deepspeed":
        from ..interop.deepspeed import convert

        if args.tag is not None and os.path.isdir(args.src) and not os.path.isdir(os.path.join(args.src, args.tag)):
            error(_no_tag(args.src, args.tag))
            return USAGE
        convert(args.src, args.dst, tag=args.tag, progress=not quiet, overwrite=args.overwrite)
    elif src_f == "dcp":
        from ..interop.dcp import import_dcp

        import_dcp(args.src, args.dst, progress=not quiet, overwrite=args.overwrite)
    elif src_f == "torch":
        from ..interop.torchsave import import_torch

        import_torch(args.src, args.dst, key=args.key, overwrite=args.overwrite)
    elif src_f == "hf":
        from ..interop.hf import import_hf

        import_hf(args.src, args.dst, prefix=args.prefix, key_map=rename, tie=not args.no_tie, progress=not quiet,
                  overwrite=args.overwrite)
    elif dst_f == "dcp":
        from ..interop.dcp import export_dcp

        if os.path.exists(os.path.join(args.dst, ".metadata")) and not args.overwrite:
            error(f"a DCP checkpoint already exists at {args.dst}; pass --overwrite to replace it")
            return USAGE
        left = export_dcp(args.src, args.dst, progress=not quiet)
        if left:
            print(f"left out per-rank values, which DCP cannot hold: {', '.join(left)}")
    else:
        from ..interop.hf import export_hf

        files = export_hf(args.src, args.dst, prefix=args.prefix, key_map=rename, max_shard_size=args.max_shard_size,
                          dtype=args.dtype, config=args.config, progress=not quiet)
        print(f"wrote {', '.join(files)}")
    print(f"converted {args.src} ({src_f}) -> {args.dst} ({dst_f})")
    return OK


def _no_tag(src: str, tag: str) -> str:
    """``--tag`` names no folder of ``src``: the tags there are (folders of ZeRO optimizer files)."""
    tags = sorted(n for n in os.listdir(src) if os.path.isdir(os.path.join(src, n))
                  and any(f.endswith("_optim_states.pt") for f in os.listdir(os.path.join(src, n))))
    latest = ""
    try:
        with open(os.path.join(src, "latest")) as f:
            latest = f.read().strip()
    except OSError:
        pass
    named = f" ({src}/latest names {latest!r})" if latest else ""
    there = f"its tags: {', '.join(tags)}{named}" if tags else f"it holds no tag folder (no *_optim_states.pt files){named}"
    return (f"DeepSpeed tag {tag!r} is not in {src}: {there}. Pass one of them with --tag, or leave --tag out to "
            "convert the one `latest` names")


def _pair(s: str) -> tuple[str, str]:
    if "=" not in s:
        from ..errors import UsageError

        raise UsageError(f"--rename {s!r}: write OLD=NEW (NEW may be empty)")
    old, new = s.split("=", 1)
    return old, new
