"""shardpoint side by side with dd, torch.save, DCP and DeepSpeed, in one run.

    python benchmarks/compare.py [--size-mb 1024] [--json out.json] [--tmpdir DIR]

Builds the same state (FSDP2 parameters + AdamW moments after one step, about
``--size-mb`` MB) on 4 gloo ranks started as real processes, measures every saver
and loader on fresh directories under one temporary directory, prints a markdown
table of the operations and one of issue 6's targets (met / not met), and writes
everything as JSON with ``--json``. See benchmarks/README.md for what each row means.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import importlib.util
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from _common import MB, JobFailed, MiB, dd_write_mb_s, drop_caches, launch, run_timed, tree_bytes  # noqa: E402


def merge(per_rank: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Rows: time and memory are the max over ranks (a collective finishes with its
    slowest rank). Info: rank 0's, plus the max local state size over ranks."""
    rows: dict[str, Any] = {}
    names = sorted({n for r in per_rank for n in r.get("rows", {})})
    for n in names:
        rs = [r["rows"][n] for r in per_rank if n in r.get("rows", {})]
        errs = [x["error"] for x in rs if "error" in x]
        if errs:
            rows[n] = {"error": errs[0]}
            continue
        row: dict[str, Any] = {}
        for k in ("s", "mem", "total_s", "total_mem", "staged_s"):
            if k in rs[0]:
                row[k] = max(x[k] for x in rs)
        row["runs_s"] = rs[0].get("runs_s")
        rows[n] = row
    info = dict(per_rank[0].get("info", {})) if per_rank else {}
    locals_ = [r.get("info", {}).get("local_bytes") for r in per_rank if r.get("info", {}).get("local_bytes")]
    if locals_:
        info["local_bytes_max"] = max(locals_)
    verified: dict[str, bool] = {}
    for r in per_rank:
        for k, v in r.get("info", {}).get("verified", {}).items():
            verified[k] = verified.get(k, True) and v
    info["verified"] = verified
    return rows, info


def run_job(script: str, role: str, world: int, cfg: dict[str, Any], work: str, timeout: float,
            res: dict[str, Any], env: dict[str, str] | None = None) -> dict[str, Any]:
    t0 = time.perf_counter()
    try:
        per_rank = launch(os.path.join(HERE, script), role, world, cfg, work, timeout, env)
    except JobFailed as e:
        print(f"!! {e}", file=sys.stderr)
        res["errors"].append(str(e)[:4000])
        per_rank = [r for r in e.results if r]
    print(f"   {role} on {world} ranks: {time.perf_counter() - t0:.0f}s", file=sys.stderr)
    if not per_rank:
        return {}
    rows, info = merge(per_rank)
    res["rows"].update(rows)
    res["info"][role] = info
    return info


def deepspeed_available() -> str:
    if importlib.util.find_spec("deepspeed") is None:
        return "deepspeed is not installed"
    return ""


# --- report ------------------------------------------------------------------------

OPS = [
    ("dd", "disk: `dd` sequential write + fdatasync (median of 3)"),
    ("clone", "`clone()` of the local state (median of 3)"),
    ("torch_save", "`torch.save` + fsync of the full state, 1 process"),
    ("dcp_save", "DCP save (fsync; median of 3)"),
    ("dcp_async", "DCP async_save: stall (total to done), first call (median of 3)"),
    ("dcp_async2", "  steady state: 2nd and 3rd calls (median)"),
    ("dcp_load4", "DCP load on 4 ranks (median of 3 cold runs)"),
    ("read_floor2", "disk: cold sequential read of the checkpoint's bytes by 2 processes (floor of a 4 -> 2 load)"),
    ("dcp_load2", "DCP load 4 -> 2 ranks (median of 3 cold runs)"),
    ("dcp_load2_warm", "  the same from the page cache (median of 3 warm runs)"),
    ("ds_save", "DeepSpeed ZeRO-2 save_checkpoint (no fsync)"),
    ("ds_fsync", "  + fsync of its files afterwards"),
    ("ds_to_universal", "`ds_to_universal.py --inject_missing_state`"),
    ("ds_universal_load2", "DeepSpeed universal load on 2 ranks"),
    ("sp_save", "shardpoint save (blocking; median of 3)"),
    ("sp_async", "shardpoint save(blocking=False): stall (total to wait()), first call (median of 3, staging allocated each time)"),
    ("sp_async2", "  steady state: 2nd and 3rd calls (median; staging buffers reused)"),
    ("sp_overlap", "shardpoint save(blocking=False, overlap=True): stall (total to wait()), median of 3; the copy runs after it returns"),
    ("sp_load4", "shardpoint load on 4 ranks (median of 3 cold runs)"),
    ("sp_load2", "shardpoint load 4 -> 2 ranks (median of 3 cold runs)"),
    ("sp_load2_noverify", "  the same with verify=False (no CRC check; DCP checks none)"),
    ("sp_load2_warm", "  the same from the page cache (median of 3 warm runs, CRCs verified)"),
]


