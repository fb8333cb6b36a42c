"""The model every job in compare.py builds: the same shapes and the same initial
values for FSDP2 and DeepSpeed, sized so that fp32 parameters plus AdamW's two
moments come to about ``size_mb`` (10^6 bytes).

The hidden width is odd (3d + 5), so its tensors shard unevenly over 4 and 2 ranks.
"""

from __future__ import annotations

import torch
from torch import nn

BYTES_PER_PARAM = 12  # fp32 parameter + exp_avg + exp_avg_sq


def dims(size_mb: int) -> tuple[int, int, int]:
    """(width d, hidden h, number of blocks) for about ``size_mb`` of state."""
    params = size_mb * 1_000_000 / BYTES_PER_PARAM
    d = 1024 if params >= 30e6 else 512 if params >= 4e6 else 256
    h = 3 * d + 5
    per_block = 2 * d * h + h + d + 2 * d
    return d, h, max(1, round(params / per_block))


class Block(nn.Module):
    def __init__(self, d: int, h: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, h)
        self.down = nn.Linear(h, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class Net(nn.Module):
    def __init__(self, d: int, h: int, n: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(d, h) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return x


def build(size_mb: int, seed: int = 0) -> Net:
    d, h, n = dims(size_mb)
    torch.manual_seed(seed)
    return Net(d, h, n)


def batch(size_mb: int, rank: int, rows: int = 8) -> torch.Tensor:
    d, _, _ = dims(size_mb)
    g = torch.Generator().manual_seed(1000 + rank)
    return torch.randn(rows, d, generator=g)
