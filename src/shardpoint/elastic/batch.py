"""Batch arithmetic for elastic training: how a global batch splits into ranks and
micro-batches, and which samples make up the global batch of any step.

Everything here is pure (no torch.distributed, no state), so the sampler and the
tests share one definition of the sample sequence.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..errors import UsageError

__all__ = ["accumulation_steps", "epoch_order", "global_batch", "advance"]


def _check_positive(**values: int) -> None:
    for name, v in values.items():
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise UsageError(f"{name} must be a positive int, got {v!r}")


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, int(n**0.5) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def _nearest(candidates: list[int], target: int, k: int = 2) -> list[int]:
    return sorted(sorted(candidates, key=lambda c: (abs(c - target), c))[:k])


def accumulation_steps(global_batch_size: int, micro_batch_size: int, world_size: int) -> int:
    """Micro-batches each rank runs per optimizer step so that the job as a whole
    consumes ``global_batch_size`` samples per step.

    Raises:
        ValueError: the numbers do not divide (``global_batch_size`` must be a
            multiple of ``micro_batch_size * world_size``); the message lists the
            nearest settings that do.
    """
    _check_positive(
        global_batch_size=global_batch_size, micro_batch_size=micro_batch_size, world_size=world_size
    )
    per_step = micro_batch_size * world_size
    if global_batch_size % per_step == 0:
        return global_batch_size // per_step

    hints: list[str] = []
    below = (global_batch_size // per_step) * per_step
    gbs = [g for g in (below, below + per_step) if g > 0]
    hints.append(
        "global_batch_size "
        + " or ".join(f"{g} (accumulation {g // per_step})" for g in gbs)
        + f" with micro_batch_size {micro_batch_size} on {world_size} ranks"
    )
    if global_batch_size % world_size == 0:
        mbs = _nearest(_divisors(global_batch_size // world_size), micro_batch_size)
        hints.append(
            "micro_batch_size "
            + " or ".join(f"{m} (accumulation {global_batch_size // (m * world_size)})" for m in mbs)
            + f" on {world_size} ranks"
        )
    if global_batch_size % micro_batch_size == 0:
        ws = _nearest(_divisors(global_batch_size // micro_batch_size), world_size)
        hints.append(
            "world_size "
            + " or ".join(f"{w} (accumulation {global_batch_size // (micro_batch_size * w)})" for w in ws)
            + f" with micro_batch_size {micro_batch_size}"
        )
    raise UsageError(
        f"global_batch_size {global_batch_size} is not divisible by micro_batch_size {micro_batch_size} "
        f"x world_size {world_size} = {per_step}, so the ranks cannot all run the same whole number of "
        f"micro-batches per step. Nearest valid settings: {'; '.join(hints)}."
    )


def epoch_order(dataset_len: int, epoch: int, *, seed: int, shuffle: bool) -> torch.Tensor:
    """The order in which epoch ``epoch`` visits the dataset: a permutation drawn
    from ``seed + epoch`` (as ``DistributedSampler`` does), or ``arange`` without
    shuffling. The same on every rank and every world size."""
    if not shuffle:
        return torch.arange(dataset_len, dtype=torch.int64)
    g = torch.Generator()
    g.manual_seed(seed + epoch)
    return torch.randperm(dataset_len, generator=g, dtype=torch.int64)


def advance(dataset_len: int, epoch: int, offset: int, size: int, *, drop_last: bool) -> tuple[int, int]:
    """The position ``(epoch, offset)`` after one global batch of ``size`` samples
    taken at ``(epoch, offset)``.

    With ``drop_last`` a new epoch starts when fewer than ``size`` samples are left
    in the current one (the tail is skipped); without it, epochs form one
    continuous stream and a batch may run on into the next epoch."""
    offset += size
    if drop_last:
        if offset + size > dataset_len:
            return epoch + 1, 0
        return epoch, offset
    epoch += offset // dataset_len
    return epoch, offset % dataset_len


def global_batch(
    dataset_len: int,
    epoch: int,
    offset: int,
    size: int,
    *,
    seed: int,
    shuffle: bool,
    order: Callable[[int], torch.Tensor] | None = None,
) -> torch.Tensor:
    """The ``size`` sample indices of the global batch that starts at ``offset`` in
    epoch ``epoch``, continuing into the following epochs' orders if it runs past
    the end of this one. ``order(epoch)`` may supply (cached) epoch orders; it must
    return what :func:`epoch_order` returns."""
    if order is None:
        def order(e: int) -> torch.Tensor:
            return epoch_order(dataset_len, e, seed=seed, shuffle=shuffle)

    parts = []
    need = size
    while need > 0:
        part = order(epoch)[offset : offset + need]
        parts.append(part)
        need -= part.numel()
        epoch, offset = epoch + 1, 0
    return parts[0] if len(parts) == 1 else torch.cat(parts)
