"""shardpoint on one GPU, side by side with DCP and the physical floor, in one run.

    python benchmarks/gpu_bench.py [--gb 20] [--dir DIR] [--json out.json]

Builds a state of about ``--gb`` GB on the GPU (fp32 parameters of a stack of
square linear layers plus fused AdamW's two moments, after one training step) in a
world of one rank (NCCL for CUDA, gloo for CPU: ``cpu:gloo,cuda:nccl``), and
measures, each on a fresh directory under ``--dir``:

- floor: a pinned ``copy_`` of the same bytes to host memory; a plain sequential
  write (+ fsync) of them; a cold pinned read + copy back to the GPU;
- shardpoint: blocking save; ``blocking=False`` stall (time to return) and total;
  ``overlap=True`` stall, and the extra time of a real training step (forward,
  backward, optimizer step) run beside its copy, against the same step alone;
  load into the live model and optimizer; peak host RSS and device memory;
- DCP: ``dcp.save``; ``dcp.async_save`` stall (with the pinned-memory
  ``DefaultStager`` where this torch has it); ``dcp.load``.

Then checks issue 16's GPU targets against the floor measured in the same run and
prints markdown tables. The shardpoint calls are the ones tests/test_stage.py and
tests/cuda exercise. Without CUDA it says so and exits 2.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "src"))

GB = 10**9


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gb", type=float, default=20.0, help="parameters + AdamW moments, in GB (default 20)")
    ap.add_argument("--width", type=int, default=8192, help="width of each square layer (default 8192: 268 MB fp32)")
    ap.add_argument("--batch", type=int, default=8192, help="rows of the training step's batch (default 8192)")
    ap.add_argument("--dir", default=None, help="where checkpoints go (default: the system temp dir); needs ~2x --gb free")
    ap.add_argument("--repeat", type=int, default=3, help="runs of each timed step (median; default 3)")
    ap.add_argument("--json", help="write all results here")
    ap.add_argument("--skip-dcp", action="store_true", help="leave out the DCP rows")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    import torch

    if not torch.cuda.is_available():
        print("gpu_bench.py needs a CUDA GPU (torch.cuda.is_available() is False here); run it on the GPU machine:\n"
              "    PYTHONPATH=src python benchmarks/gpu_bench.py --gb 20", file=sys.stderr)
        return 2
    return Bench(args).run()


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        import torch

        self.args, self.torch = args, torch
        self.rows: dict[str, dict[str, Any]] = {}
        self.root = tempfile.mkdtemp(prefix="shardpoint-gpu-bench-", dir=args.dir)

    # -- helpers ---------------------------------------------------------------------
    def sync(self) -> None:
        self.torch.cuda.synchronize()

    def timed(self, name: str, fn: Any, *, repeat: int = 1, before: Any = None, note: str = "") -> Any:
        """Time ``fn`` (after ``before``), ``repeat`` times; the median, peak host RSS
        growth and peak device memory growth go to row ``name``."""
        from _common import PeakRss, median

        torch = self.torch
        times, out = [], None
        host = dev = 0
        for _ in range(repeat):
            if before is not None:
                before()
            self.sync()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            with PeakRss() as m:
                t0 = time.perf_counter()
                out = fn()
                self.sync()
                times.append(time.perf_counter() - t0)
            host = max(host, m.growth)
            dev = max(dev, torch.cuda.max_memory_allocated() - base)
        self.rows[name] = {"s": median(times), "runs_s": times, "host_peak": host, "device_peak": dev, "note": note}
        print(f"   {name}: {median(times):.3f} s", file=sys.stderr, flush=True)
        return out

    def fresh(self, name: str) -> str:
        path = os.path.join(self.root, name)
        shutil.rmtree(path, ignore_errors=True)
        return path

    def drop(self, path: str) -> None:
        shutil.rmtree(path, ignore_errors=True)
        if os.path.exists(path + ".bin"):
            os.remove(path + ".bin")

    def free_pinned(self) -> None:
        import gc

        gc.collect()
        empty = getattr(self.torch._C, "_host_emptyCache", None)
        if empty is not None:
            empty()

    # -- the run ---------------------------------------------------------------------
    def run(self) -> int:
        import torch
        import torch.distributed as dist
        from _common import drop_caches

        args = self.args
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29531")
        dist.init_process_group("cpu:gloo,cuda:nccl", rank=0, world_size=1)
        torch.cuda.set_device(0)
        import shardpoint

        d = args.width
        layer_bytes = d * d * 4
        n = max(1, round(args.gb * GB / (3 * layer_bytes)))
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(d, d, bias=False, device="cuda") for _ in range(n)])
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        x = torch.randn(args.batch, d, device="cuda")

        def step() -> None:
            opt.zero_grad(set_to_none=False)
            model(x).float().pow(2).mean().backward()
            opt.step()

        step()
        self.sync()
        state = shardpoint.TrainState(model, opt, rng=False)
        tensors = [p for p in model.parameters()] + [v for s in opt.state.values() for v in s.values() if v.is_cuda and v.dim()]
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        info = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "layers": n, "width": d,
                "state_bytes": nbytes, "when": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                "dir": self.root, "cpus": os.cpu_count()}
        print(f"== {nbytes / GB:.1f} GB of state ({n} layers of {d}x{d}) on {info['device']}, under {self.root}",
              file=sys.stderr, flush=True)
        try:
            # -- the floor ---------------------------------------------------------------
            buf: dict[str, Any] = {"pinned": torch.empty(nbytes, dtype=torch.uint8, pin_memory=True), "views": []}
            off = 0
            for t in tensors:
                k = t.numel() * t.element_size()
                buf["views"].append(buf["pinned"][off : off + k])
                off += k

            def pinned_copy() -> None:
                for v, t in zip(buf["views"], tensors):
                    v.copy_(t.detach().reshape(-1).view(torch.uint8), non_blocking=True)

            self.timed("pinned_copy", pinned_copy, repeat=args.repeat, note="pinned copy_ of the same bytes, device to host")
            floor_file = os.path.join(self.root, "floor.bin")

            def write() -> None:
                fd = os.open(floor_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                try:
                    mv = memoryview(buf["pinned"].numpy())
                    step_ = 64 << 20
                    for i in range(0, len(mv), step_):
                        os.write(fd, mv[i : i + step_])
                    os.fsync(fd)
                finally:
                    os.close(fd)

            self.timed("seq_write", write, note="plain sequential write + fsync of the same bytes")

            def read_copy() -> None:
                with open(floor_file, "rb", buffering=0) as f:
                    mv = memoryview(buf["pinned"].numpy())
                    step_ = 64 << 20
                    for i in range(0, len(mv), step_):
                        f.readinto(mv[i : i + step_])
                for v, t in zip(buf["views"], tensors):
                    t.detach().reshape(-1).view(torch.uint8).copy_(v, non_blocking=True)

            self.timed("read_copy", read_copy, before=drop_caches, note="cold pinned read + copy to the device")
            os.remove(floor_file)
            buf.clear()
            self.free_pinned()

            # -- the training step alone ---------------------------------------------------
            self.timed("train_step", step, repeat=args.repeat, note="forward + backward + fused AdamW step")

            # -- shardpoint -----------------------------------------------------------------
            path = self.fresh("sp")
            self.timed("sp_save", lambda: shardpoint.save(state, path, overwrite=True), repeat=args.repeat,
                       before=lambda: self.drop(path), note="shardpoint.save, blocking")
            self.timed("sp_load", lambda: shardpoint.load(state, path), before=drop_caches,
                       note="shardpoint.load into the live model and optimizer (cold)")
            self.drop(path)
            self.async_rows(shardpoint, state, step)
            if not args.skip_dcp:
                self.dcp_rows(model, opt)
        finally:
            shutil.rmtree(self.root, ignore_errors=True)
            dist.destroy_process_group()
        self.report(info)
        return 0

    def async_rows(self, shardpoint: Any, state: Any, step: Any) -> None:
        from _common import PeakRss

        for name, overlap in (("sp_async", False), ("sp_overlap", True)):
            stalls, totals, extras, host = [], [], [], 0
            for i in range(self.args.repeat):
                path = self.fresh(f"{name}{i}")
                self.sync()
                with PeakRss() as m:
                    t0 = time.perf_counter()
                    h = shardpoint.save(state, path, blocking=False, overlap=overlap)
                    stall = time.perf_counter() - t0
                    step()  # a real training step beside the copy (overlap: its optimizer step waits for it)
                    self.sync()
                    stepped = time.perf_counter() - t0
                    h.wait()
                    totals.append(time.perf_counter() - t0)
                host = max(host, m.growth)
                stalls.append(stall)
                extras.append(stepped - stall - self.rows["train_step"]["s"])
                self.drop(path)
            self.rows[name] = {"s": statistics.median(_steady(stalls)), "first_s": stalls[0], "runs_s": stalls,
                               "total_s": statistics.median(_steady(totals)), "extra_step_s": statistics.median(_steady(extras)),
                               "host_peak": host, "device_peak": None,
                               "note": "stall: time for save() to return; extra step: step beside the copy minus alone"}
            print(f"   {name}: stall {self.rows[name]['s']:.3f} s (first {stalls[0]:.3f} s), extra step "
                  f"{self.rows[name]['extra_step_s']:.3f} s", file=sys.stderr, flush=True)
        from shardpoint.runtime import PROCESS

        PROCESS.staging = None
        self.free_pinned()

    def dcp_rows(self, model: Any, opt: Any) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        msd, osd = get_state_dict(model, opt)
        sd = {"model": msd, "optim": osd}
        path = self.fresh("dcp")
        self.timed("dcp_save", lambda: dcp.save(sd, checkpoint_id=path), repeat=self.args.repeat,
                   before=lambda: self.drop(path), note="dcp.save")
        from _common import drop_caches

        self.timed("dcp_load", lambda: dcp.load(sd, checkpoint_id=path), before=drop_caches, note="dcp.load (cold)")
        self.drop(path)
        stager, how = None, "default stager"
        try:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            stager = DefaultStager(StagingOptions(use_pinned_memory=True, use_shared_memory=False,
                                                  use_async_staging=False, use_non_blocking_copy=True))
            how = "DefaultStager, pinned memory"
        except (ImportError, TypeError):
            pass
        stalls, totals = [], []
        for i in range(self.args.repeat):
            p = self.fresh(f"dcp_async{i}")
            self.sync()
            t0 = time.perf_counter()
            kw = {"async_stager": stager} if stager is not None else {}
            try:
                fut = dcp.async_save(sd, checkpoint_id=p, **kw)
            except Exception as e:  # torch 2.11's DefaultStager fails on its second call (KeyError: <class 'type'>)
                if stager is None or not stalls:
                    raise
                how += f"; its call {i + 1} failed ({type(e).__name__}: {e}): the later calls use DCP's default stager"
                print(f"   dcp_async: {how}", file=sys.stderr, flush=True)
                stager.close()
                stager, kw = None, {}
                fut = dcp.async_save(sd, checkpoint_id=p)
            stalls.append(time.perf_counter() - t0)
            (getattr(fut, "upload_completion", None) or fut).result()
            totals.append(time.perf_counter() - t0)
            self.drop(p)
        if stager is not None:
            stager.close()
        self.rows["dcp_async"] = {"s": statistics.median(_steady(stalls)), "first_s": stalls[0], "runs_s": stalls,
                                  "total_s": statistics.median(_steady(totals)), "host_peak": None, "device_peak": None,
                                  "note": f"dcp.async_save stall ({how})"}
        print(f"   dcp_async: stall {self.rows['dcp_async']['s']:.3f} s (first {stalls[0]:.3f} s)", file=sys.stderr, flush=True)

    # -- the report ------------------------------------------------------------------
    def report(self, info: dict[str, Any]) -> None:
        r, nbytes = self.rows, info["state_bytes"]

        def s(k: str, f: str = "s") -> float | None:
            return r.get(k, {}).get(f)

        lines = [f"### shardpoint on {info['device']}: {nbytes / GB:.1f} GB of state, torch {info['torch']}, {info['when']}",
                 "", "| operation | seconds | GB/s | host peak GB | device peak GB |", "|---|---:|---:|---:|---:|"]
        for k, row in r.items():
            gbs = "—" if k in ("train_step",) or "async" in k or "overlap" in k else f"{nbytes / GB / row['s']:.1f}"
            secs = f"{row['s']:.3f}"
            if "first_s" in row:
                secs += f" (first {row['first_s']:.3f})"
            if "total_s" in row:
                secs += f" (total {row['total_s']:.2f})"
            if "extra_step_s" in row:
                secs += f"; extra step {row['extra_step_s']:.3f}"
            hp = "—" if row.get("host_peak") is None else f"{row['host_peak'] / GB:.2f}"
            dp = "—" if row.get("device_peak") is None else f"{row['device_peak'] / GB:.2f}"
            lines.append(f"| {k}: {row['note']} | {secs} | {gbs} | {hp} | {dp} |")
        copy, write, rc = s("pinned_copy"), s("seq_write"), s("read_copy")
        targets = []

        def add(name: str, value: float | None, goal: float, less: bool = True) -> None:
            ok = None if value is None else (value <= goal if less else value < goal)
            targets.append((name, value, goal, "n/a" if ok is None else "met" if ok else "not met"))

        sp = s("sp_save")
        add("blocking save / max(pinned copy, sequential write)", sp / max(copy, write) if sp and copy and write else None, 1.25)
        st = s("sp_async")
        add("async stall / pinned copy", st / copy if st and copy else None, 1.1)
        dst = s("dcp_async")
        add("async stall / DCP async stall", st / dst if st and dst else None, 1.0, less=False)
        ex = s("sp_overlap", "extra_step_s")
        ov = max(ex, 0.0) + (s("sp_overlap") or 0.0) if ex is not None else None
        add("overlapped stall (return + extra step time) / pinned copy", ov / copy if ov is not None and copy else None, 0.25)
        ld = s("sp_load")
        add("load / (pinned read + copy)", ld / rc if ld and rc else None, 1.2)
        lines += ["", "| target | value | goal | status |", "|---|---:|---:|---|"]
        lines += [f"| {n} | {'—' if v is None else f'{v:.2f}x'} | {'<' if n.endswith('DCP async stall') else '<='} {g}x | {st_} |"
                  for n, v, g, st_ in targets]
        md = "\n".join(lines)
        print(md)
        if self.args.json:
            with open(self.args.json, "w") as f:
                json.dump({"info": info, "rows": r, "targets": targets, "markdown": md}, f, indent=1)


def _steady(xs: list[float]) -> list[float]:
    """The runs after the first (which also allocates and pins the reused staging
    buffer, once per process): a training loop's periodic save is the steady state."""
    return xs[1:] or xs


if __name__ == "__main__":
    sys.exit(main())
