"""Incremental checkpoints on S3 (the loopback server): references resolve across
step prefixes, retention keeps the referenced object and deletes the rest, and
export makes a self-contained copy."""

from __future__ import annotations

import pytest
import torch

import shardpoint
from shardpoint.verify import verify
from tests.s3server import S3Server

pytestmark = [pytest.mark.s3, pytest.mark.timeout(120)]


def test_incremental_on_s3(s3_endpoint: S3Server, s3_bucket: str) -> None:
    root, opts = f"s3://{s3_bucket}/inc", s3_endpoint.storage_options
    frozen, head = torch.randn(64, 1024), torch.zeros(16)
    mgr = shardpoint.CheckpointManager(root, keep_last=1, incremental=True, storage_options=opts)
    for step in range(3):
        head.fill_(step)
        mgr.save({"frozen": frozen, "head": head}, step)
    info = mgr.latest()
    assert info is not None and info.step == 2 and info.referenced == frozen.numel() * 4
    got = shardpoint.load_full(info.path, storage_options=opts)
    assert torch.equal(got["frozen"], frozen) and torch.equal(got["head"], head)
    assert verify(info.path, storage_options=opts).ok
    # step 0 is no checkpoint any more, but its data file (which step 2 reads) is still there; step 1 is gone
    keys = s3_endpoint.keys(s3_bucket)
    assert [k for k in keys if k.startswith("inc/step-00000000/")] == [
        k for k in keys if k.startswith("inc/step-00000000/") and k.endswith(".safetensors")] != []
    assert not [k for k in keys if k.startswith("inc/step-00000001/")]
    out = mgr.export(f"s3://{s3_bucket}/archive")
    assert shardpoint.metadata(out, storage_options=opts).referenced == 0
    assert torch.equal(shardpoint.load_full(out, storage_options=opts)["frozen"], frozen)
