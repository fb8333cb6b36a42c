"""Faults between shardpoint and the object store: saves and loads on 2 real gloo
ranks through a fault-injecting proxy (tests/s3proxy.py) in front of the loopback
S3 server, with 500s, 503 SlowDowns, connections reset in the middle of an
answer, requests stalled past the client's timeout, and PUTs/POSTs applied whose
answers are lost, each at seeded random points.

Every save either commits with every byte right or fails on every rank with an
error naming an object, leaving no manifest; no multipart upload is ever left on
the server; every load returns the right bytes or fails on every rank naming an
object; nothing hangs. Most trials break one or two requests (the retries must
win); some break a long run of them (the save or load must fail cleanly).

``SHARDPOINT_S3_FAULT_TRIALS`` sets the trials per fault kind and phase (default
3; the acceptance run uses 20). ``SHARDPOINT_S3_FAULT_REPORT=path`` appends the
counts per kind and outcome to that file as JSON lines.
"""

from __future__ import annotations

import json
import os
import random
import time
from collections import Counter
from typing import Any

import pytest
import torch

import shardpoint
from tests._dist import run_ranks
from tests.s3proxy import KINDS, FaultProxy
from tests.s3server import S3Server

pytestmark = [pytest.mark.distributed, pytest.mark.s3, pytest.mark.timeout(900)]