def _f(x: float | None, nd: int = 2) -> str:
    return "—" if x is None else f"{x:.{nd}f}"


def ops_table(res: dict[str, Any]) -> str:
    nbytes = res["state_bytes"]
    lines = ["| operation | seconds | MB/s of state | RSS growth MiB (max over ranks) |", "|---|---:|---:|---:|"]
    for key, label in OPS:
        row = res["rows"].get(key)
        if row is None:
            continue
        if "error" in row:
            lines.append(f"| {label} | not available: {row['error'][:120]} | | |")
            continue
        s = row["s"]
        if key == "dd":
            lines.append(f"| {label} | {_f(s)} | {row['mb_s']:.0f} | — |")
            continue
        secs = _f(s, 3 if s < 1 else 2)
        mem = f"{row['mem'] / MiB:.0f}" if row.get("mem") is not None else "—"
        if "total_s" in row:
            secs += f" ({_f(row['total_s'])})"
            mem += f" ({row['total_mem'] / MiB:.0f})"
        thr = "—" if key in ("clone", "ds_fsync") or "async" in key or "overlap" in key else f"{nbytes / MB / s:.0f}"
        lines.append(f"| {label} | {secs} | {thr} | {mem} |")
    return "\n".join(lines)


def targets(res: dict[str, Any]) -> list[dict[str, Any]]:
    r = res["rows"]

    def s(k: str, field: str = "s") -> float | None:
        row = r.get(k)
        return None if row is None or "error" in row else row.get(field)

    local = res.get("local_bytes_max")
    out = []

    def add(name: str, value: float | None, goal: str, ok: bool | None, unit: str = "x") -> None:
        out.append({"target": name, "value": value, "goal": goal, "unit": unit,
                    "status": "n/a" if ok is None else "met" if ok else "not met"})

    dd, sp, dcp = s("dd"), s("sp_save"), s("dcp_save")
    v = (res["state_bytes"] / MB / sp) / r["dd"]["mb_s"] if sp and dd else None
    add("shardpoint save throughput / dd", v, ">= 0.9", None if v is None else v >= 0.9)
    v = dcp / sp if sp and dcp else None
    add("DCP save time / shardpoint save time", v, ">= 1.0", None if v is None else v >= 1.0)
    clone = s("clone")
    for suffix, when in (("", "first call"), ("2", "steady state")):
        stall, dstall = s("sp_async" + suffix), s("dcp_async" + suffix)
        v = stall / clone if stall and clone else None
        add(f"shardpoint async stall / clone(), {when}", v, "<= 1.2", None if v is None else v <= 1.2)
        v = dstall / stall if stall and dstall else None
        add(f"DCP async stall / shardpoint async stall, {when}", v, "> 1.0", None if v is None else v > 1.0)
    ov = s("sp_overlap")
    for suffix, when in (("", "first call"), ("2", "steady state")):
        stall = s("sp_async" + suffix)
        v = ov / stall if ov and stall else None
        add(f"shardpoint overlapped stall / async (clone-time) stall, {when}", v, "< 1.0", None if v is None else v < 1.0)
    v = ov / clone if ov and clone else None
    add("shardpoint overlapped stall / clone()", v, "—", None)
    sp2, dcp2 = s("sp_load2"), s("dcp_load2")
    v = dcp2 / sp2 if sp2 and dcp2 else None
    add("DCP load 4->2 / shardpoint load 4->2", v, ">= 1.5", None if v is None else v >= 1.5)
    floor = s("read_floor2")
    v = floor / sp2 if sp2 and floor else None
    add("  disk floor / shardpoint load 4->2 (1.0: as fast as the disk)", v, "—", None)
    w_sp, w_dcp = s("sp_load2_warm"), s("dcp_load2_warm")
    v = w_dcp / w_sp if w_sp and w_dcp else None
    add("DCP load 4->2 / shardpoint load 4->2, page cache warm", v, ">= 1.5", None if v is None else v >= 1.5)
    dsu, dsl = s("ds_to_universal"), s("ds_universal_load2")
    v = (dsu + dsl) / sp2 if sp2 and dsu and dsl else None
    add("(ds_to_universal + universal load) / shardpoint load 4->2", v, ">= 10", None if v is None else v >= 10)
    mem = s("sp_save", "mem")
    if mem is not None and local:
        cap = 0.05 * local + 64 * MiB
        add("shardpoint blocking save RSS growth (MiB)", mem / MiB, f"<= {cap / MiB:.0f} (5% of local {local / MiB:.0f} MiB + 64)",
            mem <= cap, "MiB")
    else:
        add("shardpoint blocking save RSS growth (MiB)", None, "<= 5% of local + 64 MiB", None, "MiB")
    mem = s("sp_async", "total_mem")
    if mem is not None and local:
        cap = 1.05 * local + 64 * MiB
        add("shardpoint async save RSS growth to wait() (MiB)", mem / MiB,
            f"<= {cap / MiB:.0f} (one staging copy + 5% + 64)", mem <= cap, "MiB")
    else:
        add("shardpoint async save RSS growth to wait() (MiB)", None, "<= local + 5% + 64 MiB", None, "MiB")
    return out


