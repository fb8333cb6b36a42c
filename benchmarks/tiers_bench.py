"""The memory tier against the durable tier, in one run, one process (issue 23).

1. The training process's stall for a memory snapshot vs a blocking durable save of
   the same state (goal: <= 0.2x).
2. A training step's time while a drain runs in a helper process, in a thread, and
   with no drain (the step is a loop of small torch ops: Python-bound, as the
   per-step overhead of a real training loop is).
3. Restore time from memory vs from local disk (the disk's files were just written:
   they are read from the page cache, so this is a floor for the disk) vs from the
   loopback S3 server of the tests (moto, a Python process on the same cores).
4. ``--hosts``: two "hosts" on this machine (two processes, each in a UTS namespace
   of its own with its own host name, needs root; gloo over loopback), one rank
   each: the snapshot's stall with ``replicas=1`` (replication in the background)
   vs ``replicas=0``, how long the write, commit and replication run after the stall, and the bytes
   each rank received per snapshot (= its peer's state x replicas).

    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/tiers_bench.py --size-mb 256

Prints a markdown table of medians and ratios; nothing gates on a time."""

from __future__ import annotations

import argparse
import ctypes
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable

import torch

from shardpoint import CheckpointManager
from shardpoint.tiers import MemoryTier
from shardpoint.tiers.drain import Drainer, DrainJob


def timed(fn: Callable[[], object], repeat: int, after: Callable[[], object] | None = None,
          tails: list[float] | None = None) -> float:
    """Median time of ``fn``; ``after`` runs untimed after each call (its times go to
    ``tails``): the rest of the work a call left running in the background, which a
    training step would overlap."""
    out = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
        if after is not None:
            t = time.perf_counter()
            after()
            if tails is not None:
                tails.append(time.perf_counter() - t)
    return statistics.median(out)


def step_fn(x: torch.Tensor) -> Callable[[], None]:
    def step() -> None:
        y = x
        for _ in range(200):
            y = torch.tanh(y * 1.0001 + 0.001)
    return step


def steps_during(drainer: Drainer | None, job: DrainJob | None, step: Callable[[], None], n_min: int) -> tuple[float, int]:
    """Mean step time while ``job`` drains (or over ``n_min`` steps with no drain)."""
    if drainer is not None and job is not None:
        drainer.start(job)
    times = []
    while True:
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
        if drainer is None:
            if len(times) >= n_min:
                break
        elif drainer.poll() is not None:
            break
    return statistics.mean(times), len(times)


def _host_rank(rank: int, port: int, shm: str, work: str, size_mb: int, repeat: int, out: object) -> None:
    """One "host" of section 4: its own host name (a UTS namespace), one gloo rank."""
    import torch.distributed as dist

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(0x04000000) != 0:  # CLONE_NEWUTS
        out.put((rank, "unavailable", f"unshare(CLONE_NEWUTS): errno {ctypes.get_errno()} (needs root)"))  # type: ignore[attr-defined]
        return
    socket.sethostname(f"bench-host-{rank}")
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      GLOO_SOCKET_IFNAME="lo")
    dist.init_process_group("gloo")
    try:
        out.put((rank, "ok", _replicate_rows(rank, shm, work, size_mb, repeat)))  # type: ignore[attr-defined]
    except BaseException as e:
        out.put((rank, "unavailable", f"rank {rank} failed: {type(e).__name__}: {e}"))  # type: ignore[attr-defined]
        raise
    finally:
        dist.destroy_process_group()


def _replicate_rows(rank: int, shm: str, work: str, size_mb: int, repeat: int) -> dict[int, tuple[float, float, int]]:
    import torch.distributed as dist

    from shardpoint.runtime import PROCESS

    n = size_mb * (1 << 20) // 4 // 8
    state = {f"rank{rank}/layer{i}": torch.randn(n) for i in range(8)}  # each rank's own keys: its own file
    res = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for replicas in (0, 1):
            tier = MemoryTier(every=1, durable_every=10**9, keep=2, replicas=replicas,
                              path=os.path.join(shm, socket.gethostname()))
            mgr = CheckpointManager(os.path.join(work, f"r{replicas}"), memory=tier)
            stalls, tails, got = [], [], []
            for i in range(repeat + 1):
                dist.barrier()
                before = PROCESS.seams.traffic.received
                t = time.perf_counter()
                mgr.save(state, i + 1)
                stall = time.perf_counter() - t
                mgr.wait()  # the snapshot's write and commit, then its replication (in the background)
                tail = time.perf_counter() - t - stall
                if i:  # the first one sets up the job folder and the side lane
                    stalls.append(stall)
                    tails.append(tail)
                    got.append(PROCESS.seams.traffic.received - before)
            res[replicas] = (statistics.median(stalls), statistics.median(tails), int(statistics.median(got)))
            mgr.wait()
    return res


