"""The Python work of a load, counted in CPU instructions: what a load costs besides
its reads, measured so that a busy machine cannot move it.

A 408-tensor FSDP2 + AdamW state (17 blocks, 256 wide: the structure of
``load_floor_bench.py``'s model, 78 MB) is saved on 2 ranks; one process then loads
it ``--loads`` times under ``valgrind --tool=callgrind`` with the reads stubbed out
(the read stage still sorts its jobs into tasks), instrumentation on only around
those loads. Prints millions of instructions per load. Repeated runs agree to about
0.3%; wall-clock timings of the same work on this shared machine move by 10-20%.

    OMP_NUM_THREADS=1 PYTHONPATH=src:. python benchmarks/load_python_cost.py [--loads 3]

With ``--phases``, each load's parts are counted apart as well (a dump of the
counters at each part's start and end, their own cost measured and taken off): the
functions of ``shardpoint.load.pipeline`` named in ``PHASES`` (those the code has).

With ``--skeleton``, the same checkpoint is also loaded by :func:`_skeleton`, counted
the same way: only what no load of it can skip (read, hash and decode the manifest
and both indexes, walk the state, each target's bytes, each chunk looked up, the jobs
sorted), none of the checks, reports or agreements. What a load costs above it is
what its checks and its structure cost.

Needs valgrind (Debian's package); without it, prints the wall time instead.
To compare two commits, run it with ``PYTHONPATH`` pointing at each one's ``src``.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))


def _state(world: int, seed: int, step: bool) -> dict[str, Any]:
    import torch
    from compare_model import Net
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(seed)
    model = Net(256, 773, 17)
    for b in model.blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if step:
        model(torch.randn(8, 256)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd}


def _save(rank: int, world: int, path: str) -> None:
    import shardpoint

    shardpoint.save(_state(world, 0, True), path)


#: The parts of a load counted apart with ``--phases``: (name, function of shardpoint.load.pipeline).
PHASES = [
    ("manifest parse", "read_manifest"),
    ("walk and key check", "_prepare"),
    ("walk and key check", "_check"),  # the key check, apart from the walk since issue 34 item 4
    ("read planning, own tensors", "_plan_ahead"),
    ("read planning, read, place", "_read_and_fill"),
    ("read planning, read, place", "_plan_rest"),  # issue 32 item 1 split _read_and_fill in two
    ("read planning, read, place", "_read"),
]


def _dump(label: str) -> None:
    subprocess.run(["callgrind_control", "-d", label, str(os.getpid())], check=True, capture_output=True)


def _phased(module: Any = None, phases: list[tuple[str, str]] = PHASES) -> None:
    """Wrap each function of ``phases`` in dumps of the counters at its start and end:
    (name, attribute of ``module``, by default ``shardpoint.load.pipeline``; ``Cls.x``:
    method ``x`` of its class ``Cls``). Those the module lacks are skipped."""
    import functools

    if module is None:
        from shardpoint.load import pipeline as module

    for name, attr in phases:
        owner: Any = module
        if "." in attr:
            cls, attr = attr.split(".")
            owner = getattr(module, cls, None)
        fn = getattr(owner, attr, None)
        if fn is None:
            continue

        def wrapped(*a: Any, _fn: Any = fn, _name: str = name, **k: Any) -> Any:
            _dump("before")
            try:
                return _fn(*a, **k)
            finally:
                _dump("phase:" + _name)

        setattr(owner, attr, functools.wraps(fn)(wrapped))


def _skeleton(state: Any, path: str) -> list[tuple[Any, ...]]:
    """A load of this benchmark's checkpoint cut down to what none can skip (see the
    module's docstring): no check, no error, no report; the reads stubbed out as in
    the counted loads. Knows only this checkpoint's layouts (split along dim 0 by the
    saving ranks, or one scalar), and raises on any other."""
    import torch
    from torch.distributed.tensor import DTensor

    from shardpoint.format.digest import check_seal, digest_matches
    from shardpoint.format.index import _PLAIN
    from shardpoint.format.manifest import _DOC3
    from shardpoint.load.read import _bytes_of

    with open(os.path.join(path, "manifest.json"), "rb") as f:
        body = f.read()
    check_seal(body, "manifest.json")  # its digest (the seal's algorithm) over the body
    doc = _DOC3.decode(body)  # format version 3: tensor entries name rows of its layouts table
    chunks = {}
    for info in doc.files.values():
        assert info.index is not None and info.rank is not None
        with open(os.path.join(path, info.index.name), "rb") as f:
            data = f.read()
        assert digest_matches(info.index.digest, data)
        chunks[info.rank] = _PLAIN.decode(data).chunks
    entries, rows = doc.entries, doc.layouts
    jobs: list[tuple[Any, ...]] = []
    add = jobs.append

    def walk(d: dict[str, Any], above: str) -> None:
        for k, v in d.items():
            key = above + str(k)
            if isinstance(v, dict):
                walk(v, key + "/")
            elif isinstance(v, torch.Tensor):
                e = rows[entries[key].layout]  # type: ignore[union-attr]
                t = v._local_tensor if type(v) is DTensor else v
                # the load's view checks (a float32 tensor has no conjugate bit to ask for)
                if not (t.dtype is torch.float32 and t.is_cpu and t.is_contiguous() and not t.is_neg()):
                    raise ValueError(f"{key}: not this benchmark's state")
                out = _bytes_of(t)
                grid = e.grid
                if not grid.cuts:  # a scalar: one chunk, in the file of the one rank listed
                    off, n, crcs = chunks[grid.ranks[0]][key + "@"]
                    add((key, off, n, crcs, out))
                    continue
                piece, rest = grid.cuts[0], ",0" * (len(grid.cuts) - 1)  # split along dim 0 only
                pos = 0
                for i in range(-(-e.shape[0] // piece)):
                    r = grid.ranks.first + i * grid.ranks.step
                    off, n, crcs = chunks[r][f"{key}@{i * piece}{rest}"]
                    add((key, off, n, crcs, out[pos : pos + n]))
                    pos += n

    walk(state, "")
    jobs.sort(key=lambda j: j[1])
    return jobs


def _worker(path: str, loads: int, counted: bool, phases: bool = False, skeleton: bool = False) -> None:
    """One rank: load once (warm), then ``loads`` times with the reads stubbed out."""
    import torch.distributed as dist
    from tests._dist import free_port

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1",
                      LOCAL_WORLD_SIZE="1")
    dist.init_process_group("gloo")
    import shardpoint
    from shardpoint.load.read import Reader

    state = _state(1, 1, False)
    shardpoint.load(state, path)
    Reader.run = lambda self, jobs: self._tasks(jobs) and None  # the reads stubbed out: their tasks still sorted
    shardpoint.load(state, path)
    if skeleton:
        for _ in range(2):
            _skeleton(state, path)
    if counted:
        subprocess.run(["callgrind_control", "-i", "on", str(os.getpid())], check=True, capture_output=True)
    t = time.perf_counter()
    for _ in range(loads):
        if skeleton:
            _skeleton(state, path)
        else:
            shardpoint.load(state, path)
    dt = time.perf_counter() - t
    if counted and phases:
        _dump("whole")
        for _ in range(loads):  # what a dump costs the counters: between two dumps, nothing else
            _dump("before")
            _dump("phase:overhead")
        _phased()
        for _ in range(loads):
            shardpoint.load(state, path)
        _dump("before")
    if counted:
        subprocess.run(["callgrind_control", "-i", "off", str(os.getpid())], check=True, capture_output=True)
    print(f"wall {dt / loads * 1e3:.2f} ms a load", flush=True)
    dist.destroy_process_group()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--loads", type=int, default=3)
    ap.add_argument("--phases", action="store_true", help="count the parts of a load apart as well")
    ap.add_argument("--skeleton", action="store_true",
                    help="count also a load cut down to what none can skip (see the module's docstring)")
    ap.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        _worker(args.worker[0], args.loads, args.worker[1] == "counted", args.phases, args.skeleton)
        return 0
    from tests._dist import run_ranks

    import shardpoint

    counted = callgrind_here()
    with tempfile.TemporaryDirectory() as d:
        ck = os.path.join(d, "ck")
        run_ranks(_save, 2, ck, timeout=600)
        got = run_worker(__file__, ["--loads", str(args.loads), *(["--phases"] if args.phases else []),
                                    "--worker", ck, "counted" if counted else "-"], d, counted, args.phases)
        floor = None
        if got is not None and args.skeleton:
            for f in Path(d).glob("cg.out*"):
                f.unlink()
            floor = run_worker(__file__, ["--loads", str(args.loads), "--skeleton", "--worker", ck,
                                          "counted" if counted else "-"], d, counted, False)
    if got is None or (args.skeleton and floor is None):
        return 1
    text, parts = got
    print(f"shardpoint {shardpoint.__version__} from {Path(shardpoint.__file__).parent}")
    wall = re.search(r"wall ([0-9.]+) ms", text)
    print(f"wall time a load (under valgrind when counted): {wall.group(1) if wall else '?'} ms")
    load = _total(text, parts, args.loads)
    print_counts("a load without its reads", text, parts, args.loads, PHASES)
    if floor is not None:
        wall = re.search(r"wall ([0-9.]+) ms", floor[0])
        print(f"wall time the skeleton: {wall.group(1) if wall else '?'} ms")
        print_counts("the same load cut down to what none can skip (--skeleton)", floor[0], floor[1], args.loads, [])
        least = _total(floor[0], {}, args.loads)
        if load and least:
            print(f"  a load / the skeleton: {load / least:.2f}x")
    return 0


def _total(text: str, parts: dict[str, int], n: int) -> float | None:
    """Instructions per run: the "whole" dump with ``--phases``, else callgrind's total."""
    if "whole" in parts:
        return parts["whole"] / n
    got = re.search(r"Collected : (\d+)", text)
    return int(got.group(1)) / n if got else None


