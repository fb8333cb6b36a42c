"""Hugging Face Accelerate: ``save_state`` / ``load_state`` through shardpoint for
everything an ``Accelerator`` prepared, saved and loaded by every rank, resumable on
any number of processes with the data position carried over::

    from accelerate import Accelerator, DataLoaderConfiguration
    from shardpoint.integrations.accelerate import ResumableLoader, load_state, save_state

    accelerator = Accelerator(dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True))
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    data = ResumableLoader(loader)               # iterate this one
    accelerator.register_for_checkpointing(data)  # and any other object with state_dict()
    if resume:
        load_state(accelerator, path)
    for epoch in range(data.epoch, epochs):
        for batch in data:
            ...
            save_state(accelerator, f"ckpt/step_{step}")   # on every rank

Saved: the prepared models (canonical parameter names), optimizers (by parameter
name when there is one model and one optimizer), schedulers, the grad scaler, every
rank's RNG streams, and each object registered with ``register_for_checkpointing``.
Accelerate's own ``save_state`` writes most of this on the main process only and
cannot change the world size; its pre-hooks cover models only.

Data position: :class:`ResumableLoader` counts the samples the whole job consumed in
the current epoch (batches handed out x ``total_batch_size``). Loaded on another
number of processes, it skips exactly that many samples of the epoch, so keep the
global batch (``batch_size x processes``) and the sampler's order independent of the
world size (``use_seedable_sampler=True``, or no shuffling). Restored RNG streams are
applied when it hands out its first batch, after the loader drew its own seeds.

Schedulers: by default Accelerate steps a prepared scheduler once per process at
every optimizer step (``step_scheduler_with_optimizer=True`` without
``split_batches``), so the schedule's position depends on the number of processes;
resumed on another number, it continues at another pace. Create the ``Accelerator``
with ``step_scheduler_with_optimizer=False`` (the scheduler then counts optimizer
steps) to continue the same schedule on any number of processes.

Every rank must call both functions; a call only some ranks make is abandoned with a
:class:`~shardpoint.CollectiveMismatchError` naming the others after ``timeout``.

Accelerate is imported lazily: importing this module never imports it.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from datetime import timedelta
from typing import Any, Protocol, TypedDict

import torch

from .. import api
from ..errors import UnsupportedConfigError, UnsupportedTypeError
from ..report import LoadReport, SaveStats
from ..state import TrainState
from ..tree import Stateful
from ._trainer import apply_rng, capture_rng

__all__ = ["save_state", "load_state", "ResumableLoader"]


class _Accelerator(Protocol):
    """What is read of an ``accelerate.Accelerator``: its prepared and registered objects."""

    _models: list[torch.nn.Module]
    _optimizers: list[torch.optim.Optimizer]
    _schedulers: list[Stateful]
    _custom_objects: list[object]


class _Position(TypedDict):
    """A :class:`ResumableLoader`'s state."""

    epoch: int
    samples_in_epoch: int
    total_batch_size: int