TRIALS = int(os.environ.get("SHARDPOINT_S3_FAULT_TRIALS", "3"))
SEED = int(os.environ.get("SHARDPOINT_S3_FAULT_SEED", "24"))
ENV = {"SHARDPOINT_S3_BLOCK_SIZE": str(5 << 20)}  # S3's smallest part: 2 parts per rank's data file
RETRY = {"attempts": 4, "base_delay": 0.05, "max_delay": 0.4, "timeout": 2.0}
ROWS = (3 * 2**20 // 16 + 5, 16)  # 12 MiB of float32, uneven shards
BOUND = 120.0  # seconds one save or load may take, whatever is broken (a hang fails the test)
MUTATING = ("PUT", "POST", "DELETE")
#: share of trials that break a long run of requests instead of one or two
PERSISTENT = 0.25


def _global(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _state(rank: int, world: int, seed: int, zeros: bool) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    make = (lambda shape, s: torch.zeros(shape)) if zeros else _global
    return {
        "rows": distribute_tensor(make(ROWS, seed), mesh, [Shard(0)]),
        "rep": distribute_tensor(make((3, 5), seed + 1), mesh, [Replicate()]),
        "step": -1 if zeros else seed,
    }


def _save(rank: int, world: int, url: str, options: dict[str, Any], seed: int) -> float:
    t = time.monotonic()
    shardpoint.save(_state(rank, world, seed, zeros=False), url, storage_options=options)
    return time.monotonic() - t


def _load(rank: int, world: int, url: str, options: dict[str, Any], seed: int) -> dict[str, Any]:
    state = _state(rank, world, seed, zeros=True)
    shardpoint.load(state, url, storage_options=options)
    return {"rows": state["rows"].to_local().clone(), "rep": state["rep"].to_local().clone(), "step": state["step"]}


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def _expected(seed: int, rank: int, world: int) -> dict[str, bytes]:
    rows = _global(ROWS, seed)
    per = -(-ROWS[0] // world)
    return {"rows": _bytes(rows[rank * per : (rank + 1) * per]), "rep": _bytes(_global((3, 5), seed + 1))}


def _schedule(rng: random.Random, n: int) -> dict[str, Any]:
    """Where to break: one or two requests among the first ``n`` (the retries must
    win), or (persistent) one request and every retry of it (the operation must
    fail, or find that its lost answer had succeeded)."""
    first = rng.randrange(n)
    if rng.random() < PERSISTENT:
        return {"shape": "persistent", "at": [first], "repeat": RETRY["attempts"]}
    at = {first, *([first + rng.randrange(1, 4)] if rng.random() < 0.3 else [])}
    return {"shape": "transient", "at": sorted(at), "repeat": 1}


def _trials(rank: int, world: int, kind: str, proxy_url: str, direct: dict[str, Any], bucket: str,
            trials: int) -> list[dict[str, Any]]:
    """On each of 2 ranks: a clean save and load to count the requests, then
    ``trials`` saves and loads with faults at seeded random points (rank 0 arms the
    proxy before each). Returns one record per operation."""
    import boto3
    import torch.distributed as dist

    from shardpoint.errors import ShardpointError
    from tests.s3proxy import control

    opts = {"key": direct["key"], "secret": direct["secret"], "shardpoint_retry": RETRY,
            "client_kwargs": dict(direct["client_kwargs"], endpoint_url=proxy_url)}
    server = boto3.client("s3", aws_access_key_id=direct["key"], aws_secret_access_key=direct["secret"],
                          **direct["client_kwargs"])
    save_methods = list(MUTATING) if kind == "drop" else None  # a save's lost answers matter where it changed something
    rng = random.Random(f"{SEED}-{kind}")
    base = f"s3://{bucket}/base"

    def step(phase: str, url: str, seed: int, fault: dict[str, Any] | None, n: int = 0) -> dict[str, Any]:
        if rank == 0:
            if fault is None:
                control(proxy_url, "arm", kind=None, methods=save_methods if phase == "save" else None)
            else:
                control(proxy_url, "arm", kind=kind, at=fault["at"], repeat=fault["repeat"],
                        methods=save_methods if phase == "save" else None)
        dist.barrier()
        rec: dict[str, Any] = {"phase": phase, "url": url, "seed": seed, "ok": True, "wrong": False}
        t = time.monotonic()
        try:
            if phase == "save":
                shardpoint.save(_state(rank, world, seed, zeros=False), url, storage_options=opts)
            else:
                state = _state(rank, world, seed, zeros=True)
                shardpoint.load(state, url, storage_options=opts)
                want = _expected(seed, rank, world)
                rec["wrong"] = (_bytes(state["rows"].to_local()) != want["rows"]
                                or _bytes(state["rep"].to_local()) != want["rep"] or state["step"] != seed)
        except Exception as e:  # noqa: BLE001 - recorded, judged by the test
            rec.update(ok=False, error=f"{type(e).__name__}: {e}", shardpoint_error=isinstance(e, ShardpointError))
        rec["took"] = time.monotonic() - t
        dist.barrier()
        if rank == 0:
            st = control(proxy_url, "state")
            control(proxy_url, "arm", kind=None)
            rec.update(seen=st["seen"], faults=len(st["faults"]), fault=fault, n=n,
                       uploads=[u["Key"] for u in server.list_multipart_uploads(Bucket=bucket).get("Uploads", [])])
        return rec

    n_save = max(step("save", base, 7, None).get("seen", 0), 1)  # the counts are rank 0's
    n_load = max(step("load", base, 7, None).get("seen", 0), 1)
    out = []
    for trial in range(trials):
        fault = _schedule(rng, n_save) if rank == 0 else None
        out.append(step("save", f"s3://{bucket}/t{trial}", 1000 + trial, fault, n_save))
        fault = _schedule(rng, n_load) if rank == 0 else None
        out.append(step("load", base, 7, fault, n_load))
    return out


@pytest.mark.parametrize("kind", KINDS)
def test_faults_commit_right_or_fail_cleanly(
    kind: str, fault_proxy: FaultProxy, s3_endpoint: S3Server, s3_bucket: str
) -> None:
    proxy = fault_proxy
    direct = s3_endpoint.storage_options
    ranks = run_ranks(_trials, 2, kind, proxy.endpoint_url, direct, s3_bucket, TRIALS, env=ENV,
                      timeout=BOUND * (2 * TRIALS + 2))
    counts: Counter[str] = Counter()
    for i, (r0, r1) in enumerate(zip(ranks[0], ranks[1], strict=True)):
        what = f"{r0['phase']} {i // 2} ({kind}, faults {r0['fault']})"
        assert r0["faults"] > 0, f"{what}: no fault was injected ({r0['seen']} requests)"
        assert r0["ok"] == r1["ok"], f"{what}: one rank failed, the other did not: {r0.get('error')} / {r1.get('error')}"
        for r in (r0, r1):
            assert r["took"] < BOUND, f"{what}: took {r['took']:.0f}s"
            if not r["ok"]:
                assert r["shardpoint_error"], f"{what}: not a ShardpointError: {r['error']}"
                assert f"s3://{s3_bucket}/" in r["error"], f"{what}: the error names no object: {r['error']}"
            assert not r["wrong"], f"{what}: WRONG BYTES loaded"
        assert r0["uploads"] == [], f"{what}: multipart uploads left on the server: {r0['uploads']}"
        if r0["phase"] == "save":
            key = r0["url"].split("/", 3)[3] + "/manifest.json"
            if r0["ok"]:
                full = shardpoint.load_full(r0["url"], storage_options=direct)  # straight from the server, verified
                assert _bytes(full["rows"]) == _bytes(_global(ROWS, r0["seed"])), what
                assert _bytes(full["rep"]) == _bytes(_global((3, 5), r0["seed"] + 1)), what
                assert full["step"] == r0["seed"], what
            else:
                assert key not in s3_endpoint.keys(s3_bucket), f"{what}: failed, but committed"
        outcome = ("committed" if r0["phase"] == "save" else "loaded") if r0["ok"] else "failed cleanly"
        counts[f"{r0['phase']} {r0['fault']['shape']} {outcome}"] += 1
        counts[f"{r0['phase']} faults injected"] += r0["faults"]
    assert s3_endpoint.open_uploads(s3_bucket) == []
    report = {"kind": kind, "trials": TRIALS, "seed": SEED, **dict(sorted(counts.items()))}
    print(json.dumps(report))
    out = os.environ.get("SHARDPOINT_S3_FAULT_REPORT")
    if out:
        with open(out, "a") as f:
            f.write(json.dumps(report) + "\n")
