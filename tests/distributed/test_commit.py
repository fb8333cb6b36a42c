"""The commit rule: a checkpoint exists when its manifest exists, and the manifest
is written last. A rank that fails after writing its data fails the save on
every rank and leaves no manifest, no leftovers and every earlier checkpoint
intact; strace shows every data fsync before the manifest's rename (or link, when
its folder held none) and a directory fsync after it."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import shardpoint
from shardpoint import CollectiveMismatchError
from shardpoint.layout import FlatShard
from tests._dist import free_port, run_ranks

pytestmark = pytest.mark.distributed


def state(rank: int, world: int, version: int) -> dict:
    full = torch.arange(40, dtype=torch.float32) + 100 * version
    n = 40 // world
    return {"w": FlatShard(full[rank * n : (rank + 1) * n].clone(), (40,), rank * n),
            "rep": torch.full((5,), float(version)), "version": version, "rng": shardpoint.PerRank(rank + version)}


def check_loads(path: str, version: int) -> None:
    full = shardpoint.load_full(path)
    assert torch.equal(full["w"], torch.arange(40, dtype=torch.float32) + 100 * version), path
    assert full["version"] == version and torch.equal(full["rep"], torch.full((5,), float(version)))


def listing(path: str) -> list[str]:
    return sorted(os.listdir(path)) if os.path.isdir(path) else []


class Boom(RuntimeError):
    pass


def failing_rank_case(rank: int, world: int, tmp: str) -> dict:
    import torch.distributed as dist

    from shardpoint.runtime import PROCESS

    other, same, fresh = f"{tmp}/other", f"{tmp}/same", f"{tmp}/fresh"
    shardpoint.save(state(rank, world, 1), other)
    shardpoint.save(state(rank, world, 2), same)
    before = {p: listing(p) for p in (other, same)}
    manifest_before = Path(same, "manifest.json").read_bytes()

    def hook(phase: str) -> None:
        if phase == "written" and rank == 1:
            assert listing(same) != before[same] or listing(fresh), "the hook runs after the data is written"
            raise Boom("disk on fire after writing")

    PROCESS.seams.phase = hook
    errors = {}
    for path, overwrite in ((same, True), (fresh, False)):
        try:
            shardpoint.save(state(rank, world, 3), path, overwrite=overwrite)
        except Exception as e:  # noqa: BLE001
            errors[path] = (type(e).__name__, str(e), getattr(e, "ranks", None), getattr(e, "rank", None))
        else:
            errors[path] = None
    PROCESS.seams.phase = None
    dist.barrier()  # every rank has cleaned up after itself
    out = {"errors": errors, "same": listing(same), "fresh": listing(fresh), "before": before,
           "manifest_same": Path(same, "manifest.json").read_bytes() == manifest_before,
           "other": listing(other)}
    check_loads(other, 1)
    check_loads(same, 2)
    # and the next save goes through
    shardpoint.save(state(rank, world, 4), same, overwrite=True)
    dist.barrier()
    check_loads(same, 4)
    out["after"] = listing(same)
    return out


def test_rank_failing_after_write_leaves_no_manifest(tmp_path: Path) -> None:
    results = run_ranks(failing_rank_case, 2, str(tmp_path), timeout=180)
    for rank, res in enumerate(results):
        for path, err in res["errors"].items():
            assert err is not None, f"rank {rank}: save to {path} did not raise"
            if rank == 1:  # its own error, as a RankFailedError naming itself (the original chained)
                assert err[0] == "RankFailedError" and "Boom: disk on fire" in err[1] and err[2:] == ([1], 1), err
            else:  # rank 1 came and failed: no rank is missing; .ranks names the one that failed
                assert err[0] == "RankFailedError" and err[2:] == ([1], 1), err
                assert "rank 1 failed" in err[1] and "disk on fire" in err[1]
        assert res["manifest_same"], "the committed manifest was touched"
        assert res["same"] == res["before"][f"{tmp_path}/same"], "leftovers of the failed save at the old path"
        assert res["other"] == res["before"][f"{tmp_path}/other"]
        assert res["fresh"] == [], f"leftovers of the failed save: {res['fresh']}"
        after = res["after"]
        assert "manifest.json" in after and not set(after) & (set(res["before"][f"{tmp_path}/same"]) - {"manifest.json"}), \
            "the replaced checkpoint's data files must be gone"
    assert issubclass(CollectiveMismatchError, shardpoint.ShardpointError)


# --- one process: a failure after the manifest was written keeps the checkpoint ----------

@pytest.mark.parametrize("phase", ["before_commit", "committed"])
def test_failure_around_the_commit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, phase: str) -> None:
    from shardpoint.runtime import PROCESS

    p = str(tmp_path / "ckpt")
    shardpoint.save(state(0, 1, 1), p)
    old = listing(p)

    def hook(at: str) -> None:
        if at == phase:
            raise Boom(at)

    monkeypatch.setattr(PROCESS.seams, "phase", hook)
    with pytest.raises(shardpoint.ShardpointError, match=f"Boom: {phase}") as ei:
        shardpoint.save(state(0, 1, 2), p, overwrite=True)
    assert isinstance(ei.value.__cause__, Boom)
    monkeypatch.setattr(PROCESS.seams, "phase", None)
    if phase == "before_commit":  # not committed: the old checkpoint, and nothing else
        assert listing(p) == old
        check_loads(p, 1)
    else:  # committed: the new checkpoint is complete, its data must not be removed
        check_loads(p, 2)
        files = json.loads(Path(p, "manifest.json").read_text())["files"]
        assert all(Path(p, f).exists() for f in files)


# --- the order of fsync and rename, seen by strace ----------------------------------------

SCRIPT = """
import sys
import torch
import torch.distributed as dist
import shardpoint
from shardpoint.layout import FlatShard

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
full = torch.arange(4096, dtype=torch.float32)
n = full.numel() // world
shardpoint.save({"w": FlatShard(full[rank * n:(rank + 1) * n].clone(), (4096,), rank * n),
                 "rep": torch.ones(300), "rng": shardpoint.PerRank(rank)}, sys.argv[1])
