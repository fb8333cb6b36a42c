"""What the trainer integrations (Lightning, Accelerate, transformers) share: the
tag their saves arrive with, and RNG streams captured now and applied later.

Why a tag: a trainer calls the checkpoint at a point of its own loop, and users
guard such calls with ``if is_main_process:``. Ranks that meet by call order would
match such a save against the next save of the whole job (Lightning's
``last.ckpt`` at every save, or another path right after it). A save made with a
tag (:func:`shardpoint.save`'s ``tag``, here the trainer's global step) arrives in a
slot of its own for (operation, path, tag) in the core's arrival
(:meth:`shardpoint.collective.Comm.arrive`): a save that only rank 0 made is
abandoned with a :class:`~shardpoint.CollectiveMismatchError` naming the absent
ranks before anything collective is entered, and the next save of the whole job
meets in a fresh slot. That arrival is the save's only one, and its store keys are
deleted when the last rank leaves it.
"""

from __future__ import annotations

from typing import Any

from .._rng import current_streams, set_streams

__all__ = ["Unsaveable", "capture_rng", "apply_rng", "step_tag"]

#: This process's RNG streams, captured now and set later (the core's own helpers).
capture_rng, apply_rng = current_streams, set_streams


def step_tag(step: object) -> str:
    """The arrival tag of a trainer's save at ``step``."""
    return f"global step {step}"


class Unsaveable:
    """Stands for the state of a save whose preparation failed on this rank after
    every rank arrived: saving it fails on every rank, naming this rank's error,
    instead of the other ranks waiting in the save's collectives for this one."""

    def __init__(self, error: BaseException) -> None:
        self.error = error

    def state_dict(self) -> dict[str, Any]:
        raise self.error

    def load_state_dict(self, state: dict[str, Any]) -> None:  # pragma: no cover - never loaded
        raise self.error
