"""shardpoint: list, inspect, verify, compare, prune, export and convert checkpoints.

Exit codes: 0 ok; 1 a finding: the checkpoint ``verify``, ``inspect``, ``diff`` or
``convert`` was given is damaged or incomplete, or (``diff``) the two differ; 2 a
usage or environment error (bad arguments, no checkpoint at the path, a file
refused). ``ls`` and ``prune`` never exit 1: a damaged checkpoint is a row of what
they print. Progress bars go to stderr and only when it is a terminal; -q/--quiet
silences them. A reader that closes the pipe (``shardpoint ls --json | head``) ends
the output quietly.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TextIO, TypedDict

from typing_extensions import (
    NotRequired,  # typing has it from Python 3.11; torch depends on typing_extensions
)

if TYPE_CHECKING:
    from rich.console import Console

    from .catalog import Catalog, Entry
    from .interop._progress import Progress
    from .verify import VerifyResult

OK, DIFFERS, USAGE = 0, 1, 2


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
    "ls": ("examples:\n  shardpoint ls runs/exp1/ckpt                  # a CheckpointManager root\n"
           "  shardpoint ls hf_output_dir/                  # checkpoint-N folders; Lightning's *.ckpt folders too\n"
           "  shardpoint ls runs/exp1/ckpt --json | jq '.[] | select(.latest)'"),
    "inspect": "example:\n  shardpoint inspect runs/exp1/ckpt/step-00001000\n  shardpoint inspect CKPT --json",
    "verify": ("examples:\n  shardpoint verify runs/exp1/ckpt/step-00001000 && echo sound\n"
               "  shardpoint verify runs/exp1/ckpt                # each checkpoint of a root"),
    "diff": "example:\n  shardpoint diff ckpt/step-00001000 ckpt/step-00002000\n  shardpoint diff A B --atol 1e-6 --json",
    "export": "example:\n  shardpoint export runs/exp1/ckpt/step-00001000 archive/step-1000   # no references left in the copy",
    "prune": ("examples:\n  shardpoint prune runs/exp1/ckpt --keep-last 3 --keep-every 1000 --dry-run\n"
              "  shardpoint prune runs/exp1/ckpt --incomplete      # only folders whose save never committed"),
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


def _version() -> str:
    import platform

    import torch

    from ._version import __version__

    return f"shardpoint {__version__} (torch {torch.__version__}, Python {platform.python_version()})"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="shardpoint", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=_version())
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")

    def cmd(name: str, help: str, aliases: tuple[str, ...] = ()) -> argparse.ArgumentParser:
        c = sub.add_parser(name, help=help, description=help, epilog=_EXAMPLES[name], aliases=list(aliases),
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        c.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
        return c

    ls = cmd("ls", "table of the checkpoints under a folder: a CheckpointManager root, a trainer's output folder "
                   "(Lightning, HF Trainer, Accelerate) or one checkpoint; step, time, size, world size, status "
                   "(committed, damaged, incomplete), health, metrics")
    ls.add_argument("root")
    ls.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
    ls.add_argument("--memory-path", default=None, help="where the memory tier keeps snapshots on this host "
                    "(MemoryTier(path=...); default /dev/shm/shardpoint): its snapshots of ROOT are listed too")

    ins = cmd("inspect", "tree of a checkpoint's keys: shape, dtype, bytes, how each tensor was sharded, which held "
                         "a NaN or an infinity (manifest only)", aliases=("info",))
    ins.add_argument("path")
    ins.add_argument("--json", action="store_true", help="print JSON instead of a tree")

    ver = cmd("verify", "re-read every chunk and check its checksum; exit 1 naming damaged keys and files. "
                        "Given a folder of checkpoints (a manager root), verify each")
    ver.add_argument("path")
    ver.add_argument("--json", action="store_true", help="print JSON instead of text")

    dif = cmd("diff", "keys added, removed, changed in shape/dtype/value, and each tensor's max |a - b| (streaming)")
    dif.add_argument("a")
    dif.add_argument("b")
    dif.add_argument("--atol", type=float, default=0.0, help="tensors whose max |a - b| is at most this count as equal")
    dif.add_argument("--json", action="store_true", help="print JSON instead of text")

    pr = cmd("prune", "delete old checkpoints under a CheckpointManager root by its retention rules; data that kept "
                      "checkpoints refer to is always kept")
    pr.add_argument("root")
    pr.add_argument("--keep-last", type=int, default=None, metavar="N",
                    help="keep the newest N sound checkpoints (without it: keep every checkpoint)")
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
    out = _PipeSafe(sys.stdout)
    saved, sys.stdout = sys.stdout, out  # a stream in all that print and rich use
    try:
        return handler(args)
    except CheckpointNotFoundError as e:
        return _not_found(e, args)
    except CorruptCheckpointError as e:
        _err(f"damaged: {e}")
        return DIFFERS
    except (ShardpointError, ValueError, OSError) as e:
        _err(str(e))
        return USAGE
    except KeyboardInterrupt:  # pragma: no cover
        return 130
    finally:
        out.flush()
        sys.stdout = saved


class _PipeSafe:
    """stdout that goes quiet once its reader is gone (``shardpoint ls --json | head``):
    the rest of the output is dropped, as Python's docs advise, instead of a
    "[Errno 32] Broken pipe" and exit 2. The command's own exit code stands."""

    def __init__(self, inner: TextIO) -> None:
        self._inner = inner
        self.gone = False

    def write(self, s: str) -> int:
        if not self.gone:
            try:
                return self._inner.write(s)
            except BrokenPipeError:
                self._drop()
        return len(s)

    def flush(self) -> None:
        if not self.gone:
            try:
                self._inner.flush()
            except BrokenPipeError:
                self._drop()

    def _drop(self) -> None:
        self.gone = True
        try:  # what Python still holds for the pipe goes to /dev/null at exit, not to a traceback
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, self._inner.fileno())
            os.close(devnull)
        except (OSError, ValueError, AttributeError):  # not a real file (a test's buffer)
            pass

    def __getattr__(self, name: str) -> Any:  # Any: whatever the stream has (isatty, encoding, fileno)
        return getattr(self._inner, name)


