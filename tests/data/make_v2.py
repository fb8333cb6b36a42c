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

from tests.data.make_v1 import regenerate


def main() -> None:
    regenerate("v2")  # make_v1.py's state, saved by the code of the day


if __name__ == "__main__":
    main()
