"""One rank of the two-host test, started by torchrun inside a network namespace.

    python -m tests.distributed._two_hosts_worker save|load OUT_DIR DIR_URL S3_URL ENDPOINT

``save`` writes the same state to a shared directory and to S3; ``load`` reads both
into zeroed targets of another world size and writes, per rank, whether every
tensor came back byte for byte (a JSON file in OUT_DIR).
"""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

import shardpoint
from tests.s3server import KEY, REGION, SECRET

SHAPE = (37, 24)  # uneven rows on 4 and on 3 ranks


def expected(name: str) -> torch.Tensor:
    g = torch.Generator().manual_seed({"rows": 1, "cols": 2, "rep": 3}[name])
    return torch.randn((5, 3) if name == "rep" else SHAPE, generator=g)


def state(world: int, zeros: bool) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    full = {k: torch.zeros_like(expected(k)) if zeros else expected(k) for k in ("rows", "cols", "rep")}
    return {
        "rows": distribute_tensor(full["rows"], mesh, [Shard(0)]),
        "cols": distribute_tensor(full["cols"], mesh, [Shard(1)]),
        "rep": distribute_tensor(full["rep"], mesh, [Replicate()]),
        "host": shardpoint.PerRank(os.environ.get("SHARDPOINT_TEST_HOST", "?")),
    }


def main() -> None:
    mode, out, dir_url, s3_url, endpoint = sys.argv[1:6]
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    options = {"key": KEY, "secret": SECRET, "client_kwargs": {"endpoint_url": endpoint, "region_name": REGION}}
    result: dict[str, Any] = {"rank": rank, "world": world, "host": os.environ.get("SHARDPOINT_TEST_HOST")}
    if mode == "save":
        shardpoint.save(state(world, zeros=False), dir_url, timeout=120)
        shardpoint.save(state(world, zeros=False), s3_url, storage_options=options, timeout=120)
    else:
        for where, url, opts in (("dir", dir_url, None), ("s3", s3_url, options)):
            target = state(world, zeros=True)
            report = shardpoint.load(target, url, storage_options=opts, timeout=120)
            exact = {}
            for k in ("rows", "cols", "rep"):
                local = target[k].to_local()
                want = expected(k)
                for dim, (size, off) in enumerate(_local_box(target[k])):
                    want = want.narrow(dim, off, size)
                exact[k] = torch.equal(local.view(torch.uint8), want.contiguous().view(torch.uint8))
            result[where] = {"exact": exact, "saved_world": report.world_size, "host_of_rank": target["host"].value}
    with open(os.path.join(out, f"{mode}-{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


def _local_box(t: Any) -> list[tuple[int, int]]:
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    return list(zip(shape, offset))


if __name__ == "__main__":
    main()
