"""Regenerate the checked-in format-version-1 checkpoint in tests/data/v1.

    .venv/bin/python -m tests.data.make_v1 --force

Do not run this casually: the checked-in bytes *are* the fixture, and the test
(tests/test_format.py::test_v1_fixture_*) proves that every later version of
shardpoint still loads a checkpoint that version 1 wrote. When the format
version changes, add a new folder (v2) with a new script; keep v1 as it is.

It saves on 4 real gloo ranks: a DTensor sharded on a 2x2 mesh, one sharded by
rows on a 1-D mesh, a ZeRO-style flat partition, a replicated tensor (written
once), optimizer-like state, plain values of every kind, odd keys, dtypes
safetensors lacks (stored as bytes), a numpy array, per-rank values and empty
containers. tests/test_format.py holds the expected values as formulas.
"""

from __future__ import annotations

import math
import shutil
import sys
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
WORLD = 4


def grid() -> torch.Tensor:
    return torch.arange(35, dtype=torch.float32).reshape(7, 5) * 0.25 - 3  # uneven on 2x2


def rows() -> torch.Tensor:
    return (torch.arange(18, dtype=torch.float64).reshape(9, 2) / 3).to(torch.bfloat16)  # 9 rows on 4 ranks


def flat() -> torch.Tensor:
    return torch.arange(-11, 11, dtype=torch.int16).reshape(2, 11)  # 22 elements split 6/6/6/4


def rank_state(rank: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    import shardpoint
    from shardpoint.layout import FlatShard

    mesh2 = init_device_mesh("cpu", (2, 2))
    mesh1 = init_device_mesh("cpu", (WORLD,))
    lo, hi = min(rank * 6, 22), min(rank * 6 + 6, 22)
    return {
        "model": {
            "grid.weight": distribute_tensor(grid(), mesh2, [Shard(0), Shard(1)]),
            "rows": distribute_tensor(rows(), mesh1, [Shard(0)]),
            "flat": FlatShard(flat().reshape(-1)[lo:hi].clone(), (2, 11), lo),
            "bias": torch.tensor([0.5, -1.5, 2.5]),
        },
        "optim": {
            "state": {0: {"step": torch.tensor(7.0), "exp_avg": torch.linspace(-1, 1, 5, dtype=torch.float64)}},
            "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "params": [0], "name": "all"}],
        },
        "odd": {"a/b": 1, "%": b"\x00\xff", "0": "str zero", 0: "int zero", -1: None, "": -math.inf,
                "nan": math.nan, "big": 2**80 + 1, "neg0": -0.0, "yes": True},
        "dtypes": {
            "c64": torch.complex(torch.tensor([1.0, -2.0]), torch.tensor([0.5, 3.0])),
            "f8": torch.tensor([-1.5, 0.25, 2.0]).to(torch.float8_e4m3fnuz),
            "f8fn": torch.tensor([-1.5, 0.25, 2.0]).to(torch.float8_e4m3fn),
            "i8": torch.tensor([-128, 0, 127], dtype=torch.int8),
            "mask": torch.tensor([True, False, True]),
            "u64": torch.tensor([0, 2**63 + 5], dtype=torch.uint64),
        },
        "np": np.arange(6, dtype=np.int32).reshape(3, 2),
        "rng": shardpoint.PerRank({"seed": 100 + rank, "state": torch.arange(4, dtype=torch.uint8) + rank}),
        "empty": {"d": {}, "l": []},
        "zero": torch.zeros(0, 3),
        "scalar": torch.tensor(-0.125, dtype=torch.float16),
    }


def _save(rank: int, world: int, path: str) -> None:
    import shardpoint

    shardpoint.save(rank_state(rank), path)


def regenerate(name: str) -> None:
    """Save the state on ``WORLD`` real ranks into tests/data/<name> (only with --force)."""
    if "--force" not in sys.argv:
        sys.exit(f"tests/data/{name} is a fixture: pass --force to rewrite it (see the docstring)")
    from tests._dist import run_ranks

    out = HERE / name
    shutil.rmtree(out, ignore_errors=True)
    run_ranks(_save, WORLD, str(out), timeout=300)
    print(f"wrote {out}: {sorted(p.name for p in out.iterdir())}")


def main() -> None:
    regenerate("v1")


if __name__ == "__main__":
    main()
