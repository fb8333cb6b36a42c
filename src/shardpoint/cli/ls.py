"""``shardpoint ls``: every folder a root holds, in a table as wide as the console,
or as JSON (strict: a non-finite number is null)."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, TypedDict

from ..errors import CorruptCheckpointError
from ..manager import CheckpointManager
from .catalog import COMMITTED, DAMAGED, DEPTH, FOREIGN, INCOMPLETE, REFERENCED, Catalog, Entry, catalog
from .output import OK, USAGE, error, human, make_console, print_json

if TYPE_CHECKING:
    from rich.console import Console


class CheckpointRow(TypedDict):
    """One folder as ``shardpoint ls --json`` lists it (None: unknown, or not committed)."""

    step: int | None  # None: neither its name nor what it saved says
    name: str  # its path relative to ROOT ("." when ROOT is the checkpoint)
    path: str
    tier: str  # "durable", or "memory (run <id>)" for the memory tier's snapshots on this host
    time: str | None
    size: int | None
    referenced: int | None
    world_size: int | None
    status: str  # committed | damaged | incomplete | referenced data only | not shardpoint
    damaged: str | None  # why, when status is damaged
    latest: bool
    healthy: bool | None  # committed and fit to resume from (None: not committed, or health not recorded)
    nonfinite: list[str] | None  # None: saved before health was recorded, or not committed
    nan: list[str] | None  # those of nonfinite that held a NaN (the others an infinity)
    unfit: list[str] | None  # those of nonfinite that make it unfit to resume from (shardpoint.health)
    metrics: dict[str, float | None] | None  # a non-finite number is null (strict JSON)


def run(args: argparse.Namespace) -> int:
    """``shardpoint ls ROOT``: exit 0 whatever state the checkpoints are in (2: ROOT is
    not a folder, or cannot be read)."""
    try:
        return _ls(args)
    except CorruptCheckpointError as e:  # a damaged checkpoint is a row; this is something else that cannot be read
        error(str(e))
        return USAGE


def _ls(args: argparse.Namespace) -> int:
    cat = catalog(args.root)
    rows = [_row(e) for e in cat.entries] + _memory_rows(cat, args.memory_path)
    if args.json:
        print_json(rows)
        return OK
    if not rows:
        print(f"no checkpoints under {args.root}: no manifest.json, no step-N folders, and no checkpoint folder "
              f"(checkpoint-N, *.ckpt, step_N, or any folder with a manifest.json) within {DEPTH} levels")
        for note in cat.notes:
            print(f"note: {note}")
        return OK
    console = make_console()
    # checkpoints all in one folder below ROOT (Lightning's lightning_logs/version_0/checkpoints): named from there
    common = os.path.commonpath([r["name"] for r in rows]) if all(r["tier"] == "durable" for r in rows) else ""
    if common and common != "." and not any(r["name"] == common for r in rows):
        rows_shown = [{**r, "name": r["name"][len(common) + 1:]} for r in rows]
        _print_table(console, f"checkpoints under {os.path.join(args.root, common)}", rows_shown)  # type: ignore[arg-type]
    else:
        _print_table(console, f"checkpoints under {args.root}", rows)
    for note in _row_notes(rows, cat) + cat.notes:
        console.print(f"note: {note}", markup=False)  # wrapped to the width, like the table
    return OK


def _row(e: Entry) -> CheckpointRow:
    i = e.info
    ok = i is not None and e.status == COMMITTED
    return {"step": e.step, "name": e.name, "path": e.storage.url, "tier": "durable",
            "time": i.time.strftime("%Y-%m-%d %H:%M:%S") if ok and i else None,
            "size": i.size if ok and i else None, "referenced": i.referenced if ok and i else None,
            "world_size": i.world_size if ok and i else None, "status": e.status,
            "damaged": i.damaged if i is not None else None, "latest": e.latest,
            "healthy": None if not ok or i is None or i.nonfinite is None else not i.unfit,
            "nonfinite": list(i.nonfinite) if ok and i and i.nonfinite is not None else None,
            "nan": ([] if i.nonfinite == () else None if i.nan is None else list(i.nan)) if ok and i else None,
            "unfit": list(i.unfit) if ok and i else None,
            "metrics": dict(i.metrics) if ok and i else None}


def _memory_rows(cat: Catalog, base: str | None) -> list[CheckpointRow]:
    """The memory tier's snapshots on this host of the roots listed (and of ROOT itself,
    which holds none on disk before its first drain)."""
    from ..tiers.config import DEFAULT_PATH
    from ..tiers.shm import snapshot_rows

    out: list[CheckpointRow] = []
    for url in dict.fromkeys([cat.storage.url, *(r.url for r in cat.roots)]):
        for r in snapshot_rows(url, base or DEFAULT_PATH):
            healthy = None if r["nonfinite"] is None or r["status"] != "committed" else not r["unfit"]
            out.append({**r, "name": CheckpointManager.step_dir(r["step"]), "damaged": None, "healthy": healthy,  # type: ignore[typeddict-item]
                        "nan": None})
    return out


#: A column of ``ls``'s table: its header, its cell, and whether a cell may wrap (else it keeps its width).
_Column = tuple[str, Callable[[CheckpointRow], str], bool]


def _columns(rows: list[CheckpointRow]) -> list[_Column]:
    """The table's columns; those no row uses (folder, tier, bytes by reference) are left out."""

    folders = any(r["step"] is None or r["name"] != CheckpointManager.step_dir(r["step"]) for r in rows)
    return [
        ("step", lambda r: "-" if r["step"] is None else str(r["step"]), False),
        *([("folder", lambda r: r["name"], True)] if folders else []),
        *([("tier", lambda r: r["tier"], True)] if any(r["tier"] != "durable" for r in rows) else []),
        ("time (UTC)", lambda r: r["time"] or "-", True),  # wraps between the date and the time
        ("size", lambda r: human(r["size"]), False),
        *([("by ref", lambda r: human(r["referenced"]) if r["referenced"] else "-", False)]
          if any(r["referenced"] for r in rows) else []),
        ("ranks", lambda r: str(r["world_size"] or "-"), False),
        ("status", lambda r: r["status"].upper() if r["status"] == "damaged" else r["status"], True),
        ("health", _health, True),
        ("metrics", lambda r: " ".join(f"{k}={v:.4g}" for k, v in (r["metrics"] or {}).items()) or "-", True),
        ("latest", lambda r: "<- latest" if r["latest"] else "", False),
    ]