def targets_table(ts: list[dict[str, Any]]) -> str:
    lines = ["| target | value | goal | status |", "|---|---:|---|---|"]
    for t in ts:
        val = "—" if t["value"] is None else f"{t['value']:.2f}" + ("x" if t["unit"] == "x" else "")
        lines.append(f"| {t['target']} | {val} | {t['goal']} | {t['status']} |")
    return "\n".join(lines)


def notes(res: dict[str, Any]) -> list[str]:
    out = []
    info = res["info"].get("save", {})
    dflt = info.get("dcp_writer_defaults")
    if dflt:
        out.append(f"DCP ran with its defaults: FileSystemWriter(sync_files={dflt['sync_files']}, "
                   f"thread_count={dflt['thread_count']}); sync_files=True means os.fsync on every file it writes.")
    out.append("Loads ran " + ("after `echo 3 > /proc/sys/vm/drop_caches` (cold guest page cache; the VM host may still cache)"
                               if res.get("page_cache_dropped") else "from the page cache (drop_caches refused)") + ".")
    ver = {}
    for role in ("save", "load", "ds_load"):
        ver.update(res["info"].get(role, {}).get("verified", {}))
    if ver:
        bad = [k for k, v in ver.items() if not v]
        out.append("Loaded state checked against the saved state (position-weighted checksum): "
                   + ("all equal" if not bad else f"MISMATCH in {bad}") + f" ({', '.join(sorted(ver))}).")
    if "ds_bytes_on_disk" in res:
        out.append(f"DeepSpeed checkpoint on disk: {res['ds_bytes_on_disk'] / MB:.0f} MB; universal: "
                   f"{res.get('ds_universal_bytes_on_disk', 0) / MB:.0f} MB; ds_to_universal peak RSS "
                   f"{res.get('ds_to_universal_maxrss', 0) / MiB:.0f} MiB.")
    ov = res["rows"].get("sp_overlap", {})
    if "staged_s" in ov:
        out.append(f"Overlapped save: returned after {ov['s']:.3f} s; its copy was taken {ov['staged_s']:.3f} s after the "
                   "call (what an optimizer step issued at once would wait for), committed after "
                   f"{ov['total_s']:.2f} s.")
    for k in ("sp_save", "sp_async", "sp_overlap", "sp_load2"):
        row = res["rows"].get(k, {})
        if "error" in row:
            out.append(f"{k}: {row['error']}")
    return out


