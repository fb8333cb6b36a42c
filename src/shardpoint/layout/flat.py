"""Flat partitions (ZeRO): a rank holds a range of a tensor's row-major elements."""

from __future__ import annotations

import torch

from ..errors import UsageError


class FlatShard:
    """A contiguous range of the row-major flattening of a global tensor.

    Args:
        local: 1-D tensor holding elements ``[start, start + local.numel())``. Loads
            copy into it in place, so it may be a view into a larger flat buffer
            (DeepSpeed's ZeRO partitions).
        shape: the global tensor's shape.
        start: index of ``local[0]`` in the flattened global tensor.
    """

    __slots__ = ("local", "shape", "start")

    def __init__(self, local: torch.Tensor, shape: tuple[int, ...] | torch.Size, start: int) -> None:
        if local.dim() != 1:
            raise UsageError(f"FlatShard needs a 1-D local tensor, got shape {tuple(local.shape)}")
        numel = 1
        for s in shape:
            numel *= int(s)
        if start < 0 or start + local.numel() > numel:
            raise UsageError(f"FlatShard range [{start}, {start + local.numel()}) lies outside a tensor of {numel} elements")
        self.local = local
        self.shape = tuple(int(s) for s in shape)
        self.start = int(start)

    def __repr__(self) -> str:
        return f"FlatShard(shape={self.shape}, start={self.start}, numel={self.local.numel()})"
