"""The Python work of a save, counted in CPU instructions: what a save costs besides
its writes, measured so that a busy machine cannot move it (the twin of
``load_python_cost.py``, same method, same state).

The 408-tensor FSDP2 + AdamW state of ``load_python_cost.py`` (17 blocks, 256 wide,
one optimizer step taken: 78 MB) is saved by one process (one gloo rank, as that
benchmark loads it) ``--saves`` times under ``valgrind --tool=callgrind``,
instrumentation on only around those saves, with the writes stubbed out: the
storage is a dictionary that keeps the small files (index, manifest) and drains a
data file's parts without copying them, and the two passes over the bytes as they
stream (the block CRCs and the health scan for NaN and infinity) return at once.
Everything else runs as in a real save: describe, arrive, coordinate (the plan is
cached after the first save, as in training), stage (in place: a blocking save),
the data file's header and its stream of pieces, the index, the commit with its
manifest. Prints millions of instructions per save.

    OMP_NUM_THREADS=1 PYTHONPATH=src:. python benchmarks/save_python_cost.py [--saves 3] [--phases]

With ``--phases``, each save's parts are counted apart as well (a dump of the
counters at each part's start and end, their own cost measured and taken off): the
functions of ``shardpoint.saving.pipeline`` named in ``PHASES`` (those the code has).

Needs valgrind (Debian's package); without it, prints the wall time instead.
To compare two commits, run it with ``PYTHONPATH`` pointing at each one's ``src``.
"""

from __future__ import annotations

import argparse
import builtins
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from load_python_cost import _dump, _state, callgrind_here, print_counts, run_worker  # noqa: E402
from load_python_cost import _phased as _phased_in  # noqa: E402

#: The parts of a save counted apart with ``--phases``: (name, attribute of
#: shardpoint.saving.pipeline; ``Stage.x``: a method of its ``Stage`` class).
PHASES = [
    ("describe", "describe"),
    ("coordinate, the plan cached", "request_assignment"),
    ("stage: rows, names", "Stage.__init__"),
    ("stage: in place", "Stage.in_place"),
    ("write: header, stream, index", "_write"),
    ("commit: statuses, manifest", "commit"),
]


def _nbytes(part: bytes | memoryview) -> int:
    return part.nbytes if isinstance(part, memoryview) else len(part)


def _memory_storage() -> Any:
    """A storage that writes nothing: small files kept in a dictionary, a data file's
    parts drained (their sizes added up, no copy)."""
    from shardpoint.storage.base import Storage

    class Memory(Storage):
        def __init__(self) -> None:
            self.url = "memory:save_python_cost"
            self.files: dict[str, bytes | int] = {}

        def write_file(self, name: str, parts: Iterable[bytes | memoryview]) -> int:
            if name.endswith(".safetensors"):  # a data file: its parts drained in C, only their sizes kept
                total = sum(map(_nbytes, parts))
                self.files[name] = total
                return total
            data = b"".join(parts)
            self.files[name] = data
            return len(data)

        def write_atomic(self, name: str, data: bytes) -> None:
            self.files[name] = bytes(data)

        def read(self, name: str, offset: int = 0, length: int | None = None) -> bytes:
            data = self.files[name]
            assert isinstance(data, bytes), name
            return data[offset : None if length is None else offset + length]

        def exists(self, name: str) -> bool:
            return name in self.files

        def size(self, name: str) -> int:
            data = self.files[name]
            return data if isinstance(data, int) else len(data)

        def sizes(self) -> dict[str, int]:
            return {n: self.size(n) for n in self.files}

        def list(self) -> builtins.list[str]:
            return sorted(self.files)

        def remove(self, name: str) -> None:
            self.files.pop(name, None)

        def remove_all(self) -> None:
            self.files.clear()

        def child(self, name: str) -> Storage:
            raise NotImplementedError

        def list_dirs(self) -> builtins.list[str]:
            return []

    return Memory()


def _stub_byte_passes() -> None:
    """The CRCs and the health scan of the streamed bytes return at once."""
    from shardpoint.health import FINITE
    from shardpoint.saving import write

    write.crc32 = lambda data, crc=0: 0  # type: ignore[assignment]
    write._health = lambda piece, dtype: FINITE  # type: ignore[assignment]


def _phased() -> None:
    """Wrap each function of ``PHASES`` in dumps of the counters at its start and end."""
    from shardpoint.saving import pipeline

    _phased_in(pipeline, PHASES)


def _worker(saves: int, counted: bool, phases: bool = False) -> None:
    """One rank: save twice (warm: the second reuses the plan), then ``saves`` times."""
    import torch.distributed as dist
    from tests._dist import free_port

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1",
                      LOCAL_WORLD_SIZE="1")
    dist.init_process_group("gloo")
    import shardpoint

    _stub_byte_passes()
    state = _state(1, 0, True)
    for _ in range(2):
        shardpoint.save(state, _memory_storage())
    stores = [_memory_storage() for _ in range(2 * saves + 1)]
    if counted:
        subprocess.run(["callgrind_control", "-i", "on", str(os.getpid())], check=True, capture_output=True)
    t = time.perf_counter()
    for i in range(saves):
        shardpoint.save(state, stores[i])
    dt = time.perf_counter() - t
    if counted and phases:
        _dump("whole")
        for _ in range(saves):  # what a dump costs the counters: between two dumps, nothing else
            _dump("before")
            _dump("phase:overhead")
        _phased()
        for i in range(saves):
            shardpoint.save(state, stores[saves + i])
        _dump("before")
    if counted:
        subprocess.run(["callgrind_control", "-i", "off", str(os.getpid())], check=True, capture_output=True)
    man = stores[0].files.get("manifest.json")
    print(f"wall {dt / saves * 1e3:.2f} ms a save; manifest {len(man) if isinstance(man, bytes) else '?'} bytes",
          flush=True)
    dist.destroy_process_group()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--saves", type=int, default=3)
    ap.add_argument("--phases", action="store_true", help="count the parts of a save apart as well")
    ap.add_argument("--worker", nargs=1, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        _worker(args.saves, args.worker[0] == "counted", args.phases)
        return 0
    import shardpoint

    counted = callgrind_here()
    with tempfile.TemporaryDirectory() as d:
        got = run_worker(__file__, ["--saves", str(args.saves), *(["--phases"] if args.phases else []),
                                    "--worker", "counted" if counted else "-"], d, counted, args.phases)
    if got is None:
        return 1
    text, parts = got
    print(f"shardpoint {shardpoint.__version__} from {Path(shardpoint.__file__).parent}")
    wall = re.search(r"wall ([0-9.]+) ms a save; manifest (\S+) bytes", text)
    print(f"wall time a save (under valgrind when counted): {wall.group(1) if wall else '?'} ms; "
          f"manifest {wall.group(2) if wall else '?'} bytes")
    print_counts("a save without its writes", text, parts, args.saves, PHASES)
    return 0

if __name__ == "__main__":
    sys.exit(main())