def callgrind_here() -> bool:
    """Whether this machine has valgrind's callgrind and its control command."""
    return shutil.which("valgrind") is not None and shutil.which("callgrind_control") is not None


def run_worker(script: str, args: list[str], d: str, counted: bool, phases: bool) -> tuple[str, dict[str, int]] | None:
    """Run ``script`` with ``args`` (its worker), under callgrind when ``counted``
    (its counters in ``d``): its output, and with ``phases`` the instructions by
    label (:func:`_parts`); None, its output printed, when it failed."""
    cmd = [sys.executable, script, *args]
    if counted:
        cmd = ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={d}/cg.out"] + cmd
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    text = out.stdout + out.stderr
    if out.returncode != 0:
        print(text[-4000:], file=sys.stderr)
        return None
    parts = _parts(d) if counted and phases else {}
    if counted:
        parts.update({"_lib:" + k: v for k, v in (_by_library(d, phases) or {}).items()})
    return text, parts


def print_counts(what: str, text: str, parts: dict[str, int], n: int, phases: list[tuple[str, str]]) -> None:
    """Millions of instructions of each of ``n`` runs of ``what``, and of each part of
    ``phases`` counted (a dump's own cost taken off)."""
    total = _total(text, parts, n)
    parts.pop("whole", None)
    libs = {k.removeprefix("_lib:"): parts.pop(k) for k in [k for k in parts if k.startswith("_lib:")]}
    sha = libs.get("libcrypto") if libs else None
    if total is not None:
        print(f"{what}: {total / 1e6:.2f} M instructions")
    if sha is not None:
        print(f"  of it, SHA-256 in libcrypto (a version-2 seal and index digests): {sha / n / 1e6:.2f} M (the software "
              f"path: valgrind's CPU has no SHA extensions; this machine's CPU {_sha_extensions()})")
    if libs:
        print("  by where the instructions ran (each function's own): " + ", ".join(
            f"{_LIBS.get(k, k)} {v / n / 1e6:.2f} M" for k, v in sorted(libs.items(), key=lambda kv: -kv[1])))
    if parts:
        over = parts.pop("overhead", 0)
        for name in dict.fromkeys(name for name, _attr in phases):
            if name in parts:
                print(f"  {name}: {(parts[name] - over) / n / 1e6:.2f} M")


