"""The sample checkpoint of the failure tests: two ranks' worth of state, written
from one process with ``save_offline``: a tensor split between the ranks, one
large enough for two CRC blocks per chunk, a replicated tensor, a plain value and
a per-rank value."""

from __future__ import annotations

from typing import Any

import torch

import shardpoint
from shardpoint.api import save_offline
from shardpoint.layout import FlatShard

WORLD = 2
BIG = (2, (1 << 18) + 100)  # each rank's half is a little over 1 MiB: two CRC blocks


def expected() -> dict[str, Any]:
    """What ``load_full`` must return for the sample checkpoint."""
    return {
        "model": {
            "w": torch.arange(24, dtype=torch.float32).reshape(4, 6),
            "b": torch.arange(5, dtype=torch.float32) * 1.5,
            "big": torch.arange(BIG[0] * BIG[1], dtype=torch.int32).reshape(BIG),
        },
        "step": 7,
        "rng": {r: {"seed": torch.tensor([r, r + 1, r + 2])} for r in range(WORLD)},
    }


def rank_state(rank: int) -> dict[str, Any]:
    full = expected()
    w, big = full["model"]["w"].reshape(-1), full["model"]["big"].reshape(-1)
    hw, hb = w.numel() // WORLD, big.numel() // WORLD
    return {
        "model": {
            "w": FlatShard(w[rank * hw : (rank + 1) * hw].clone(), tuple(full["model"]["w"].shape), rank * hw),
            "b": full["model"]["b"].clone(),
            "big": FlatShard(big[rank * hb : (rank + 1) * hb].clone(), BIG, rank * hb),
        },
        "step": 7,
        "rng": shardpoint.PerRank(full["rng"][rank]),
    }


def write_sample(path: str) -> None:
    save_offline(((r, rank_state(r)) for r in range(WORLD)), path, world_size=WORLD)


def template() -> dict[str, Any]:
    """A one-process local state with the sample's keys, zero-filled, for ``load``."""
    return {
        "model": {
            "w": torch.zeros(4, 6),
            "b": torch.zeros(5),
            "big": torch.zeros(BIG, dtype=torch.int32),
        },
        "step": 0,
        "rng": shardpoint.PerRank({"seed": torch.zeros(3, dtype=torch.int64)}),
    }