def _fit(cols: list[_Column], rows: list[CheckpointRow], width: int) -> list[int] | None:
    """Column widths that fit ``width``: the wrapping columns narrow, the one with the
    most to spare first, down to their longest word (8 to 12 characters: a longer word
    is folded); None when even that does not fit."""
    cells = [[h, *(cell(r) for r in rows)] for h, cell, _ in cols]
    widths = [max(len(c) for c in cs) for cs in cells]
    least = [min(w, max(8, min(12, max(len(word) for c in cs for word in c.split() or [""])))) if wraps else w
             for w, cs, (_, _, wraps) in zip(widths, cells, cols)]
    room = width - 2 * (len(cols) - 1)  # a divider and a space between columns
    while sum(widths) > room:
        i = max(range(len(cols)), key=lambda j: widths[j] - least[j])
        if widths[i] <= least[i]:
            return None
        widths[i] -= 1
    return widths


def _print_table(console: Console, title: str, rows: list[CheckpointRow]) -> None:
    """The rows as a table as wide as the console at most; where not even its narrowest
    form fits, one block of lines per checkpoint (nothing is cut off)."""
    from rich import box
    from rich.table import Table

    cols = _columns(rows)
    widths = _fit(cols, rows, console.width)
    if widths is None:
        console.print(title, markup=False)
        for r in rows:
            console.print(_line(r), markup=False)
        return
    t = Table(title=title, box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, padding=(0, 0, 0, 1),
              title_justify="left")
    for (name, _, wraps), w in zip(cols, widths):
        t.add_column(name, width=w, no_wrap=not wraps, overflow="fold",
                     justify="right" if name in ("step", "size", "by ref", "ranks") else "left")
    for r in rows:
        t.add_row(*(cell(r) for _, cell, _ in cols))
    console.print(t)