# --- main --------------------------------------------------------------------------


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size-mb", type=int, default=1024, help="fp32 params + AdamW moments, in MB (default 1024)")
    ap.add_argument("--json", help="write all results here")
    ap.add_argument("--tmpdir", default=None, help="where the checkpoints go (default: the system temp dir)")
    ap.add_argument("--keep", action="store_true", help="keep the checkpoints and logs")
    ap.add_argument("--no-deepspeed", action="store_true", help="skip the DeepSpeed rows")
    ap.add_argument("--load-repeat", type=int, default=3, help="runs of each FSDP load, cold cache each (median)")
    args = ap.parse_args()

    os.environ["OMP_NUM_THREADS"] = "1"
    t_start = time.perf_counter()
    tmp = tempfile.mkdtemp(prefix="shardpoint-bench-", dir=args.tmpdir)
    work = os.path.join(tmp, "work")
    os.makedirs(work)
    dirs = {k: os.path.join(tmp, k) for k in ("dcp", "sp", "ds")}
    dirs.update({f"{p}_async{i}": os.path.join(tmp, f"{p}_async{i}") for p in ("dcp", "sp") for i in ("", "_b", "_c", "2", "3")})
    dirs.update({f"sp_overlap{i}": os.path.join(tmp, f"sp_overlap{i}") for i in ("", "_b", "_c")})
    dirs["torch_save"] = os.path.join(tmp, "torch_save.pt")
    res: dict[str, Any] = {
        "when": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "size_mb": args.size_mb, "tmpdir": tmp, "host": platform.node(), "cpus": os.cpu_count(),
        "rows": {}, "info": {}, "errors": [],
    }
    try:
        import torch

        res["torch"] = torch.__version__
        print(f"== shardpoint benchmark, ~{args.size_mb} MB of state, checkpoints under {tmp}", file=sys.stderr)
        res["page_cache_dropped"] = drop_caches()
        res["loadavg_start"] = os.getloadavg()

        mb_s, runs = dd_write_mb_s(tmp, args.size_mb)
        res["rows"]["dd"] = {"s": args.size_mb * MB / (mb_s * MB), "mb_s": mb_s, "runs_mb_s": runs}
        print(f"   dd: {mb_s:.0f} MB/s {[round(x) for x in runs]}", file=sys.stderr)

        cfg = {"size_mb": args.size_mb, "workdir": work, "dirs": dirs, "load_repeat": args.load_repeat}
        info = run_job("compare_fsdp.py", "save", 4, cfg, work, 120 + 0.5 * args.size_mb, res)
        res["state_bytes"] = info.get("state_bytes", args.size_mb * MB)
        res["local_bytes_max"] = info.get("local_bytes_max")
        res["n_tensors"] = info.get("n_tensors")
        res["shardpoint"] = info.get("shardpoint")
        if "fingerprint" in info:
            cfg2 = dict(cfg, fingerprint=info["fingerprint"],
                        dcp_ok="error" not in res["rows"].get("dcp_save", {"error": 1}),
                        sp_ok="error" not in res["rows"].get("sp_save", {"error": 1}))
            run_job("compare_fsdp.py", "load", 2, cfg2, work, 120 + 0.25 * args.size_mb, res)

        why = "--no-deepspeed" if args.no_deepspeed else deepspeed_available()
        if why:
            for k in ("ds_save", "ds_to_universal", "ds_universal_load2"):
                res["rows"][k] = {"error": f"skipped: {why}"}
        else:
            env = {"DS_ACCELERATOR": "cpu"}
            info = run_job("compare_ds.py", "ds_save", 4, cfg, work, 180 + 0.5 * args.size_mb, res, env)
            if "ds_save" in res["rows"] and "error" not in res["rows"]["ds_save"]:
                res["ds_bytes_on_disk"] = tree_bytes(dirs["ds"])
                spec = importlib.util.find_spec("deepspeed.checkpoint.ds_to_universal")
                assert spec is not None and spec.origin
                out = dirs["ds"] + "/step1_universal"
                drop_caches()
                try:
                    dt, maxrss = run_timed(
                        [sys.executable, spec.origin, "--input_folder", dirs["ds"] + "/step1", "--output_folder", out,
                         "--inject_missing_state"],
                        120 + 0.5 * args.size_mb, os.path.join(work, "ds_to_universal.log"),
                        env=dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1"))
                    res["rows"]["ds_to_universal"] = {"s": dt, "mem": None}
                    res["ds_to_universal_maxrss"] = maxrss
                    res["ds_universal_bytes_on_disk"] = tree_bytes(out)
                    cfg3 = dict(cfg, fingerprint=info["fingerprint"])
                    run_job("compare_ds.py", "ds_load", 2, cfg3, work, 180 + 0.25 * args.size_mb, res, env)
                except JobFailed as e:
                    res["errors"].append(str(e)[:4000])
                    res["rows"]["ds_to_universal"] = {"error": str(e).splitlines()[0]}
    finally:
        res["wall_s"] = time.perf_counter() - t_start
        if args.keep:
            print(f"   kept {tmp}", file=sys.stderr)
        else:
            shutil.rmtree(tmp, ignore_errors=True)

    res.setdefault("state_bytes", args.size_mb * MB)
    res["targets"] = targets(res)
    text = [
        f"### shardpoint vs peers: {res['state_bytes'] / MB:.0f} MB of state "
        f"({res.get('n_tensors')} tensors; {(res.get('local_bytes_max') or 0) / MiB:.0f} MiB local per rank on 4 ranks), "
        f"{res['cpus']} CPUs, torch {res.get('torch')}, {res['when']}",
        "",
        ops_table(res),
        "",
        targets_table(res["targets"]),
        "",
        *[f"- {n}" for n in notes(res)],
        f"- Whole run: {res['wall_s']:.0f} s. 1-min load average before it started: {res.get('loadavg_start', [0])[0]:.1f} "
        f"({res['cpus']} cores; well above 0 means other work shared the machine).",
    ]
    if res["errors"]:
        text.append(f"- {len(res['errors'])} job(s) failed; see the JSON `errors`.")
    res["markdown"] = "\n".join(text)
    print(res["markdown"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 1 if res["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