def _err(msg: str) -> None:
    print(f"shardpoint: error: {msg}", file=sys.stderr)


def _print_json(doc: object) -> None:
    """Strict JSON: a NaN or an infinity is null (``json.dumps`` would write ``NaN``, which no JSON parser reads)."""
    print(json.dumps(_finite(doc), indent=2, allow_nan=False, default=repr))


def _finite(x: Any) -> Any:  # Any: a JSON-shaped document
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


def _console(stderr: bool = False) -> Console:
    """Output as wide as the terminal, or ``COLUMNS`` when set; not a terminal (a pipe,
    a test) and no ``COLUMNS``: wide and plain, so nothing is cut or coloured."""
    from rich.console import Console

    f = sys.stderr if stderr else sys.stdout
    tty = f.isatty()
    cols = os.environ.get("COLUMNS", "")
    width = int(cols) if cols.isdigit() and int(cols) > 0 else None if tty else 200
    return Console(file=f, width=width, no_color=not tty, highlight=False)


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


def _bar(what: str, total: int, quiet: bool) -> Progress:
    from .interop._progress import Progress

    return Progress(total, what, enabled=not quiet)


class _Meter:
    """A progress bar started once the total is known (:class:`shardpoint.verify.Meter`)."""

    def __init__(self, what: str, quiet: bool) -> None:
        self.what, self.quiet = what, quiet
        self.bar: Progress | None = None

    def start(self, total: int) -> None:
        self.bar = _bar(self.what, total, self.quiet).__enter__()

    def advance(self, n: int) -> None:
        if self.bar is not None:
            self.bar.advance(n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.__exit__(None, None, None)


def _paths(args: argparse.Namespace) -> list[str]:
    """The shardpoint checkpoints (or folders of them) the command was given."""
    if args.cmd == "convert":
        return [args.src] if args.src_format == "shardpoint" else []
    return [p for p in (getattr(args, n, None) for n in ("path", "a", "b", "root", "src")) if p]


def _not_found(e: Exception, args: argparse.Namespace) -> int:
    """What is at a path that holds no committed checkpoint, said so that nothing anyone
    still needs is advised away: a save that never committed is incomplete (1); data a
    kept checkpoint reads, a folder of checkpoints, anything else or nothing is a usage
    error (2), each named."""
    from .format.manifest import MANIFEST_NAME

    for path in _paths(args):
        if "://" not in path and not os.path.exists(os.path.join(path, MANIFEST_NAME)):
            code, msg = _no_checkpoint(path, args.cmd)
            _err(msg)
            return code
    _err(str(e))
    return USAGE


def _no_checkpoint(path: str, cmd: str) -> tuple[int, str]:
    from .catalog import COMMITTED, DAMAGED, FOREIGN, catalog, referrers, shardpoint_files
    from .format.pointer import STEP_FOLDER
    from .storage import storage_for

    if not os.path.exists(path):
        return USAGE, f"no checkpoint at {path}: it does not exist"
    if not os.path.isdir(path):
        return USAGE, f"{path} is a file; a shardpoint checkpoint is a folder with a manifest.json{_format_hint(path)}"
    st = storage_for(path)
    parent = st.parent()
    step_folder = STEP_FOLDER.match(os.path.basename(st.url)) is not None
    if step_folder:
        refs = referrers(parent, os.path.basename(st.url))
        if refs:
            return USAGE, (f"{path} is not a checkpoint: it holds the data of a step that retention dropped, which the "
                           f"checkpoints of step(s) {refs} still read (incremental saves). Keep it: retention and "
                           "`shardpoint prune` remove it once no checkpoint refers to it. "
                           f"`shardpoint {cmd}` one of those steps instead")
    if shardpoint_files(st):
        fix = (f"when no save is running, `shardpoint prune {parent.url} --incomplete` removes it (and keeps any data "
               "another checkpoint refers to)" if step_folder else "load an earlier checkpoint")
        return DIFFERS, (f"{path} is incomplete: it has shardpoint data files but no manifest.json, so its save never "
                         f"committed (or is still writing) and it cannot be loaded; {fix}")
    cat = catalog(st)
    found = [e for e in cat.entries if e.status in (COMMITTED, DAMAGED)]
    if found:
        what = "a CheckpointManager root" if cat.kind == "manager" else "a folder"
        names = ", ".join(e.name for e in found[:3]) + (f" and {len(found) - 3} more" if len(found) > 3 else "")
        return USAGE, (f"{path} is not a checkpoint but {what} of {len(found)} checkpoint(s): {names}. Name one, e.g. "
                       f"`shardpoint {cmd} {os.path.join(path, found[-1].name)}`; `shardpoint ls {path}` lists them and "
                       f"`shardpoint verify {path}` verifies each")
    hint = _format_hint(path)
    foreign = [e.name for e in cat.entries if e.status == FOREIGN]
    if foreign:
        hint += (f"; its checkpoint folder(s) {', '.join(foreign[:3])}{' ...' if len(foreign) > 3 else ''} are in a "
                 "trainer's own format, not shardpoint's")
    return USAGE, f"no shardpoint checkpoint at {path}: it has no manifest.json and no checkpoint folder below it{hint}"


def _format_hint(path: str) -> str:
    """Which converter reads what is at ``path``, when it looks like another format's checkpoint."""
    if os.path.isfile(path):
        if path.endswith((".pt", ".pth", ".bin", ".ckpt")):
            return f"; a torch.save file converts with `shardpoint convert --from torch {path} DST`"
        if path.endswith(".safetensors"):
            return f"; Hugging Face weights convert with `shardpoint convert --from hf {os.path.dirname(path) or '.'} DST`"
        return ""
    try:
        names = set(os.listdir(path))
    except OSError:
        return ""
    if ".metadata" in names:
        return f"; it is a torch.distributed.checkpoint (DCP) folder: `shardpoint convert --from dcp {path} DST`"
    if "latest" in names and any(n.startswith("global_step") for n in names):
        return f"; it is a DeepSpeed checkpoint folder: `shardpoint convert --from deepspeed {path} DST`"
    if names & {"model.safetensors", "model.safetensors.index.json"}:
        return f"; it holds Hugging Face weights: `shardpoint convert --from hf {path} DST`"
    return ""


# -- ls -----------------------------------------------------------------------------------------------
def _ls(args: argparse.Namespace) -> int:
    from .catalog import catalog

    cat = catalog(args.root)
    rows = [_row(e) for e in cat.entries] + _memory_rows(cat, args.memory_path)
    if args.json:
        _print_json(rows)
        return OK
    if not rows:
        from .catalog import DEPTH

        print(f"no checkpoints under {args.root}: no manifest.json, no step-N folders, and no checkpoint folder "
              f"(checkpoint-N, *.ckpt, step_N, or any folder with a manifest.json) within {DEPTH} levels")
        for note in cat.notes:
            print(f"note: {note}")
        return OK
    console = _console()
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
    from .catalog import COMMITTED

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
    from .manager import CheckpointManager
    from .tiers.config import DEFAULT_PATH
    from .tiers.shm import snapshot_rows

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
    from .manager import CheckpointManager

    folders = any(r["step"] is None or r["name"] != CheckpointManager.step_dir(r["step"]) for r in rows)
    return [
        ("step", lambda r: "-" if r["step"] is None else str(r["step"]), False),
        *([("folder", lambda r: r["name"], True)] if folders else []),
        *([("tier", lambda r: r["tier"], True)] if any(r["tier"] != "durable" for r in rows) else []),
        ("time (UTC)", lambda r: r["time"] or "-", True),  # wraps between the date and the time
        ("size", lambda r: _human(r["size"]), False),
        *([("by ref", lambda r: _human(r["referenced"]) if r["referenced"] else "-", False)]
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
    from .manager import CheckpointManager

    step = "step -" if r["step"] is None else f"step {r['step']}"
    if r["step"] is None or r["name"] != CheckpointManager.step_dir(r["step"]):
        step += f" ({r['name']})"
    status = r["status"].upper() if r["status"] == "damaged" else r["status"]
    parts = [f"{step}: {status}" + (", latest" if r["latest"] else "")]
    if r["tier"] != "durable":
        parts.append(r["tier"])
    if r["time"]:
        parts.append(f"{r['time']} UTC, {_human(r['size'])}" + (f" (+{_human(r['referenced'])} by reference)"
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
    from .catalog import DAMAGED, FOREIGN, INCOMPLETE, REFERENCED

    notes: list[str] = []
    for r in rows:
        if r["status"] == DAMAGED:  # the reason's first sentence; the fix once, below
            why = (r["damaged"] or "").removeprefix(f"{r['path']}/").split(". ")[0]
            notes.append(f"{r['name']} is DAMAGED: {why}" + (" (`latest` names it)" if r["latest"] else ""))
    if any(r["status"] == DAMAGED for r in rows):
        notes.append("a DAMAGED checkpoint cannot be loaded: restore its folder from a copy; "
                     "CheckpointManager.restore(state, fallback=True) resumes from the newest sound one before it; "
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
    from .health import HealthRule
    from .load.locate import read_manifest
    from .storage import storage_for
    from .tree import decode_key

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
            "tensors": {k: {"shape": list(t.shape), "dtype": _dtype(t.dtype), "nbytes": t.nbytes,
                            "sharding": _sharding(t.shape, t.chunks), "health": health(k),
                            "chunks": [{"offsets": list(o), "sizes": list(s)} for o, s in t.chunks]}
                        for k, t in m.tensors.items()},
            "values": m.values,
            "per_rank": m.per_rank,
        }
        _print_json(out)
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
                f"{m.created.strftime('%Y-%m-%d %H:%M:%S')} UTC, {_human(m.nbytes)} in files"
                + (f", {_human(m.referenced)} by reference to earlier checkpoints" if m.referenced else "")
                + escape(where) + "".join(f", {k}={v:.4g}" for k, v in m.metrics.items()))
    nodes: dict[tuple[str | int, ...], Tree] = {(): tree}

    def parent(path: tuple[str | int, ...]) -> Tree:
        if path not in nodes:
            nodes[path] = parent(path[:-1]).add(escape(str(path[-1])) + "/")
        return nodes[path]

    leaves: list[tuple[tuple[str | int, ...], str]] = []
    for k, t in m.tensors.items():
        leaves.append((decode_key(k), f"{_dtype(t.dtype)}{list(t.shape)}  {_human(t.nbytes)}  "
                                      f"{_sharding(t.shape, t.chunks)}{mark(k)}"))
    for k, v in m.values.items():
        leaves.append((decode_key(k), f"= {v!r}"))
    for k, ranks in m.per_rank.items():
        inside = sorted({mark(n) for n in nonfinite or [] if n == k or n.startswith(k + "/")} - {""})
        leaves.append((decode_key(k), f"per rank, saved by ranks {ranks}{''.join(inside)}"))
    for path, text in sorted(leaves, key=lambda x: tuple(str(s) for s in x[0])):
        name = str(path[-1]) if path else "(root)"
        parent(path[:-1]).add(f"{escape(name)}  {escape(text)}")
    _console().print(tree)
    return OK


# -- verify -------------------------------------------------------------------------------------------
def _verify(args: argparse.Namespace) -> int:
    from .format.manifest import MANIFEST_NAME
    from .storage import storage_for

    st = storage_for(args.path)
    if not st.exists(MANIFEST_NAME) and ("://" in args.path or os.path.isdir(args.path)):
        from .catalog import COMMITTED, DAMAGED, catalog

        cat = catalog(st)
        if cat.kind == "manager" or any(e.status in (COMMITTED, DAMAGED) for e in cat.entries):
            return _verify_each(args, cat)
    res = _verify_one(st, args.quiet)
    if args.json:
        _print_json(_verify_doc(res))
    else:
        print(res.summary())
    return OK if res.ok else DIFFERS


def _verify_one(path: Any, quiet: bool) -> VerifyResult:  # Any: a path or a Storage
    from .storage import storage_for
    from .verify import verify

    st = storage_for(path)
    meter = _Meter(f"verifying {st.url}", quiet)
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
    from .catalog import COMMITTED, DAMAGED

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
        _print_json({"path": cat.storage.url, "ok": not bad,
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
        _print_json(res)
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
def _export(args: argparse.Namespace) -> int:
    from ._export import export_checkpoint
    from .load.locate import read_manifest
    from .storage import storage_for

    if _refuse_same(args.src, args.dst, "export"):
        return USAGE
    src = storage_for(args.src)
    man = read_manifest(src)
    with _bar(f"exporting {args.src}", man.own_bytes() + man.referenced_bytes(), args.quiet) as bar:
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
        _err(f"{what} {src} -> {dst}: the destination is {where}; writing there would change the checkpoint being read. "
             "Nothing was written; give another DST")
    return same or inside


# -- prune --------------------------------------------------------------------------------------------
def _prune(args: argparse.Namespace) -> int:
    from .catalog import COMMITTED, DAMAGED, INCOMPLETE, REFERENCED, catalog
    from .manager import CheckpointManager, drop, referenced_files

    if args.keep_last is None and not args.incomplete:
        _err("say what to remove: --keep-last N (keep the newest N checkpoints, remove older ones), "
             "--incomplete (remove folders whose save never committed), or both")
        return USAGE
    if (args.keep_last is not None and args.keep_last < 1) or (args.keep_every is not None and args.keep_every < 1):
        _err("--keep-last and --keep-every must be at least 1")
        return USAGE
    cat = catalog(args.root)
    if cat.kind != "manager":
        more = (": the trainer removes its own (HF save_total_limit, Lightning save_top_k)"
                if cat.entries else "")
        _err(f"{args.root} is not a CheckpointManager root (it has no step-N folders); prune removes only a "
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
        _err("a kept checkpoint's manifest cannot be read, so which data it refers to is unknown; nothing removed "
             "(run `shardpoint ls` and `verify` on it)")
        return USAGE
    verb = "would remove" if args.dry_run else "removed"
    for e in doomed:
        name = CheckpointManager.step_dir(e.step or 0)
        still = needed.get(name)
        if e.status == REFERENCED and still:
            continue  # still read by a kept checkpoint: reported below
        if not args.dry_run:
            drop(root.child(name), still)  # keeps the data files a kept checkpoint refers to
        size = f", {_human(e.info.size)}" if e.info is not None else ""
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
def _convert(args: argparse.Namespace) -> int:
    src_f, dst_f = args.src_format, args.dst_format
    quiet = args.quiet or args.no_progress
    rename = dict(_pair(r) for r in args.rename) or None
    if (src_f == "shardpoint") == (dst_f == "shardpoint"):
        _err("one side of convert is shardpoint: give --from FORMAT (into shardpoint) or --to FORMAT (out of it), not both")
        return USAGE
    if _refuse_same(args.src, args.dst, "convert"):
        return USAGE
    if src_f == "deepspeed":
        from .interop.deepspeed import convert

        if args.tag is not None and os.path.isdir(args.src) and not os.path.isdir(os.path.join(args.src, args.tag)):
            _err(_no_tag(args.src, args.tag))
            return USAGE
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
        from .errors import UsageError

        raise UsageError(f"--rename {s!r}: write OLD=NEW (NEW may be empty)")
    old, new = s.split("=", 1)
    return old, new


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