def _line(r: CheckpointRow) -> str:
    """One checkpoint in a line, for a console too narrow for the table."""

    step = "step -" if r["step"] is None else f"step {r['step']}"
    if r["step"] is None or r["name"] != CheckpointManager.step_dir(r["step"]):
        step += f" ({r['name']})"
    status = r["status"].upper() if r["status"] == "damaged" else r["status"]
    parts = [f"{step}: {status}" + (", latest" if r["latest"] else "")]
    if r["tier"] != "durable":
        parts.append(r["tier"])
    if r["time"]:
        parts.append(f"{r['time']} UTC, {human(r['size'])}" + (f" (+{human(r['referenced'])} by reference)"
                                                             if r["referenced"] else "")
                     + f", {r['world_size']} rank(s)")
    if r["nonfinite"] is not None:
        parts.append(f"health {_health(r)}")
    if r["metrics"]:
        parts.append(" ".join(f"{k}={v:.4g}" for k, v in r["metrics"].items()))
    return "; ".join(parts)


def _health(r: CheckpointRow) -> str:
    """A checkpoint's health in a table cell: the keys holding a NaN or an infinity, and
    whether they make it unfit to resume from (an infinity in a buffer or an extra does not)."""
    if r["nonfinite"] is None:
        return "-"  # not committed, or saved before health was recorded
    if not r["nonfinite"]:
        return "finite"
    keys = r["unfit"] or r["nonfinite"]
    nan = r["nan"]
    what = "NaN/inf" if nan is None else "NaN" if any(k in nan for k in keys) else "inf"
    more = f" +{len(keys) - 1}" if len(keys) > 1 else ""
    return f"{'UNFIT' if r['unfit'] else 'fit'}: {what} in {keys[0]}{more}"


def _row_notes(rows: list[CheckpointRow], cat: Catalog) -> list[str]:
    """What the table's statuses mean for the rows that have them, once each."""

    notes: list[str] = []
    for r in rows:
        if r["status"] == DAMAGED:  # the reason's first sentence; the fix once, below
            why = (r["damaged"] or "").removeprefix(f"{r['path']}/").split(". ")[0]
            notes.append(f"{r['name']} is DAMAGED: {why}" + (" (`latest` names it)" if r["latest"] else ""))
    if any(r["status"] == DAMAGED for r in rows):
        resume = ("; CheckpointManager.restore(state, fallback=True) resumes from the newest sound one before it"
                  if cat.roots else "")
        notes.append(f"a DAMAGED checkpoint cannot be loaded: restore its folder from a copy{resume}; "
                     "`shardpoint verify PATH` says what else is damaged")

    def steps(status: str) -> list[str]:
        return [r["name"] for r in rows if r["status"] == status and r["tier"] == "durable"]

    if steps(INCOMPLETE):
        fix = (f"; when no save is running, `shardpoint prune {cat.storage.url} --incomplete` removes them"
               if cat.kind == "manager" else "")
        notes.append(f"incomplete: {', '.join(steps(INCOMPLETE))} (no manifest.json: a save that never committed, "
                     f"or one still writing; it cannot be loaded){fix}")
    if steps(REFERENCED):
        notes.append(f"referenced data only: {', '.join(steps(REFERENCED))} (a step retention dropped whose data files "
                     "kept checkpoints still read, with incremental saves; not a checkpoint, and not to be deleted: "
                     "retention and prune remove it once nothing refers to it)")
    if steps(FOREIGN):
        notes.append(f"not shardpoint: {', '.join(steps(FOREIGN))} (checkpoint folders in a trainer's own format)")
    if any(r["unfit"] for r in rows):
        notes.append("UNFIT: holds a NaN or an infinity in model or optimizer state; CheckpointManager.restore "
                     "passes over it (restore(state, step=N) loads it as it is)")
    return notes