dist.destroy_process_group()
"""

_DONE = re.compile(r"^(\d+)\s+(\w+)\((.*)\)\s+=\s+(-?\d+)")
_START = re.compile(r"^(\d+)\s+(\w+)\((.*) <unfinished \.\.\.>$")
_RESUMED = re.compile(r"^(\d+)\s+<\.\.\. (\w+) resumed>(.*)\)\s+=\s+(-?\d+)")


def parse_strace(log: str) -> list[dict]:
    """Syscalls with the log line where each started and ended (a call of one
    process may be split by calls of others)."""
    events, pending = [], {}
    for i, line in enumerate(log.splitlines()):
        if m := _DONE.match(line):
            events.append({"pid": m[1], "call": m[2], "args": m[3], "ret": int(m[4]), "start": i, "end": i})
        elif m := _START.match(line):
            pending[m[1]] = {"pid": m[1], "call": m[2], "args": m[3], "start": i}
        elif m := _RESUMED.match(line):
            ev = pending.pop(m[1])
            assert ev["call"] == m[2]
            ev.update(args=ev["args"] + m[3], ret=int(m[4]), end=i)
            events.append(ev)
    return events


def fd_path(args: str) -> str | None:
    m = re.match(r"\d+<(.*)>$", args.strip())
    return m[1] if m else None


def test_strace_data_fsync_before_manifest_rename_then_dir_fsync(tmp_path: Path) -> None:
    strace = shutil.which("strace")
    if strace is None:
        if os.environ.get("CI") == "true":
            pytest.fail("strace is not installed; CI must install it (apt-get install -y strace)")
        pytest.skip("strace is not installed (apt-get install -y strace); CI=true makes this a failure")
    script = tmp_path / "save2.py"
    script.write_text(SCRIPT)
    ckpt = tmp_path / "ckpt"
    log = tmp_path / "strace.log"
    cmd = [strace, "-f", "-y", "-qq", "-e", "signal=none", "-e", "trace=fsync,fdatasync,rename,renameat,renameat2,link,linkat",
           "-o", str(log), sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
           "--master_addr", "127.0.0.1", "--master_port", str(free_port()), str(script), str(ckpt)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
    if proc.returncode != 0 and "ptrace" in (proc.stderr + proc.stdout).lower() and os.environ.get("CI") != "true":
        pytest.skip(f"strace cannot trace here: {proc.stderr[-300:]}")
    assert proc.returncode == 0, proc.stderr[-3000:]

    manifest = json.loads((ckpt / "manifest.json").read_text())
    data_files = sorted(manifest["files"])
    assert len(data_files) == 2, "both ranks write data"
    events = [e for e in parse_strace(log.read_text()) if e["ret"] == 0]
    # the manifest appears all at once: its fsynced temporary file renamed over it, or (a
    # folder that held none: created only if still absent) hard-linked to it
    renames = [e for e in events if e["call"].startswith(("rename", "link")) and f'"{ckpt}/manifest.json"' in e["args"]]
    assert len(renames) == 1, f"one rename or link makes the manifest: {renames}"
    rename = renames[0]
    assert f"{ckpt}/.manifest.json.tmp-" in rename["args"], rename
    tmp_name = re.search(r'"([^"]*\.manifest\.json\.tmp-[^"]*)"', rename["args"])[1]
    fsyncs = [(fd_path(e["args"]), e) for e in events if e["call"] in ("fsync", "fdatasync")]
    for f in data_files:
        done = [e for p, e in fsyncs if p == f"{ckpt}/{f}"]
        assert done, f"{f} was never fsynced"
        assert min(e["end"] for e in done) < rename["start"], f"{f} was fsynced after the manifest rename"
    assert any(p == tmp_name and e["end"] < rename["start"] for p, e in fsyncs), "the manifest was not fsynced before its rename"
    assert any(p == str(ckpt) and e["start"] > rename["end"] for p, e in fsyncs), "no directory fsync after the rename"
    # the data files' directory entries were made durable before the commit, too
    assert any(p == str(ckpt) and e["end"] < rename["start"] for p, e in fsyncs)
    check = shardpoint.load_full(ckpt)
    assert torch.equal(check["w"], torch.arange(4096, dtype=torch.float32))


# --- a commit checks what it commits ------------------------------------------------------

def vanished_case(rank: int, world: int, tmp: str) -> dict:
    """Rank 1's data file is deleted (as another job's retention would) after it was
    written and before rank 0 writes the manifest: nothing is committed and every
    rank raises naming the file."""
    import torch.distributed as dist

    from shardpoint.runtime import PROCESS

    path = f"{tmp}/ckpt"
    gone: list[str] = []

    def hook(phase: str) -> None:
        if phase == "before_commit" and rank == 0:
            (name,) = [f for f in os.listdir(path) if f.startswith("r00001-") and f.endswith(".safetensors")]
            os.unlink(os.path.join(path, name))
            gone.append(name)

    PROCESS.seams.phase = hook
    try:
        shardpoint.save(state(rank, world, 1), path)
        err = None
    except shardpoint.ShardpointError as e:
        err = (type(e).__name__, str(e))
    PROCESS.seams.phase = None
    dist.barrier()
    return {"err": err, "gone": gone, "listing": listing(path)}


def test_a_commit_whose_data_file_vanished_commits_nothing(tmp_path: Path) -> None:
    results = run_ranks(vanished_case, 2, str(tmp_path), timeout=180)
    gone = results[0]["gone"][0]
    for res in results:
        assert res["err"] is not None, res
        assert res["err"][0] == "SaveAbortedError", res["err"]  # the same class on every rank
        assert f"{tmp_path}/ckpt/{gone} is missing, so the checkpoint was not committed" in res["err"][1], res["err"]
        assert "manifest.json" not in res["listing"] and not any(f.startswith("r00000-") for f in res["listing"]), res


def missing_data_case(rank: int, world: int, tmp: str) -> dict:
    """Steps 1 and 2 saved; a data file of step 2 (the one latest names) deleted by
    hand. restore() names it; restore(fallback=True) loads step 1 with a warning."""
    import warnings

    import torch.distributed as dist

    root = f"{tmp}/root"
    mgr = shardpoint.CheckpointManager(root)
    mgr.save(state(rank, world, 1), 1)
    mgr.save(state(rank, world, 2), 2)
    dist.barrier()
    if rank == 0:
        step2 = f"{root}/step-00000002"
        os.unlink(os.path.join(step2, sorted(f for f in os.listdir(step2) if f.endswith(".safetensors"))[-1]))
    dist.barrier()
    target = state(rank, world, 0)
    out: dict = {}
    try:
        shardpoint.CheckpointManager(root).restore(target)
    except shardpoint.CorruptCheckpointError as e:
        out["plain"] = str(e)
    target = state(rank, world, 0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = shardpoint.CheckpointManager(root).restore(target, fallback=True)
    out.update(step=report.step, passed=report.passed_over, version=target["version"],
               w=target["w"].local.tolist(), warned=[str(w.message) for w in caught])
    n = 40 // world
    out["expected_w"] = (torch.arange(40, dtype=torch.float32) + 100)[rank * n : (rank + 1) * n].tolist()
    return out


def test_restore_with_fallback_passes_over_missing_data(tmp_path: Path) -> None:
    for res in run_ranks(missing_data_case, 2, str(tmp_path), timeout=180):
        assert "is missing" in res["plain"] and "step-00000002" in res["plain"], res
        assert res["step"] == 1 and res["version"] == 1 and res["w"] == res["expected_w"], res
        assert list(res["passed"]) == [2] and "missing or damaged data" in res["passed"][2], res
        assert any("step 2 " in w and "falling back" in w for w in res["warned"]), res["warned"]


# --- one commit: the same checkpoint from a collective save, a converter and a drain ----------

def sharded(rank: int, world: int) -> dict:
    """A state with nothing replicated (so who writes what is not a choice of the
    planner): each rank's own partition and per-rank values."""
    full = torch.arange(40, dtype=torch.float32)
    n = 40 // world
    return {"w": FlatShard(full[rank * n : (rank + 1) * n].clone(), (40,), rank * n),
            "rng": shardpoint.PerRank(torch.full((3,), float(rank)))}


