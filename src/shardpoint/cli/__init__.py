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
import os
import sys
import textwrap
from collections.abc import Callable
from typing import Any, TextIO

from .output import DIFFERS, USAGE, error

__all__ = ["main"]

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

    from .._version import __version__

    return f"shardpoint {__version__} (torch {torch.__version__}, Python {platform.python_version()})"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="shardpoint", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=_version())
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")

    def cmd(name: str, help: str, aliases: tuple[str, ...] = ()) -> argparse.ArgumentParser:
        c = sub.add_parser(name, help=help, description=textwrap.fill(help, 88), epilog=_EXAMPLES[name], aliases=list(aliases),
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
                    help="delete step folders whose save never committed (only when no save is running); "
                         "alone, nothing else")
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
    from ..errors import CheckpointNotFoundError, CorruptCheckpointError, ShardpointError
    from . import checks, ls, tools

    handler: Callable[[argparse.Namespace], int] = {
        "ls": ls.run, "inspect": checks.inspect_command, "info": checks.inspect_command,
        "verify": checks.verify_command, "diff": tools.diff_command, "prune": tools.prune_command,
        "export": tools.export_command, "convert": tools.convert_command,
    }[args.cmd]
    out = _PipeSafe(sys.stdout)
    saved, sys.stdout = sys.stdout, out  # a stream in all that print and rich use
    try:
        return handler(args)
    except CheckpointNotFoundError as e:
        return _not_found(e, args)
    except CorruptCheckpointError as e:
        error(f"damaged: {e}")
        return DIFFERS
    except (ShardpointError, ValueError, OSError) as e:
        error(str(e))
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
    from ..format.manifest import MANIFEST_NAME
    from .catalog import explain

    for path in _paths(args):
        if "://" not in path and not os.path.exists(os.path.join(path, MANIFEST_NAME)):
            incomplete, msg = explain(path, args.cmd)
            error(msg)
            return DIFFERS if incomplete else USAGE
    error(str(e))
    return USAGE