def _sha_extensions() -> str:
    """Whether this machine's CPU has the SHA extensions (``sha_ni`` in /proc/cpuinfo),
    which libcrypto uses where it runs natively: SHA-256 then takes a small part of the
    instructions counted here."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return "may have them"
    return "has them (sha_ni)" if " sha_ni" in flags else "lacks them too"


#: What each library of :func:`_by_library` does in a load, as printed.
_LIBS = {
    "libpython": "Python (the interpreter, its objects, allocation and freeing, its modules in C)",
    "numpy": "numpy",
    "msgspec": "msgspec (decoding the manifest and indexes, layout keys, Structs)",
    "torch": "torch (its own code, its Python bindings included; the calls into them count as Python)",
    "libcrypto": "libcrypto (SHA-256)",
    "libc": "libc (memory, strings)",
    "zlib": "zlib / zlib-ng (CRC-32: the seal and index digests of format version 3)",
    "other": "other",
}


def _by_library(d: str, phases: bool) -> dict[str, int] | None:
    """The instructions of the counted run by the library they ran in (each
    function's own cost; :data:`_LIBS`): the dump labelled "whole" with ``phases``,
    else the final one; None without ``callgrind_annotate``. libcrypto runs only
    SHA-256 in a load or a save."""
    if shutil.which("callgrind_annotate") is None:
        return None
    pick = None
    for f in Path(d).glob("cg.out*"):
        head = f.read_text(errors="replace")[:4000]
        label = re.search(r"^desc: Trigger: (.*)$", head, re.M)
        trigger = label.group(1) if label else ""
        if (phases and re.search(r"dump\s*\(?whole", trigger)) or (not phases and "termination" in trigger):
            pick = f
    if pick is None:
        return None
    out = subprocess.run(["callgrind_annotate", "--threshold=100", str(pick)], capture_output=True, text=True)
    total: dict[str, int] = {}
    for line in out.stdout.splitlines():
        m = re.match(r"\s*([\d,]+) .*?:\S+(?: \[([^]]*)\])?\s*$", line)
        if m is None or "PROGRAM TOTALS" in line:
            continue
        lib = _library(m.group(2) or "")
        total[lib] = total.get(lib, 0) + int(m.group(1).replace(",", ""))
    return total


#: A shared object's library (:data:`_LIBS`) by the start of its file name; the first match counts.
_BY_NAME = [("msgspec", ("_core.",)), ("libcrypto", ("libcrypto",)), ("torch", ("libtorch", "libc10", "_C.")),
            ("libc", ("libc.", "libm.", "ld-linux")), ("zlib", ("libz.", "zlib_ng")),
            ("numpy", ("_multiarray", "libopenblas", "libscipy")), ("libpython", ("libpython",))]


def _library(path: str) -> str:
    """The library of :data:`_LIBS` that the shared object ``path`` belongs to (no
    path: the python executable; another C module of Python's: Python)."""
    name = os.path.basename(path)
    for lib, starts in _BY_NAME:
        if name.startswith(starts) and (lib != "msgspec" or "msgspec" in path):
            return lib
    return "libpython" if name == "" or ".cpython-" in name else "other"


def _parts(d: str) -> dict[str, int]:
    """Instructions by label, summed over the dumps of ``--phases`` (those labelled
    "before" count the time between parts, dropped)."""
    out: dict[str, int] = {}
    for f in Path(d).glob("cg.out.*"):
        text = f.read_text(errors="replace")
        label = re.search(r"^desc: Trigger: .*?dump\s*(?:\()?([^)\n]*)", text, re.M)
        total = re.search(r"^(?:summary|totals): (\d+)", text, re.M)
        if label is None or total is None:
            continue
        name = label.group(1).strip()
        if name == "whole" or name.startswith("phase:"):
            key = name.removeprefix("phase:")
            out[key] = out.get(key, 0) + int(total.group(1))
    return out


if __name__ == "__main__":
    sys.exit(main())