def commit_paths_case(rank: int, world: int, tmp: str) -> None:
    """The same state saved by ``shardpoint.save`` and through a manager's memory tier
    (its snapshot drained to the root by the helper process), with the save id and the
    time fixed so that the bytes can be compared."""
    import uuid as uuid_mod

    import torch.distributed as dist

    from shardpoint.saving import coordinator
    from shardpoint.tiers import MemoryTier

    fixed = uuid_mod.UUID(int=0xABCDEF)
    coordinator.uuid.uuid4 = lambda: fixed  # type: ignore[attr-defined]
    coordinator.time.time = lambda: 1_700_000_000.0  # type: ignore[attr-defined]
    shardpoint.save(sharded(rank, world), f"{tmp}/online")
    mgr = shardpoint.CheckpointManager(f"{tmp}/root", memory=MemoryTier(every=1, durable_every=1, path=f"{tmp}/shm"))
    mgr.save(sharded(rank, world), 1)
    mgr.wait()
    dist.barrier()


def test_every_commit_path_writes_the_same_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import uuid as uuid_mod

    from shardpoint.api import save_offline
    from shardpoint.errors import CheckpointExistsError
    from shardpoint.saving import coordinator, offline

    run_ranks(commit_paths_case, 2, str(tmp_path), timeout=240)
    fixed = uuid_mod.UUID(int=0xABCDEF)
    monkeypatch.setattr(offline.uuid, "uuid4", lambda: fixed)
    monkeypatch.setattr(coordinator.time, "time", lambda: 1_700_000_000.0)
    save_offline([(r, sharded(r, 2)) for r in range(2)], tmp_path / "offline", world_size=2)
    online = tmp_path / "online"
    for other in (tmp_path / "offline", tmp_path / "root" / "step-00000001"):
        assert sorted(os.listdir(other)) == sorted(os.listdir(online)), other
        for name in os.listdir(online):  # the manifest and every data file and index, byte for byte
            assert (other / name).read_bytes() == (online / name).read_bytes(), f"{other}/{name}"
    # a checkpoint in the way: the same class from every path (a usage error, a FileExistsError)
    from shardpoint._export import export_checkpoint
    from shardpoint.storage import storage_for

    attempts = {
        "save": lambda: shardpoint.save({"x": torch.ones(2)}, online),
        "save_offline": lambda: save_offline([(0, {"x": torch.ones(2)})], online, world_size=1),
        "export": lambda: export_checkpoint(storage_for(tmp_path / "offline"), storage_for(online)),
    }
    for what, call in attempts.items():
        with pytest.raises(CheckpointExistsError, match=f"a checkpoint already exists at {online}") as ei:
            call()
        assert isinstance(ei.value, (ValueError, FileExistsError)), what
    assert (online / "manifest.json").read_bytes() == (tmp_path / "offline" / "manifest.json").read_bytes()
