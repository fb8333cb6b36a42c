"""``shardpoint inspect`` (the manifest: keys, shapes, sharding, health per key) and
``shardpoint verify`` (every byte against its checksum; a folder of checkpoints: each)."""

from __future__ import annotations

import argparse
import os
from typing import TYPE_CHECKING, Any

from .catalog import COMMITTED, DAMAGED, Catalog, Entry, catalog
from .output import DIFFERS, OK, BarMeter, human, make_console, print_json, short_dtype

if TYPE_CHECKING:
    from ..verify import VerifyResult


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


def inspect_command(args: argparse.Namespace) -> int:
    """``shardpoint inspect PATH``: the manifest as a tree (or JSON), each key that held a
    NaN or an infinity marked. Reads no tensor data."""
    from ..api import metadata
    from ..health import HealthRule
    from ..load.locate import read_manifest
    from ..storage import storage_for
    from ..tree import decode_key

    m = metadata(args.path)
    man = read_manifest(storage_for(args.path))  # the health record in full: which key held a NaN, and its role
    nonfinite, nan = man.nonfinite, set(man.nan or [])
    unfit = set(HealthRule().unfit(man.nonfinite, man.nan, man.roles))

    def health(key: str) -> str | None:
        """``nan``, ``inf``, ``finite``, or None when not recorded."""
        if nonfinite is None:
            return None
        if key not in nonfinite:
            return "finite"
        return "nan" if man.nan is None or key in nan else "inf"

    if args.json:
        out = {
            "path": args.path, "format_version": m.version, "world_size": m.world_size, "created": m.created.isoformat(),
            "nbytes": m.nbytes, "referenced_nbytes": m.referenced, "nonfinite": m.nonfinite,
            "nan": None if man.nan is None else sorted(man.nan), "unfit": sorted(unfit), "metrics": m.metrics,
            "tensors": {k: {"shape": list(t.shape), "dtype": short_dtype(t.dtype), "nbytes": t.nbytes,
                            "sharding": _sharding(t.shape, t.chunks), "health": health(k),
                            "chunks": [{"offsets": list(o), "sizes": list(s)} for o, s in t.chunks]}
                        for k, t in m.tensors.items()},
            "values": m.values,
            "per_rank": m.per_rank,
        }
        print_json(out)
        return OK
    from rich.markup import escape
    from rich.tree import Tree

    def mark(key: str) -> str:
        h = health(key)
        if h in (None, "finite"):
            return ""
        return f"  [{'NaN' if h == 'nan' else 'inf'}{', unfit' if key in unfit else ''}]"

    if nonfinite:
        verdict = "UNFIT to resume from" if unfit else "fit to resume from"
        where = f"; health: {verdict}, NaN/inf in {len(nonfinite)} key(s), marked [NaN] or [inf] below"
    else:
        where = "; health: finite" if nonfinite is not None else "; health: not recorded"
    tree = Tree(f"{escape(args.path)}: format v{m.version}, saved by {m.world_size} rank(s) at "
                f"{m.created.strftime('%Y-%m-%d %H:%M:%S')} UTC, {human(m.nbytes)} in files"
                + (f", {human(m.referenced)} by reference to earlier checkpoints" if m.referenced else "")
                + escape(where) + "".join(f", {k}={v:.4g}" for k, v in m.metrics.items()))
    nodes: dict[tuple[str | int, ...], Tree] = {(): tree}

    def parent(path: tuple[str | int, ...]) -> Tree:
        if path not in nodes:
            nodes[path] = parent(path[:-1]).add(escape(str(path[-1])) + "/")
        return nodes[path]

    leaves: list[tuple[tuple[str | int, ...], str]] = []
    for k, t in m.tensors.items():
        leaves.append((decode_key(k), f"{short_dtype(t.dtype)}{list(t.shape)}  {human(t.nbytes)}  "
                                      f"{_sharding(t.shape, t.chunks)}{mark(k)}"))
    for k, v in m.values.items():
        leaves.append((decode_key(k), f"= {v!r}"))
    for k, ranks in m.per_rank.items():
        inside = sorted({mark(n) for n in nonfinite or [] if n == k or n.startswith(k + "/")} - {""})
        leaves.append((decode_key(k), f"per rank, saved by ranks {ranks}{''.join(inside)}"))
    for path, text in sorted(leaves, key=lambda x: tuple(str(s) for s in x[0])):
        name = str(path[-1]) if path else "(root)"
        parent(path[:-1]).add(f"{escape(name)}  {escape(text)}")
    make_console().print(tree)
    return OK


