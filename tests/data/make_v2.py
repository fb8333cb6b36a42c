"""Regenerate the checked-in format-version-2 checkpoint in tests/data/v2.

    .venv/bin/python -m tests.data.make_v2 --force

Do not run this casually: the checked-in bytes *are* the fixture. They were written
by shardpoint as it stood before the save and load pipelines were rebuilt (commit
fb15892), and tests/test_format.py::test_v2_fixture_* proves that every later
version still loads them, value for value. The state is the one of make_v1.py
(4 real gloo ranks: a DTensor on a 2x2 mesh, rows on a 1-D mesh, a flat partition,
replicated tensors, per-rank values, plain values of every kind), saved in format
version 2 (sealed manifest, per-rank data files with CRC indexes).
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from tests.data.make_v1 import WORLD, rank_state

HERE = Path(__file__).resolve().parent


def _save(rank: int, world: int, path: str) -> None:
    import shardpoint

    shardpoint.save(rank_state(rank), path)


def main() -> None:
    if "--force" not in sys.argv:
        sys.exit("tests/data/v2 is a fixture: pass --force to rewrite it (see the docstring)")
    from tests._dist import run_ranks

    out = HERE / "v2"
    shutil.rmtree(out, ignore_errors=True)
    run_ranks(_save, WORLD, str(out), timeout=300)
    print(f"wrote {out}: {sorted(p.name for p in out.iterdir())}")


if __name__ == "__main__":
    main()
