"""How many requests a load makes of an object store, counted by the proxy in front
of the loopback S3 server: a request costs a round trip (and, on a server such as
moto, a read of the whole object), so a large tensor is one ranged GET (the S3
layer splits only a range larger than a part into concurrent GETs), and small
tensors next to each other in the data file are fetched together."""

from __future__ import annotations

import pytest
import torch

import shardpoint
from shardpoint.storage.fsspec import FsspecStorage
from tests.s3proxy import FaultProxy

pytestmark = [pytest.mark.s3, pytest.mark.timeout(300)]


def _state(fill: float) -> dict[str, torch.Tensor]:
    out = {"big": torch.full((6 << 20,), fill)}  # 24 MiB: more than a local piece (4 MiB), less than a part (64 MiB)
    out.update({f"small{i:02d}": torch.full((3 << 18,), fill + i) for i in range(40)})  # 3 MiB each, 120 MiB in all
    return out


def test_a_load_asks_for_each_large_range_once_and_small_neighbours_together(
    fault_proxy: FaultProxy, s3_bucket: str
) -> None:
    st = FsspecStorage(f"s3://{s3_bucket}/requests", storage_options=fault_proxy.storage_options)
    saved = _state(1.0)
    shardpoint.save(saved, st)
    target = _state(0.0)
    fault_proxy.arm(None, methods=["GET"])  # count only
    try:
        report = shardpoint.load(target, st)
        gets = [path for method, path in fault_proxy.requests if method == "GET" and path.split("?")[0].endswith(".safetensors")]
    finally:
        fault_proxy.disarm()
    assert sorted(report.loaded) == sorted(saved)
    for k, v in saved.items():
        assert torch.equal(target[k], v), k
    # the big tensor: one GET (not six 4 MiB pieces); the 40 small ones, adjacent in the
    # file: 120 MiB in batches of at most 64 MiB, 2 GETs (not 40)
    assert len(gets) == 3, gets