# -- verify -------------------------------------------------------------------------------------------
def verify_command(args: argparse.Namespace) -> int:
    """``shardpoint verify PATH``: every byte against its checksum, and the health the
    save recorded; exit 1 when damaged. A folder of checkpoints: each of them."""
    from ..format.manifest import MANIFEST_NAME
    from ..storage import storage_for

    st = storage_for(args.path)
    if not st.exists(MANIFEST_NAME) and ("://" in args.path or os.path.isdir(args.path)):
        cat = catalog(st)
        if cat.kind == "manager" or any(e.status in (COMMITTED, DAMAGED) for e in cat.entries):
            return _verify_each(args, cat)
    res = _verify_one(st, args.quiet)
    if args.json:
        print_json(_verify_doc(res))
    else:
        print(res.summary())
    return OK if res.ok else DIFFERS


def _verify_one(path: Any, quiet: bool) -> VerifyResult:  # Any: a path or a Storage
    from ..storage import storage_for
    from ..verify import verify

    st = storage_for(path)
    meter = BarMeter(f"verifying {st.url}", quiet)
    try:
        return verify(st, progress=meter)
    finally:
        meter.close()


def _verify_doc(res: VerifyResult) -> dict[str, Any]:  # Any: JSON
    return {"path": res.path, "ok": res.ok, "tensors": res.tensors, "checked_bytes": res.checked_bytes,
            "problems": [{"file": p.file, "key": p.key, "rank": p.rank, "reason": p.reason} for p in res.problems],
            "damaged_files": res.damaged_files, "damaged_keys": res.damaged_keys, "unlisted": res.unlisted,
            "seal": res.seal, "health": {"nonfinite": res.nonfinite, "nan": res.nan, "unfit": res.unfit}}


def _verify_each(args: argparse.Namespace, cat: Catalog) -> int:
    """``verify ROOT``: every committed checkpoint under a folder (damaged ones too:
    their manifest is what is wrong); the other folders are named, not checked."""

    done: list[tuple[Entry, VerifyResult]] = []
    skipped: list[Entry] = []
    for e in cat.entries:
        if e.status in (COMMITTED, DAMAGED):
            done.append((e, _verify_one(e.storage, args.quiet)))
        else:
            skipped.append(e)
    bad = [e.name for e, res in done if not res.ok]
    unfit = [e.name for e, res in done if res.ok and res.unfit]
    if args.json:
        print_json({"path": cat.storage.url, "ok": not bad,
                   "checkpoints": [{"name": e.name, "step": e.step, **_verify_doc(res)} for e, res in done],
                   "not_checked": [{"name": e.name, "step": e.step, "status": e.status} for e in skipped]})
        return DIFFERS if bad else OK
    for _, res in done:
        print(res.summary())
    summary = f"{len(done)} checkpoint(s) verified under {cat.storage.url}: {len(done) - len(bad)} OK"
    if bad:
        summary += f", {len(bad)} DAMAGED ({', '.join(bad)})"
    if unfit:
        summary += f"; UNFIT to resume from (NaN or inf): {', '.join(unfit)}"
    print(summary)
    if skipped:
        print("not checked (not checkpoints): " + ", ".join(f"{e.name} ({e.status})" for e in skipped))
    return DIFFERS if bad else OK