class ResumableLoader:
    """Wraps a DataLoader that ``accelerator.prepare`` returned; iterate this object
    instead and register it with ``accelerator.register_for_checkpointing``.

    Its state is the job's position: the epoch and the samples all ranks together
    consumed in it. The same on every rank, so it loads on any world size.
    """

    def __init__(self, loader: Any) -> None:
        if not hasattr(loader, "skip_batches") or not hasattr(loader, "total_batch_size"):
            raise UnsupportedTypeError(
                f"ResumableLoader wraps the DataLoader that accelerator.prepare() returned (a DataLoaderShard); "
                f"got a {type(loader).__name__}. Prepare it first (dispatch_batches=False)"
            )
        self.loader = loader
        self._yielded = 0  # batches this rank handed out in the current epoch
        self._skip = 0  # batches to skip at the next iteration (after a load)
        self._rng: dict[str, object] | None = None  # RNG streams to apply at the first batch (after a load)

    @property
    def epoch(self) -> int:
        """The epoch the next batch belongs to."""
        return int(self.loader.iteration)

    @property
    def samples_in_epoch(self) -> int:
        """Samples the whole job consumed in the current epoch."""
        return self._yielded * int(self.loader.total_batch_size)

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        loader = self.loader
        skip, self._skip = self._skip, 0
        loader.skip_batches = skip
        self._yielded = skip
        try:
            for batch in loader:
                if self._rng is not None:
                    apply_rng(self._rng)
                    self._rng = None
                self._yielded += 1
                yield batch
            self._yielded = 0  # the epoch is over: loader.iteration moved on
        finally:
            loader.skip_batches = 0

    def state_dict(self) -> _Position:
        return {"epoch": self.epoch, "samples_in_epoch": self.samples_in_epoch,
                "total_batch_size": int(self.loader.total_batch_size)}

    def load_state_dict(self, state: _Position) -> None:
        samples, per_step = int(state["samples_in_epoch"]), int(self.loader.total_batch_size)
        if samples % per_step:
            raise UnsupportedConfigError(
                f"the checkpoint consumed {samples} samples of epoch {state['epoch']}, not a whole number of this "
                f"job's batches of {per_step} (batch_size x processes); choose a batch size that divides it "
                f"(it was saved with {state['total_batch_size']})"
            )
        self.loader.set_epoch(int(state["epoch"]))
        self._skip = self._yielded = samples // per_step


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The module inside DDP / ``torch.compile`` wrappers (``accelerator.unwrap_model``
    would import DeepSpeed, when installed, on every call)."""
    while True:
        inner = getattr(model, "_orig_mod", None)
        if inner is None and type(model).__name__ in ("DistributedDataParallel", "DataParallel"):
            inner = model.module
        if inner is None:
            return model
        model = inner


def _train_state(accelerator: _Accelerator, rng: bool | int) -> TrainState:
    models = [_unwrap(m) for m in accelerator._models]
    opts = [getattr(o, "optimizer", o) for o in accelerator._optimizers]
    scheds = [getattr(s, "scheduler", s) for s in accelerator._schedulers]
    extra: dict[str, Any] = {}
    one = len(models) == 1 and len(opts) == 1  # optimizer state by parameter name
    for i, m in enumerate(models[1:], 1):
        extra[f"model_{i}"] = m
    if not one:
        extra.update({f"optimizer_{i}": o for i, o in enumerate(opts)})
    extra.update({f"scheduler_{i}": s for i, s in enumerate(scheds[1:], 1)})
    extra.update({f"custom_{i}": o for i, o in enumerate(accelerator._custom_objects)})
    return TrainState(
        model=models[0] if models else None, optimizer=opts[0] if one else None,
        scheduler=scheds[0] if scheds else None, grad_scaler=getattr(accelerator, "scaler", None), rng=rng, **extra,
    )


def save_state(accelerator: _Accelerator, output_dir: str | os.PathLike[str], *, rng: bool | int = True,
               overwrite: bool = True, timeout: timedelta | float = api.DEFAULT_TIMEOUT) -> None:
    """Save the accelerator's prepared objects and registered objects to
    ``output_dir``. Collective: every rank calls it.

    Args:
        rng: save every rank's RNG streams (an int also sets the base seed that
            ranks new at load time derive theirs from).
        overwrite: replace a checkpoint already at ``output_dir`` (atomically).
        timeout: how long ranks wait for each other before the call is abandoned.
    """
    path = os.fspath(output_dir)
    # ranks meet by path (the tag), not by call order: a save only the main process makes is
    # abandoned naming the others, and never meets the next save of the whole job
    api.save(_train_state(accelerator, rng), path, overwrite=overwrite, timeout=timeout, tag="accelerate save_state",
             on_stats=lambda stats: _log_stats(accelerator, stats))


def _log_stats(accelerator: object, stats: SaveStats) -> None:
    """What the save cost (rank 0's figures), to the accelerator's trackers when it has
    any (``Accelerator(log_with=...)`` and ``init_trackers``)."""
    log = getattr(accelerator, "log", None)
    if stats.rank != 0 or not getattr(accelerator, "trackers", None) or not callable(log):
        return
    log({"checkpoint/save_seconds": stats.wall_s, "checkpoint/stall_seconds": stats.stall_s,
         "checkpoint/gb": (stats.checkpoint_bytes or 0) / 1e9})


def load_state(accelerator: _Accelerator, input_dir: str | os.PathLike[str], *, rng: bool | int = True,
               exclude: list[str] | None = None, strict: bool = True,
               timeout: timedelta | float = api.DEFAULT_TIMEOUT) -> LoadReport:
    """Load what :func:`save_state` saved, in place, on any number of processes.
    Collective. Call it after ``accelerator.prepare`` and
    ``register_for_checkpointing``, before iterating.

    Args:
        exclude: key prefixes not to restore, e.g. ``["optimizer"]``.
        strict: raise when this job holds state the checkpoint lacks.
    """
    path = os.fspath(input_dir)
    state = _train_state(accelerator, rng)
    report = api.load(state, path, exclude=exclude, strict=strict, timeout=timeout)
    if state.rng is not False and report.per_rank.get("rng/streams") in ("restored", "derived"):
        streams = capture_rng()
        for obj in accelerator._custom_objects:
            if isinstance(obj, ResumableLoader):
                obj._rng = streams
    return report