def host_rows(size_mb: int, repeat: int) -> list[tuple[str, float, str]]:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    work = tempfile.mkdtemp(prefix="tiers-bench-hosts-")
    shm = tempfile.mkdtemp(dir="/dev/shm", prefix="tiers-bench-hosts-")
    procs = [ctx.Process(target=_host_rank, args=(r, port, shm, work, size_mb, repeat, q)) for r in range(2)]
    try:
        for p in procs:
            p.start()
        got = [q.get(timeout=900) for _ in procs]
    finally:
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    bad = [g for g in got if g[1] != "ok"]
    if bad:
        print(f"section 4 skipped: {bad[0][2]}")
        return []
    res = dict((g[0], g[2]) for g in got)[0]
    (s0, _, b0), (s1, tail1, b1) = res[0], res[1]
    state = size_mb * (1 << 20)
    return [("2 hosts: snapshot stall, replicas=0", s0, "1x"),
            ("2 hosts: snapshot stall, replicas=1", s1, f"{s1 / s0:.2f}x of replicas=0 (replication in the background)"),
            ("2 hosts: write, commit, replication after the stall", tail1, f"{state / max(tail1, 1e-9) / 1e9:.2f} GB/s over loopback"),
            ("2 hosts: bytes received per snapshot, replicas=1", float(b1),
             f"{b1 / state:.3f}x the peer's state (replicas=0: {b0} bytes of collectives)")]


def s3_restore(state: dict[str, torch.Tensor], target: dict[str, torch.Tensor], repeat: int) -> float | None:
    """Median restore time of the same state from a durable root on the loopback S3
    server of the tests (moto); None when it cannot be started here."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    from tests.s3server import S3ServerUnavailable, s3_server

    try:
        with s3_server() as s3:
            root = f"s3://{s3.new_bucket('tiers')}/root"
            CheckpointManager(root, storage_options=s3.storage_options).save(state, 10**6)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                t = timed(lambda: CheckpointManager(root, storage_options=s3.storage_options).restore(target), repeat)
            assert all(torch.equal(target[k], v) for k, v in state.items())
            return t
    except S3ServerUnavailable as e:
        print(f"(no S3 row: {e})", file=sys.stderr)
        return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mb", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", default=None, help="durable root's parent (default: a temporary folder on disk)")
    ap.add_argument("--hosts", action="store_true", help="also section 4: replication between two hosts (needs root)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    n = args.size_mb * (1 << 20) // 4 // 8
    state = {f"layer{i}": torch.randn(n) for i in range(8)}
    work = tempfile.mkdtemp(dir=args.dir, prefix="tiers-bench-")
    shm = tempfile.mkdtemp(dir="/dev/shm", prefix="tiers-bench-")
    rows: list[tuple[str, float, str]] = []
    try:
        # 1. stall
        tier = MemoryTier(every=1, durable_every=10**9, keep=2, path=shm, drain="process")
        mem = CheckpointManager(os.path.join(work, "tiered"), memory=tier)
        dur = CheckpointManager(os.path.join(work, "direct"), keep_last=1)
        step_no = iter(range(1, 10**6))
        mem_tails: list[float] = []
        t_mem = timed(lambda: mem.save(state, next(step_no)), args.repeat, after=mem.wait, tails=mem_tails)
        t_dur = timed(lambda: dur.save(state, next(step_no)), args.repeat)
        rows += [("stall: memory snapshot", t_mem, f"{t_mem / t_dur:.3f}x of durable (goal <= 0.2x)"),
                 ("snapshot's write and commit after the stall", statistics.median(mem_tails),
                  "in the background: a step at least this long hides it"),
                 ("stall: blocking durable save", t_dur, "1x")]
        # 2. a training step beside a drain
        area = mem._tiers.area  # type: ignore[union-attr]
        snap = area.complete()[-1]
        step = step_fn(torch.randn(256))
        base, _ = steps_during(None, None, step, 200)
        rows.append(("train step, no drain", base, "1x"))
        for mode in ("process", "thread"):
            drainer = Drainer(mode)
            if mode == "process":  # start the helper before measuring (a manager keeps it for the job)
                drainer._helper()
                time.sleep(3)
            per, count = [], 0
            for r in range(args.repeat):
                job = DrainJob(step=snap.step, src=snap.path, root=os.path.join(work, f"drain-{mode}-{r}"),
                               folder="step-00000001", pointer=b"x")
                t, k = steps_during(drainer, job, step, 0)
                per.append(t)
                count += k
            drainer.close()
            t = statistics.median(per)
            rows.append((f"train step, drain in a {mode}", t, f"{t / base:.2f}x of no drain ({count} steps)"))
        # 3. restore
        mem.save(state, 10**6)  # the newest: a memory snapshot
        dur.save(state, 10**6)
        target = {k: torch.empty_like(v) for k, v in state.items()}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            t_rm = timed(lambda: CheckpointManager(os.path.join(work, "tiered"), memory=tier).restore(target), args.repeat)
            t_rd = timed(lambda: CheckpointManager(os.path.join(work, "direct")).restore(target), args.repeat)
        assert all(torch.equal(target[k], v) for k, v in state.items())
        rows += [("restore from memory", t_rm, f"{t_rm / t_rd:.2f}x of disk"),
                 ("restore from local disk (page cache)", t_rd, "1x")]
        t_rs = s3_restore(state, target, args.repeat)
        if t_rs is not None:
            rows.append(("restore from the loopback S3 server (moto)", t_rs, f"{t_rs / t_rd:.2f}x of disk"))
        mem._tiers.close()  # type: ignore[union-attr]
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    if args.hosts:
        rows += host_rows(args.size_mb, args.repeat)
    print(f"\nstate: {args.size_mb} MB (8 fp32 tensors) per rank, medians of {args.repeat}; one process "
          "(section 4: two)\n")
    print("| what | seconds | ratio |\n|---|---:|---|")
    for name, t, ratio in rows:
        print(f"| {name} | {t:.0f} | {ratio} |" if name.startswith("2 hosts: bytes") else f"| {name} | {t:.4f} | {ratio} |")


if __name__ == "__main__":
    main()
