"""Throughput against the client's floor on the loopback S3 server (issue 24, item 6).

One run, one process, the same bytes every way:

- shardpoint: ``save`` of a state of several float32 tensors to ``s3://`` and
  ``load`` of it back into the same tensors (checksums verified);
- the client library directly, the best it does here: boto3 with one connection
  (one ``PutObject`` / ``GetObject`` per tensor), boto3 with a thread pool
  (multipart uploads and ranged GETs in parallel), and s3fs's own
  ``pipe``/``cat`` (its multipart and concurrent ranged reads);
- the server: the loopback moto server is the bottleneck of all of them (a Python
  process on the same 2 cores), so its raw figures are the floor that matters.

Prints a table of seconds, MB/s and the ratio of shardpoint to the best client
figure, both ways. Timings are best of ``--repeat`` (the machine is shared).

    python benchmarks/s3_bench.py --mb 256 --tensors 8 --repeat 3
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import struct
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

MB = 1_000_000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mb", type=int, default=256, help="state size in MB (default 256)")
    ap.add_argument("--tensors", type=int, default=8, help="number of tensors (default 8)")
    ap.add_argument("--repeat", type=int, default=3, help="best of this many runs (default 3)")
    ap.add_argument("--threads", type=int, default=8, help="threads of the parallel boto3 floor (default 8)")
    ap.add_argument("--part-mb", type=int, default=16, help="part/range size of the parallel floor, MiB (default 16)")
    args = ap.parse_args()

    import boto3
    import torch
    from tests.s3server import s3_server

    import shardpoint
    from shardpoint.storage.fsspec import BLOCK_SIZE, CONCURRENCY

    n = args.tensors
    numel = args.mb * MB // 4 // n
    state = {f"t{i}": torch.randn(numel, generator=torch.Generator().manual_seed(i)) for i in range(n)}
    blobs = [t.numpy().tobytes() for t in state.values()]
    total = sum(len(b) for b in blobs)
    part = args.part_mb << 20

    with s3_server() as s3:
        bucket = s3.new_bucket("bench")
        client = s3.client()
        opts = s3.storage_options
        rows: list[tuple[str, str, str, float]] = []  # (what, layout, way, seconds)
        per, same = "a tensor per object", "shardpoint's objects"
        todo: list[tuple[str, str, str, Callable[[int], Any]]] = []

        def add(what: str, layout: str, way: str, fn: Callable[[int], Any]) -> None:
            """Queue a measurement; :func:`run_all` runs every queued one once per round,
            so a busy spell of the shared machine hits all rows alike, not one."""
            todo.append((what, layout, way, fn))

        def run_all() -> None:
            times: dict[int, list[float]] = {}
            for r in range(args.repeat):
                for j, (what, _, way, fn) in enumerate(todo):
                    t = time.perf_counter()
                    fn(r)
                    times.setdefault(j, []).append(time.perf_counter() - t)
                    print(f"  round {r}: {way} {what}: {times[j][-1]:.2f}s", flush=True)
            rows.extend((what, lay, way, min(times[j])) for j, (what, lay, way, _) in enumerate(todo))
            todo.clear()

        # -- shardpoint ------------------------------------------------------------------------
        def save(r: int) -> None:
            shardpoint.save(state, f"s3://{bucket}/sp/{r}", storage_options=opts)

        target = {k: torch.zeros_like(v) for k, v in state.items()}

        def load(r: int) -> None:
            shardpoint.load(target, f"s3://{bucket}/sp/0", storage_options=opts)

        # warm up: the first storage creates its client session (and imports s3fs) once per process
        shardpoint.save({"w": torch.zeros(4)}, f"s3://{bucket}/warm", storage_options=opts)
        shardpoint.load_full(f"s3://{bucket}/warm", storage_options=opts)
        save(0)  # the objects the loads read (every save below writes a new prefix)
        add("shardpoint save / load", same, "save", lambda r: save(r + 1))
        add("shardpoint save / load", same, "load", load)
        data_key = next(k for k in s3.keys(bucket, "sp/0/") if k.endswith(".safetensors"))
        size = client.head_object(Bucket=bucket, Key=data_key)["ContentLength"]
        head = client.get_object(Bucket=bucket, Key=data_key, Range="bytes=0-7")["Body"].read()
        hlen = struct.unpack("<Q", head)[0]
        header = json.loads(client.get_object(Bucket=bucket, Key=data_key, Range=f"bytes=8-{7 + hlen}")["Body"].read())
        ranges = [(8 + hlen + v["data_offsets"][0], 8 + hlen + v["data_offsets"][1])
                  for k, v in header.items() if k != "__metadata__"]

        # -- the server with no SDK: plain HTTP, unsigned PUT, a dummy signature on GET (moto
        # does not check signatures) ------------------------------------------------------------
        host, port = s3.endpoint_url.split("//")[1].split(":")
        auth = {"Authorization": "AWS4-HMAC-SHA256 Credential=shardpoint-test/20260101/us-east-1/s3/aws4_request, "
                                 "SignedHeaders=host, Signature=00"}

        def raw(method: str, key: str, body: bytes | None = None) -> int:
            conn = http.client.HTTPConnection(host, int(port), timeout=600)
            conn.request(method, f"/{bucket}/{key}", body=body, headers=auth)
            resp = conn.getresponse()
            got = len(resp.read())
            conn.close()
            assert resp.status == 200, resp.status
            return got

        for i, b in enumerate(blobs):  # what the loads below read
            raw("PUT", f"raw/0/{i}", b)
            raw("PUT", f"rawp/0/{i}", b)
            client.put_object(Bucket=bucket, Key=f"single/0/{i}", Body=b)
            client.put_object(Bucket=bucket, Key=f"par/0/{i}", Body=b)
            client.put_object(Bucket=bucket, Key=f"s3fs/0/{i}", Body=b)
        add("raw HTTP, 1 connection", per, "save", lambda r: [raw("PUT", f"raw/{r + 1}/{i}", b) for i, b in enumerate(blobs)])
        add("raw HTTP, 1 connection", per, "load", lambda r: [raw("GET", f"raw/0/{i}") for i in range(n)])

        def raw_parallel(method: str, prefix: str) -> None:
            with ThreadPoolExecutor(n) as ex:
                list(ex.map(lambda i: raw(method, f"{prefix}/{i}", blobs[i] if method == "PUT" else None), range(n)))

        add(f"raw HTTP, {n} connections", per, "save", lambda r: raw_parallel("PUT", f"rawp/{r + 1}"))
        add(f"raw HTTP, {n} connections", per, "load", lambda r: raw_parallel("GET", "rawp/0"))

        # -- boto3, one connection ---------------------------------------------------------------
        def put_single(r: int) -> None:
            for i, b in enumerate(blobs):
                client.put_object(Bucket=bucket, Key=f"single/{r + 1}/{i}", Body=b)

        def get_single(r: int) -> None:
            for i in range(n):
                client.get_object(Bucket=bucket, Key=f"single/0/{i}")["Body"].read()

        add("boto3 PutObject / GetObject, 1 connection", per, "save", put_single)
        add("boto3 PutObject / GetObject, 1 connection", per, "load", get_single)

        # -- boto3, a thread pool ------------------------------------------------------------------
        from botocore.config import Config

        pooled = boto3.client(
            "s3", endpoint_url=s3.endpoint_url, region_name="us-east-1", aws_access_key_id=opts["key"],
            aws_secret_access_key=opts["secret"], config=Config(max_pool_connections=2 * args.threads),
        )

        def multipart(key: str, b: memoryview, psize: int, threads: int) -> None:
            up = pooled.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]

            def part_of(j: int) -> dict[str, Any]:
                body = bytes(b[j * psize : (j + 1) * psize])
                e = pooled.upload_part(Bucket=bucket, Key=key, UploadId=up, PartNumber=j + 1, Body=body)["ETag"]
                return {"PartNumber": j + 1, "ETag": e}

            with ThreadPoolExecutor(threads) as ex:
                parts = list(ex.map(part_of, range(-(-len(b) // psize))))
            pooled.complete_multipart_upload(Bucket=bucket, Key=key, UploadId=up, MultipartUpload={"Parts": parts})

        def put_objects_parallel(r: int) -> None:
            with ThreadPoolExecutor(args.threads) as ex:
                list(ex.map(lambda i: pooled.put_object(Bucket=bucket, Key=f"par/{r + 1}/{i}", Body=blobs[i]), range(n)))

        def get_objects_parallel(r: int) -> None:
            with ThreadPoolExecutor(args.threads) as ex:
                got = ex.map(lambda i: len(pooled.get_object(Bucket=bucket, Key=f"par/0/{i}")["Body"].read()), range(n))
                assert sum(got) == total

        what = f"boto3 PutObject / GetObject, {args.threads} threads"
        add(what, per, "save", put_objects_parallel)
        add(what, per, "load", get_objects_parallel)

        def get_ranges_parallel(r: int) -> None:
            def rng(job: tuple[int, int]) -> int:
                i, j = job
                end = min((j + 1) * part, len(blobs[i])) - 1
                return len(pooled.get_object(Bucket=bucket, Key=f"par/0/{i}", Range=f"bytes={j * part}-{end}")["Body"].read())

            jobs = [(i, j) for i in range(n) for j in range(-(-len(blobs[i]) // part))]
            with ThreadPoolExecutor(args.threads) as ex:
                assert sum(ex.map(rng, jobs)) == total

        what = f"boto3 multipart / ranged GETs of {args.part_mb} MiB, {args.threads} threads"
        def multipart_each(r: int) -> None:
            for i, b in enumerate(blobs):
                multipart(f"mp/{r}/{i}", memoryview(b), part, args.threads)

        add(what, per, "save", multipart_each)
        add(what, per, "load", get_ranges_parallel)

        # -- boto3 on shardpoint's layout: one object of all the bytes, the same part size and
        # parts in flight as shardpoint; the same ranged GETs shardpoint makes (one per tensor) ----
        whole = memoryview(b"".join(blobs))

        def same_ranges(r: int) -> None:
            with ThreadPoolExecutor(4) as ex:  # the core's SHARDPOINT_IO_THREADS
                got = ex.map(lambda ab: len(pooled.get_object(Bucket=bucket, Key=data_key,
                                                              Range=f"bytes={ab[0]}-{ab[1] - 1}")["Body"].read()), ranges)
                assert sum(got) == total

        what = f"boto3 one object: multipart {BLOCK_SIZE >> 20} MiB x {CONCURRENCY} / a GET per tensor x 4"
        def one_object(r: int) -> None:
            multipart(f"one/{r}", whole, BLOCK_SIZE, CONCURRENCY)

        add(what, same, "save", one_object)
        add(what, same, "load", same_ranges)
        add("boto3 one object: one GetObject of the whole data file", same, "load",
            lambda r: client.get_object(Bucket=bucket, Key=data_key)["Body"].read())

        # -- s3fs on its own ---------------------------------------------------------------
        import s3fs

        fs = s3fs.S3FileSystem(key=opts["key"], secret=opts["secret"], client_kwargs=opts["client_kwargs"],
                               skip_instance_cache=True)

        def pipe(r: int) -> None:
            fs.pipe({f"{bucket}/s3fs/{r + 1}/{i}": b for i, b in enumerate(blobs)})

        def cat(r: int) -> None:
            got = fs.cat([f"{bucket}/s3fs/0/{i}" for i in range(n)])
            assert sum(len(v) for v in got.values()) == total

        add("s3fs pipe / cat (its own concurrency)", per, "save", pipe)
        add("s3fs pipe / cat (its own concurrency)", per, "load", cat)
        run_all()
        shardpoint.load(target, f"s3://{bucket}/sp/0", storage_options=opts)
        assert all(torch.equal(target[k], state[k]) for k in state)

    print(f"\n{total / MB:.0f} MB in {n} float32 tensors (shardpoint's data file: {size / MB:.0f} MB), loopback moto "
          f"S3 server, best of {args.repeat}; shardpoint part size {BLOCK_SIZE >> 20} MiB, {CONCURRENCY} parts / "
          "ranges in flight\n")
    sp = {w: t for name, _, w, t in rows if name.startswith("shardpoint") for _ in [0]}
    best = {(w, lay): min(t for name, ll, ww, t in rows if ww == w and ll == lay and not name.startswith("shardpoint"))
            for w in ("save", "load") for lay in (per, same)}
    print(f"| {'what':<72} | layout               | way  | seconds |   MB/s | shardpoint / this |")
    print(f"|{'-' * 74}|----------------------|------|---------|--------|-------------------|")
    for name, lay, w, t in sorted(rows, key=lambda r: (r[2] == "load", r[0].startswith("shardpoint"), r[1], r[3])):
        ratio = "" if name.startswith("shardpoint") else f"{t / sp[w]:.2f}"
        print(f"| {name:<72} | {lay:<20} | {w} | {t:7.2f} | {total / MB / t:6.0f} | {ratio:>17} |")
    for w in ("save", "load"):
        print(f"\nshardpoint {w}: {best[(w, per)] / sp[w]:.2f}x the best client figure on any layout, "
              f"{best[(w, same)] / sp[w]:.2f}x the client on its own layout")


if __name__ == "__main__":
    main()
