"""RNG streams as training state: Python, NumPy and torch (CPU, CUDA) generators,
saved per rank and restored per rank; a rank that did not exist at save time derives
fresh streams from the base seed. Used by :class:`~shardpoint.TrainState` and every
owner state built on it (``integrations.deepspeed.EngineState``)."""

from __future__ import annotations

import random
import zlib
from collections.abc import Mapping
from typing import Any, cast

import numpy as np
import torch

from ._optim import Entries
from .format.model import PerRankEntry
from .report import LoadReport
from .tree import PerRank

__all__ = ["RngStreams", "derived_seed"]

#: The report's per-rank key of the streams, relative to their owner.
KEY = "rng/streams"


def derived_seed(base_seed: int, rank: int) -> int:
    """The seed a rank that did not exist at save time derives its streams from."""
    return zlib.crc32(f"{base_seed}:{rank}".encode()) * 1000003 % (1 << 63)


def current_streams() -> dict[str, object]:
    """This process's generators, as plain values and arrays."""
    version, internal, gauss = random.getstate()
    # legacy=True: the MT19937 tuple (numpy's stubs also allow the dict of other bit generators)
    np_state = cast("tuple[str, np.ndarray, int, int, float]", np.random.get_state(legacy=True))
    out: dict[str, object] = {
        "python": {"version": version, "state": np.array(internal, dtype=np.int64), "gauss": gauss},
        "numpy": {"kind": np_state[0], "keys": np.asarray(np_state[1]).copy(), "pos": int(np_state[2]),
                  "has_gauss": int(np_state[3]), "cached": float(np_state[4])},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        # the generator of this rank's own device only: another device's belongs to
        # another rank, and a resumed process may see fewer devices
        out["cuda"] = [torch.cuda.get_rng_state(torch.cuda.current_device())]
    return out


def set_streams(s: Mapping[str, Any]) -> None:  # Any: loaded values, shaped as current_streams() makes them
    """Set this process's generators from :func:`current_streams`' values."""
    py = s["python"]
    random.setstate((py["version"], tuple(int(x) for x in py["state"]), py["gauss"]))
    n = s["numpy"]
    np.random.set_state((n["kind"], np.asarray(n["keys"], dtype=np.uint32), n["pos"], n["has_gauss"], n["cached"]))
    torch.set_rng_state(torch.as_tensor(s["torch"], dtype=torch.uint8))
    if s.get("cuda") and torch.cuda.is_available():
        dev = torch.cuda.current_device()
        states = list(s["cuda"])
        # one state: this rank's device's (as saved now); several: every visible device's, as
        # older versions saved them: take this device's where it exists
        state = states[0] if len(states) == 1 else states[dev] if dev < len(states) else None
        if state is not None:
            torch.cuda.set_rng_state(torch.as_tensor(state, dtype=torch.uint8), dev)


class RngStreams:
    """The ``rng`` part of an owner's state and its load steps.

    Args:
        rng: True to save and restore the streams (base seed 0), an int to do the same
            with that base seed, False to leave RNG alone.
    """

    def __init__(self, rng: bool | int) -> None:
        self.rng = rng
        self._absent = False  # during a load from a checkpoint saved without RNG streams
        self._no_cuda = False  # during a load from a checkpoint that saved no CUDA stream

    @property
    def base_seed(self) -> int:
        return 0 if self.rng is True else int(self.rng)

    def state(self) -> dict[str, object] | None:
        """``{"base_seed", "streams": PerRank(...)}``, or None when not saved (or, during a
        load, not in the checkpoint)."""
        if self.rng is False or self._absent:
            return None
        streams = current_streams()
        if self._no_cuda:  # a checkpoint saved where CUDA was not in use loads here where it is
            streams.pop("cuda", None)
        return {"base_seed": self.base_seed, "streams": PerRank(streams)}

    def prepare_load(self, entries: Entries) -> None:
        """A checkpoint saved without RNG streams (``rng=False``, or converted from
        DeepSpeed's files) leaves this rank's streams alone instead of failing a strict load."""
        self._absent = not any(k == "rng" or k.startswith("rng/") for k in entries)
        e = entries.get("rng/streams") if not self._absent else None
        per_rank = e.ranks if isinstance(e, PerRankEntry) else {}
        self._no_cuda = not any(k.startswith("rng/streams/cuda") for sub in per_rank.values() for k in sub.entries)

    def apply(self, rng: object) -> None:
        """Set this rank's saved streams, or (a rank new since the save) its current
        ones: :meth:`after_load` then derives fresh streams for the latter."""
        if self.rng is not False and isinstance(rng, Mapping) and isinstance(rng.get("streams"), PerRank):
            set_streams(rng["streams"].value)

    def after_load(self, report: LoadReport, rank: int) -> None:
        """Say in ``report.per_rank["rng/streams"]`` what happened on this rank:
        ``restored``, ``derived`` (seeded from :func:`derived_seed`) or ``not in checkpoint``."""
        self._no_cuda = False
        if self.rng is False:  # the saved streams (if any) were not applied
            self._absent = False
            report.per_rank.pop(KEY, None)
            return
        if self._absent:
            self._absent = False
            report.per_rank[KEY] = "not in checkpoint"
            return
        if self.rng is not False and report.per_rank.get(KEY) == "kept":
            seed = derived_seed(self.base_seed, rank)
            random.seed(seed)
            np.random.seed(seed % (1 << 32))
            torch.manual_seed(seed)
            report.per_rank[KEY] = "derived"
