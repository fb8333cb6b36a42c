"""A batch sampler whose position belongs to the job, not to a rank, so a run can
resume on any number of ranks and still see exactly the samples it would have seen.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import torch

from ..collective import default_rank_and_world
from ..errors import ShardpointError, UsageError
from .batch import accumulation_steps, advance, epoch_order, global_batch

__all__ = ["ElasticBatchSampler"]

_STATE_VERSION = 1


class _UnknownPlacement(ShardpointError, ValueError):
    """The sampler's rank and world size are not known yet (see :meth:`ElasticBatchSampler._placement`)."""


class ElasticBatchSampler:
    """Yields this rank's micro-batches of sample indices, ``accumulation_steps``
    of them per optimizer step, for ``DataLoader(dataset, batch_sampler=...)``.

    Each optimizer step consumes one global batch of ``global_batch_size`` samples:
    the next ``global_batch_size`` indices of the epoch's order (a permutation drawn
    from ``seed + epoch``). Rank ``r`` of ``W`` takes the ``r``-th of ``W`` equal,
    contiguous slices of it and cuts that into micro-batches of ``micro_batch_size``.
    The global batches do not depend on the world size, so a job resumed on any
    number of ranks sees the same sample sequence as the uninterrupted run.

    The position is global (seed, epoch, offset in the epoch, steps and samples
    consumed by the whole job) and moves only when you call :meth:`step` after an
    optimizer step, never when the iterator hands out a batch: DataLoader workers
    prefetching ahead cannot make a resume skip samples. ``shardpoint_global_state``
    tells ``TrainState(data=sampler)`` to store that state once, not per rank.

    Iteration starts at the current position and ends with the last step of the
    current epoch; ``iter(loader)`` again continues with the next epoch. After
    :meth:`load_state_dict`, create a new DataLoader iterator: one made before it
    still walks from the old position.

    Args:
        dataset_len: number of samples in the dataset.
        global_batch_size: samples per optimizer step, summed over all ranks and
            micro-batches.
        micro_batch_size: samples per forward/backward on one rank.
        rank: this rank; by default the rank in the default process group, read
            when iteration starts (so the sampler may be built before the process
            group exists, as a Lightning script does before ``Trainer.fit``), or 0
            without torch.distributed.
        world_size: number of ranks; by default the default process group's size,
            read when iteration starts, or 1 without torch.distributed. The
            accumulation steps follow from it, so they are known from then on too.
        seed: seed of the epoch permutations (restored from a checkpoint).
        shuffle: draw a permutation per epoch; ``False`` visits ``0..n-1`` in order.
        drop_last: ``True`` (default): when fewer than ``global_batch_size`` samples
            are left in an epoch's order, they are skipped and the next epoch starts,
            so every step has exactly ``global_batch_size`` samples and each sample is
            used at most once per epoch. ``False``: epochs form one continuous
            stream; the last global batch of an epoch runs on into the next epoch's
            order, so no sample is skipped (the straddling batch may hold a sample
            twice when the dataset is small).

    Raises:
        ValueError: ``global_batch_size`` is not a multiple of
            ``micro_batch_size * world_size`` (the message lists the nearest valid
            settings), or the dataset is smaller than one global batch with
            ``drop_last``. Without ``world_size``, the check that needs the world
            size runs when it is first known (at iteration). A sampler of a process
            that its launcher started as one of several (``WORLD_SIZE`` > 1) refuses
            to iterate, or to tell its ``rank``, ``world_size`` or
            ``accumulation_steps``, while torch.distributed is not initialised:
            it would take rank 0 of 1 and every rank would train on the same samples.
    """

    shardpoint_global_state = True

    def __init__(
        self,
        dataset_len: int,
        global_batch_size: int,
        micro_batch_size: int,
        *,
        rank: int | None = None,
        world_size: int | None = None,
        seed: int = 0,
        shuffle: bool = True,
        drop_last: bool = True,
    ) -> None:
        # what the world size does not change is checked now; the rest once it is known
        accumulation_steps(global_batch_size, micro_batch_size, 1 if world_size is None else world_size)
        if isinstance(dataset_len, bool) or not isinstance(dataset_len, int) or dataset_len <= 0:
            raise UsageError(f"dataset_len must be a positive int, got {dataset_len!r}")
        if rank is not None and (rank < 0 or (world_size is not None and rank >= world_size)):
            raise UsageError(f"rank {rank} is outside world_size {world_size}; pass a rank in range(world_size)")
        if drop_last and dataset_len < global_batch_size:
            raise UsageError(
                f"dataset_len {dataset_len} is smaller than global_batch_size {global_batch_size}, so with "
                f"drop_last=True no step fits in an epoch; lower global_batch_size or pass drop_last=False"
            )
        self.dataset_len = dataset_len
        self.global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size
        self._rank_arg = rank  # None: the default process group's, read when needed
        self._world_arg = world_size
        self.shuffle = shuffle
        self.drop_last = drop_last
        self._seed = seed
        self._epoch = 0
        self._offset = 0
        self._step = 0
        self._samples = 0
        self._orders: dict[int, torch.Tensor] = {}

    # -- placement --------------------------------------------------------------

    def _placement(self) -> tuple[int, int]:
        """This rank and the world size: the caller's, else the default process
        group's now (the sampler may have been built before the group existed), else
        0 of 1 in a process that is alone. Refuses rather than guess when the
        launcher started this process as one of several but no group exists yet."""
        rank, world = self._rank_arg, self._world_arg
        if rank is None or world is None:
            found = default_rank_and_world()
            if found is None:
                launched = os.environ.get("WORLD_SIZE", "1")
                if launched.isdigit() and int(launched) > 1:
                    raise _UnknownPlacement(
                        f"ElasticBatchSampler(dataset_len={self.dataset_len}, global_batch_size="
                        f"{self.global_batch_size}) does not know its rank yet: this process is one of "
                        f"WORLD_SIZE={launched} (set by the launcher) but torch.distributed is not initialised, "
                        "and as rank 0 of 1 every rank would train on the same samples. Iterate it only after "
                        "the process group exists (Lightning's Trainer.fit and Accelerator() create it), or "
                        "build it with rank= and world_size="
                    )
                found = (0, 1)
            rank = found[0] if rank is None else rank
            world = found[1] if world is None else world
        if not 0 <= rank < world:
            raise UsageError(f"rank {rank} is outside world_size {world}: give ElasticBatchSampler a rank in "
                             f"0..{world - 1}")
        return rank, world

    @property
    def rank(self) -> int:
        """This rank (see ``rank`` in the class docstring)."""
        return self._placement()[0]

    @property
    def world_size(self) -> int:
        """The number of ranks sharing each global batch."""
        return self._placement()[1]

    @property
    def accumulation_steps(self) -> int:
        """Micro-batches per rank per optimizer step, on this world size.

        Raises:
            ValueError: ``global_batch_size`` is not a multiple of
                ``micro_batch_size * world_size``; the message lists the nearest
                valid settings.
        """
        return accumulation_steps(self.global_batch_size, self.micro_batch_size, self._placement()[1])

    # -- position ---------------------------------------------------------------

    @property
    def seed(self) -> int:
        return self._seed

    @property
    def epoch(self) -> int:
        """The epoch the next global batch starts in."""
        return self._epoch

    @property
    def offset(self) -> int:
        """Where the next global batch starts in the epoch's order."""
        return self._offset

    @property
    def global_step(self) -> int:
        """Optimizer steps completed by the job (calls of :meth:`step`)."""
        return self._step

    @property
    def samples_consumed(self) -> int:
        """Samples consumed by the whole job, all ranks together."""
        return self._samples

    def step(self) -> None:
        """Record one completed optimizer step: the job consumed one global batch.
        Call it on every rank right after ``optimizer.step()``."""
        self._epoch, self._offset = advance(
            self.dataset_len, self._epoch, self._offset, self.global_batch_size, drop_last=self.drop_last
        )
        self._step += 1
        self._samples += self.global_batch_size

    # -- batches ----------------------------------------------------------------

    def _order(self, epoch: int) -> torch.Tensor:
        order = self._orders.get(epoch)
        if order is None:
            if len(self._orders) >= 2:  # the current epoch and the next are all a batch spans
                self._orders.pop(min(self._orders))
            order = epoch_order(self.dataset_len, epoch, seed=self._seed, shuffle=self.shuffle)
            self._orders[epoch] = order
        return order

    def global_batch(self, epoch: int | None = None, offset: int | None = None) -> list[int]:
        """The whole job's global batch starting at ``(epoch, offset)`` (default: the
        current position), in the order in which ranks and micro-batches split it."""
        e = self._epoch if epoch is None else epoch
        o = self._offset if offset is None else offset
        batch = global_batch(
            self.dataset_len, e, o, self.global_batch_size, seed=self._seed, shuffle=self.shuffle,
            order=self._order,
        )
        return batch.tolist()

    def _rank_micro_batches(self, epoch: int, offset: int, rank: int, world: int) -> list[list[int]]:
        share = self.global_batch_size // world
        batch = global_batch(
            self.dataset_len, epoch, offset, self.global_batch_size, seed=self._seed, shuffle=self.shuffle,
            order=self._order,
        )
        mine = batch[rank * share : (rank + 1) * share].tolist()
        m = self.micro_batch_size
        return [mine[i : i + m] for i in range(0, share, m)]

    def __iter__(self) -> Iterator[list[int]]:
        # the position and the placement are read now, when the iterator is made, not
        # at its first next(); the placement is checked against the batch sizes here
        rank, world = self._placement()
        accumulation_steps(self.global_batch_size, self.micro_batch_size, world)
        return self._walk(self._epoch, self._offset, rank, world)

    def _walk(self, epoch: int, offset: int, rank: int, world: int) -> Iterator[list[int]]:
        start = epoch
        while epoch == start:
            yield from self._rank_micro_batches(epoch, offset, rank, world)
            epoch, offset = advance(
                self.dataset_len, epoch, offset, self.global_batch_size, drop_last=self.drop_last
            )

    def __len__(self) -> int:
        """Micro-batches this rank has left in the current epoch."""
        left = self.dataset_len - self._offset
        g = self.global_batch_size
        steps = left // g if self.drop_last else -(-left // g)
        return steps * self.accumulation_steps

    # -- checkpointing ----------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The job's data position; the same on every rank (no rank, no world size)."""
        return {
            "version": _STATE_VERSION,
            "seed": self._seed,
            "epoch": self._epoch,
            "offset": self._offset,
            "step": self._step,
            "samples_consumed": self._samples,
            "dataset_len": self.dataset_len,
            "global_batch_size": self.global_batch_size,
            "shuffle": self.shuffle,
            "drop_last": self.drop_last,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a saved position, on any rank and world size. The saved
        seed replaces the constructor's. A different ``global_batch_size`` is allowed:
        the run continues from the same sample with the new batch size.

        Raises:
            ValueError: the dataset length, ``shuffle`` or ``drop_last`` differ from
                the saved ones (the saved position would mean other samples).
        """
        version = int(state.get("version", _STATE_VERSION))
        if version > _STATE_VERSION:
            raise UsageError(
                f"sampler state version {version} is newer than this shardpoint understands "
                f"({_STATE_VERSION}); upgrade shardpoint"
            )
        for name in ("dataset_len", "shuffle", "drop_last"):
            saved, mine = state[name], getattr(self, name)
            if saved != mine:
                raise UsageError(
                    f"the checkpoint's data position was saved with {name}={saved!r} but this sampler has "
                    f"{name}={mine!r}; the position would point at other samples. Build the sampler with "
                    f"{name}={saved!r}, or do not restore the data position (exclude=['data'])"
                )
        self._seed = int(state["seed"])
        self._epoch = int(state["epoch"])
        self._offset = int(state["offset"])
        self._step = int(state["step"])
        self._samples = int(state["samples_consumed"])
        self._orders.clear()
        if self.drop_last and self._offset + self.global_batch_size > self.dataset_len:
            self._epoch, self._offset = self._epoch + 1, 0  # a larger global batch no longer fits

    def __repr__(self) -> str:
        rank: int | None
        world: int | None
        try:
            rank, world = self._placement()
        except ValueError:  # not known yet: say so rather than fail in a repr
            rank, world = self._rank_arg, self._world_arg
        return (
            f"ElasticBatchSampler(dataset_len={self.dataset_len}, global_batch_size={self.global_batch_size}, "
            f"micro_batch_size={self.micro_batch_size}, rank={rank}, world_size={world}, "
            f"epoch={self._epoch}, offset={self._offset}, step={self._step})"
        )
