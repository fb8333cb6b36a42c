"""Worker side of compare.py for FSDP2 state: torch.save, DCP and shardpoint.

Run by compare.py as real processes (one per rank), never by hand:
    python benchmarks/compare_fsdp.py save <cfg.json>   # 4 ranks: clone, saves, loads on 4
    python benchmarks/compare_fsdp.py load <cfg.json>   # 2 ranks: loads 4 -> 2

Every rank writes ``<workdir>/<role>.rank<r>.json`` after each operation, so a
failure late in the job keeps the rows measured before it.
"""

from __future__ import annotations

import gc
import importlib.util
import inspect
import json
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from _common import PeakRss, drop_caches, median  # noqa: E402
from compare_model import batch, build  # noqa: E402
from torch.distributed.checkpoint.state_dict import (  # noqa: E402
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset  # noqa: E402

# --- the state ---------------------------------------------------------------------


def leaves(obj: Any, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from leaves(v, f"{prefix}/{k}")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from leaves(v, f"{prefix}/{i}")
    elif isinstance(obj, torch.Tensor):
        yield prefix, obj


def local_of(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def for_each_local(state: Any, fn: Callable[[torch.Tensor], Any]) -> None:
    for _, t in leaves(state):
        fn(local_of(t))


def state_bytes(state: Any) -> tuple[int, int]:
    """(bytes this rank holds, bytes of the global state with replicas once)."""
    local = sharded = replicated = 0
    for _, t in leaves(state):
        n = local_of(t).numel() * t.element_size()
        local += n
        if isinstance(t, DTensor):
            sharded += n
        else:
            replicated += n
    tot = torch.tensor([sharded], dtype=torch.int64)
    dist.all_reduce(tot)
    return local, int(tot.item()) + replicated


def fingerprint(state: Any) -> float:
    """A weighted sum over every element of the global state, weights depending on
    the key and the element's global position: equal on any number of ranks when
    the values are, and it changes when a shard lands in the wrong place."""
    acc = torch.zeros((), dtype=torch.float64)
    rank = dist.get_rank()
    for i, (key, t) in enumerate(sorted(leaves(state), key=lambda kv: kv[0])):
        if isinstance(t, DTensor):
            loc = t.to_local()
            _, off = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
            assert all(o == 0 for o in off[1:]), f"{key}: expected Shard(0)"
            inner = 1
            for s in t.shape[1:]:
                inner *= s
            start = off[0] * inner if len(off) else 0
        else:
            if rank != 0:
                continue
            loc, start = t, 0
        n = loc.numel()
        if n == 0:
            continue
        w = (torch.arange(start, start + n, dtype=torch.int64) % 1021 + 1).to(torch.float64)
        acc += (loc.detach().reshape(-1).to(torch.float64) * w).sum() * (i + 1)
    dist.all_reduce(acc)
    return float(acc.item())


def same(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-9 * max(abs(a), abs(b), 1.0)


def make_fsdp(size_mb: int, world: int, seed: int, step: bool) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    mesh = init_device_mesh("cpu", (world,))
    model = build(size_mb, seed)
    for b in model.blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if step:
        model(batch(size_mb, dist.get_rank())).pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model, opt


# --- measuring ---------------------------------------------------------------------


def trim_heap() -> None:
    """Give freed heap back to the OS, so that RSS growth is not hidden by reuse of
    memory an earlier operation freed."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass


class Recorder:
    """Times an operation on every rank (barrier first), with its RSS growth, and
    writes this rank's rows to JSON after each one."""

    def __init__(self, out: str) -> None:
        self.rank = dist.get_rank()
        self.out = out
        self.rows: dict[str, Any] = {}
        self.info: dict[str, Any] = {}

    def flush(self) -> None:
        tmp = self.out + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"rows": self.rows, "info": self.info}, f, indent=1)
        os.replace(tmp, self.out)

    def _prepare(self, drop: bool, flush: bool = True) -> None:
        if self.rank == 0:
            if drop:
                self.info["page_cache_dropped"] = drop_caches()
            elif flush:
                os.sync()  # the previous operation's writeback must not bleed into this one
        gc.collect()
        trim_heap()
        dist.barrier()

    def op(self, name: str, fn: Callable[[], Any], *, repeat: int = 1, drop: bool = False, flush: bool = True,
           ranks: tuple[int, ...] | None = None) -> Any:
        """``drop``: drop the page cache first (loads); ``flush=False``: do not sync
        the previous operation's dirty pages first (for an fsync measured after it)."""
        times, mems, out = [], [], None
        try:
            for _ in range(repeat):
                out = None
                self._prepare(drop, flush)
                if ranks is None or self.rank in ranks:
                    with PeakRss() as m:
                        t0 = time.perf_counter()
                        out = fn()
                        dt = time.perf_counter() - t0
                    times.append(dt)
                    mems.append(m.growth)
            if times:
                self.rows[name] = {"s": median(times), "runs_s": times, "mem": max(mems)}
        except Exception as e:
            # a failed collective leaves the process group unusable: record and end the job
            self.rows[name] = {"error": f"{type(e).__name__}: {e}"[:500]}
            self.flush()
            raise
        self.flush()
        return out

    def op_async(self, name: str, start: Callable[[], Any], wait: Callable[[Any], Any], mutate: Callable[[], None]) -> None:
        """``start()`` returns a handle; the stall is the time until it returns. Then
        the state is changed in place (as training would) and ``wait(handle)``."""
        try:
            self._prepare(False)
            with PeakRss() as m:
                t0 = time.perf_counter()
                h = start()
                stall = time.perf_counter() - t0
                stall_mem = m.sample()
                mutate()
                wait(h)
                total = time.perf_counter() - t0
            self.rows[name] = {"s": stall, "mem": stall_mem, "total_s": total, "total_mem": m.growth}
        except Exception as e:
            self.rows[name] = {"error": f"{type(e).__name__}: {e}"[:500]}
            self.flush()
            raise
        self.flush()

    def fold(self, name: str, parts: list[str]) -> None:
        """Replace the rows ``parts`` by one row ``name``: the median run of them."""
        rows = [self.rows.pop(p) for p in parts]
        rows.sort(key=lambda r: r["s"])
        row = dict(rows[(len(rows) - 1) // 2])
        row["runs_s"] = [r["s"] for r in rows]
        self.rows[name] = row
        self.flush()

    def check(self, name: str, want: float, got: float) -> None:
        self.info.setdefault("verified", {})[name] = same(want, got)
        if not same(want, got):
            print(f"rank {self.rank}: {name} fingerprint {got!r} != {want!r}", flush=True)
        self.flush()


def shardpoint_status() -> tuple[Any, str]:
    """(module or None, why not)."""
    try:
        import shardpoint
    except Exception as e:  # noqa: BLE001
        return None, f"import shardpoint failed: {type(e).__name__}: {e}"
    if not hasattr(shardpoint, "save") or not hasattr(shardpoint, "load"):
        return None, "shardpoint.save/load not written yet"
    return shardpoint, ""


def async_available(sp: Any) -> str:
    """'' when shardpoint.save(blocking=False) looks implemented, else why not."""
    if sp is None:
        return "shardpoint not available"
    if "blocking" not in inspect.signature(sp.save).parameters:
        return "shardpoint.save has no blocking= argument yet"
    return ""


def dcp_defaults() -> dict[str, Any]:
    from torch.distributed.checkpoint import FileSystemWriter

    p = inspect.signature(FileSystemWriter.__init__).parameters
    return {"sync_files": p["sync_files"].default, "thread_count": p["thread_count"].default}


# --- roles -------------------------------------------------------------------------


def role_save(cfg: dict[str, Any]) -> None:
    """4 ranks: build, step once, then clone / torch.save / DCP / shardpoint, and loads on 4."""
    rank, world = dist.get_rank(), dist.get_world_size()
    rec = Recorder(os.path.join(cfg["workdir"], f"save.rank{rank}.json"))
    d = cfg["dirs"]
    t0 = time.perf_counter()
    model, opt = make_fsdp(cfg["size_mb"], world, seed=0, step=True)
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    local, total = state_bytes(state)
    fp = fingerprint(state)
    rec.info.update(local_bytes=local, state_bytes=total, fingerprint=fp, build_s=time.perf_counter() - t0,
                    dcp_writer_defaults=dcp_defaults(), n_tensors=sum(1 for _ in leaves(state)))
    rec.flush()

    # a plain copy of the local state: the floor for an async stall
    rec.op("clone", lambda: [local_of(t).clone() for _, t in leaves(state)], repeat=3)

    # torch.save of the full state from one process (gathered first, not timed as a save)
    full: dict[str, Any] = {}
    full["sd"] = rec.op("gather_full", lambda: get_state_dict(
        model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True)))

    def torch_save() -> None:
        with open(d["torch_save"], "wb") as f:
            torch.save({"model": full["sd"][0], "optim": full["sd"][1]}, f)
            f.flush()
            os.fsync(f.fileno())

    rec.op("torch_save", torch_save, ranks=(0,))
    full.clear()

    negate = lambda: for_each_local(state, lambda t: t.mul_(-1))  # noqa: E731 - exact, undone by itself
    zero = lambda: for_each_local(state, lambda t: t.zero_())  # noqa: E731

    def load_and_check(name: str, fn: Callable[[], Any], timed: bool = True) -> None:
        """Load into zeroed state (timed: from a cold page cache), hand it to the
        model and optimizer, and check it equals what was saved."""
        zero()
        if timed:
            rec.op(name, fn, drop=True, repeat=cfg.get("load_repeat", 3))
        else:
            fn()
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        m2, o2 = get_state_dict(model, opt)
        rec.check(name, fp, fingerprint({"model": m2, "optim": o2}))

    def save_3x(name: str, save: Callable[[str], Any], path: str) -> None:
        """Three saves into fresh folders (median); the first one stays at ``path``."""
        paths = iter([path, path + "-rep2", path + "-rep3"])
        rec.op(name, lambda: save(next(paths)), repeat=3)
        if rank == 0:
            for extra in (path + "-rep2", path + "-rep3"):
                shutil.rmtree(extra, ignore_errors=True)

    def async_rows(prefix: str, start: Callable[[str], Any], wait: Callable[[Any], Any],
                   fresh: Callable[[], None] | None = None) -> None:
        """Row ``prefix``: the median of 3 first calls (``fresh()`` before each makes it
        allocate its staging memory again); row ``prefix + "2"``: the median of 2 more
        calls, the steady state."""
        firsts = [prefix, prefix + "_b", prefix + "_c"]
        for name in [*firsts, prefix + "2", prefix + "3"]:
            if fresh is not None and name in firsts:
                fresh()
            rec.op_async(name, lambda name=name: start(d[name]), wait, negate)
            negate()
        rec.fold(prefix, firsts)
        rec.fold(prefix + "2", [prefix + "2", prefix + "3"])

    # DCP first, so that a failure in shardpoint leaves the peers measured
    save_3x("dcp_save", lambda p: dcp.save(state, checkpoint_id=p), d["dcp"])
    # DCP's default stager allocates fresh memory on every call: every call is a first call
    async_rows("dcp_async", lambda p: dcp.async_save(state, checkpoint_id=p), lambda fut: fut.result())
    assert same(fp, fingerprint(state)), "the state changed while saving"
    load_and_check("dcp_load4", lambda: dcp.load(state, checkpoint_id=d["dcp"]))
    load_and_check("dcp_async_content", lambda: dcp.load(state, checkpoint_id=d["dcp_async"]), timed=False)

    sp, why = shardpoint_status()
    rec.info["shardpoint"] = why or "ok"
    if sp is None:
        for k in ("sp_save", "sp_async", "sp_load4"):
            rec.rows[k] = {"error": why}
        rec.flush()
        return
    save_3x("sp_save", lambda p: sp.save(state, p), d["sp"])
    why_async = async_available(sp)
    if why_async:
        rec.rows["sp_async"] = {"error": why_async}
    else:
        def drop_staging() -> None:  # a true first call: the staging buffer is allocated again
            if importlib.util.find_spec("shardpoint.runtime") is not None:
                from shardpoint.runtime import PROCESS

                PROCESS.staging = None
            else:  # the code before the runtime owner (same-run comparisons with an older checkout)
                from shardpoint import asyncsave

                asyncsave._staging.buf = None

        async_rows("sp_async", lambda p: sp.save(state, p, blocking=False), lambda h: h.wait(), drop_staging)
        if "overlap" in inspect.signature(sp.save).parameters:
            overlap_rows(rec, sp, state, d, negate)
    assert same(fp, fingerprint(state)), "the state changed while saving"
    load_and_check("sp_load4", lambda: sp.load(state, d["sp"]))
    if not why_async:
        load_and_check("sp_async_content", lambda: sp.load(state, d["sp_async"]), timed=False)
        load_and_check("sp_async3_content", lambda: sp.load(state, d["sp_async3"]), timed=False)
        if "sp_overlap" in rec.rows and "error" not in rec.rows["sp_overlap"]:
            load_and_check("sp_overlap_content", lambda: sp.load(state, d["sp_overlap"]), timed=False)
    rec.flush()


def overlap_rows(rec: Recorder, sp: Any, state: Any, d: dict[str, str], negate: Callable[[], None]) -> None:
    """Row ``sp_overlap``: ``save(blocking=False, overlap=True)``, median of 3 (staging
    buffer warm, as in the steady state). The stall is the time for ``save`` to return;
    ``staged_s`` when the copy was taken. Then the state is changed in place, as the
    training step that waited for the copy would, and restored after ``wait()``."""
    names = ["sp_overlap", "sp_overlap_b", "sp_overlap_c"]
    try:
        for name in names:
            rec._prepare(False)
            with PeakRss() as m:
                t0 = time.perf_counter()
                h = sp.save(state, d[name], blocking=False, overlap=True)
                stall = time.perf_counter() - t0
                stall_mem = m.sample()
                h.wait_staged()
                staged = time.perf_counter() - t0
                negate()
                h.wait()
                total = time.perf_counter() - t0
            negate()
            rec.rows[name] = {"s": stall, "mem": stall_mem, "staged_s": staged, "total_s": total, "total_mem": m.growth}
        rec.fold("sp_overlap", names)
    except Exception as e:
        rec.rows["sp_overlap"] = {"error": f"{type(e).__name__}: {e}"[:500]}
        rec.flush()
        raise


def read_files(paths: list[str], block: int = 8 << 20) -> int:
    """Read ``paths`` sequentially into one reused buffer; returns the bytes read."""
    buf = memoryview(bytearray(block))
    total = 0
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            while n := os.readv(fd, [buf]):
                total += n
        finally:
            os.close(fd)
    return total


def role_load(cfg: dict[str, Any]) -> None:
    """2 ranks, a fresh job with other initial values: load the 4-rank checkpoints."""
    rank, world = dist.get_rank(), dist.get_world_size()
    rec = Recorder(os.path.join(cfg["workdir"], f"load.rank{rank}.json"))
    d = cfg["dirs"]
    model, opt = make_fsdp(cfg["size_mb"], world, seed=1, step=False)
    msd, osd = get_state_dict(model, opt)  # initialises AdamW's state so there is a target to load into
    state = {"model": msd, "optim": osd}
    local, total = state_bytes(state)
    rec.info.update(local_bytes=local, state_bytes=total)
    want = cfg["fingerprint"]

    def load_and_check(name: str, fn: Callable[[], Any], drop: bool = True) -> None:
        for_each_local(state, lambda t: t.zero_())
        if not drop:
            fn()  # once untimed, so that every timed run finds the files in the page cache
        rec.op(name, fn, drop=drop, flush=False, repeat=cfg.get("load_repeat", 3))
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        m2, o2 = get_state_dict(model, opt)
        rec.check(name, want, fingerprint({"model": m2, "optim": o2}))

    # the floor: this rank's half of the shardpoint checkpoint's bytes, read cold with
    # large sequential reads and no work on them (no reader can load faster from this disk)
    if os.path.isdir(d["sp"]):
        files = sorted(f for f in os.listdir(d["sp"]) if f.endswith(".safetensors"))
        rec.op("read_floor2", lambda: read_files([os.path.join(d["sp"], f) for f in files[rank::world]]),
               drop=True, repeat=cfg.get("load_repeat", 3))
    if cfg.get("dcp_ok", True):
        load_and_check("dcp_load2", lambda: dcp.load(state, checkpoint_id=d["dcp"]))
        # warm: the files are in the page cache (what is left is the loader's own work)
        load_and_check("dcp_load2_warm", lambda: dcp.load(state, checkpoint_id=d["dcp"]), drop=False)
    sp, why = shardpoint_status()
    if sp is not None and cfg.get("sp_ok", True):
        load_and_check("sp_load2", lambda: sp.load(state, d["sp"]))
        # the same without checksum verification (DCP verifies none): where the time goes
        load_and_check("sp_load2_noverify", lambda: sp.load(state, d["sp"], verify=False))
        load_and_check("sp_load2_warm", lambda: sp.load(state, d["sp"]), drop=False)
    else:
        rec.rows["sp_load2"] = {"error": why or "no shardpoint checkpoint was saved"}
    rec.flush()
    # one more training step on the loaded state: resharded AdamW state must be usable
    model(batch(cfg["size_mb"], rank)).pow(2).mean().backward()
    opt.step()
    rec.info["stepped_after_load"] = True
    rec.flush()


def main() -> None:
    role, cfg_path = sys.argv[1], sys.argv[2]
    with open(cfg_path) as f:
        cfg = json.load(f)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=cfg.get("pg_timeout", 600)))
    {"save": role_save, "load": role_load}[role](cfg)
    dist.barrier()
    # skip interpreter teardown: every result is on disk, and a lingering thread of a
    # saver must not keep the job alive
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
