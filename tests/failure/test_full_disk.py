"""A full disk: the save fails on every rank with an error that says so and names
the file, no manifest appears, the earlier checkpoints stay intact and load, and
the next save after space is freed succeeds. Two real gloo ranks, through a
storage that runs out of space after a byte budget, and (where this process may
mount one) a real, small tmpfs."""

from __future__ import annotations

import errno
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch

import shardpoint
from shardpoint.layout import FlatShard
from shardpoint.storage import LocalStorage
from shardpoint.verify import verify
from tests._dist import run_ranks
from tests.failure._storage import Budget, FullDisk

pytestmark = pytest.mark.distributed


def uniform_state(rank: int, world: int, step: int, n: int) -> dict[str, Any]:
    """Every tensor filled with ``step``: ``w`` split between the ranks (``n``
    elements each), ``b`` replicated, ``rng`` per rank."""
    return {
        "w": FlatShard(torch.full((n,), float(step)), (n * world,), rank * n),
        "b": torch.full((16,), float(step)),
        "step": step,
        "rng": shardpoint.PerRank(torch.full((4,), step, dtype=torch.int64)),
    }


def assert_uniform(path: str | Path, step: int) -> None:
    full = shardpoint.load_full(path)
    assert full["step"] == step
    for t in [full["w"], full["b"], *full["rng"].values()]:
        assert bool((t == step).all()), f"{path}: a tensor is not filled with {step}"
    assert verify(path).ok


def _save_expecting_enospc(mgr: shardpoint.CheckpointManager, state: Any, step: int) -> dict[str, Any]:
    try:
        mgr.save(state, step)
    except Exception as e:  # noqa: BLE001 - the test judges it
        cause = e.__cause__
        return {"type": type(e).__name__, "shardpoint": isinstance(e, shardpoint.ShardpointError), "message": str(e),
                "cause": type(cause).__name__ if cause else None, "errno": getattr(cause, "errno", None)}
    return {"type": None}


def budget_job(rank: int, world: int, root: str) -> dict[str, Any]:
    """Step 1 saves; then the disk fills up in each phase in turn; step 5 saves again."""
    budget = Budget()
    mgr = shardpoint.CheckpointManager(FullDisk(LocalStorage(root), budget), timeout=60)
    out: dict[str, Any] = {}
    mgr.save(uniform_state(rank, world, 1, 256), 1)
    # 2: rank 1 runs out part way through its data file
    budget.left = 300 if rank == 1 else None
    out["data"] = _save_expecting_enospc(mgr, uniform_state(rank, world, 2, 256), 2)
    # 3: both ranks run out before writing anything
    budget.left = 0
    out["both"] = _save_expecting_enospc(mgr, uniform_state(rank, world, 3, 256), 3)
    # 4: the data fits, the manifest does not (rank 0 writes it)
    budget.left = None
    if rank == 0:
        budget.left = os.path.getsize(next(Path(root, "step-00000001").glob("r00000-*"))) + 10
    out["manifest"] = _save_expecting_enospc(mgr, uniform_state(rank, world, 4, 256), 4)
    budget.left = None
    mgr.save(uniform_state(rank, world, 5, 256), 5)
    return out


def check_failures(out: list[dict[str, Any]], case: str, failing: set[int], root: Path, step: int) -> None:
    for rank, o in enumerate(out):
        r = o[case]
        assert r["type"] is not None, f"{case}: the save returned normally on rank {rank}"
        assert r["shardpoint"], r
        assert "No space left on device" in r["message"] and "rank" in r["message"], r
        if rank in failing:
            # the rank whose write failed names itself and the file; the OSError is the cause
            assert r["cause"] == "OSError" and r["errno"] == errno.ENOSPC, r
            assert f"rank {rank} failed" in r["message"] and f"step-{step:08d}/" in r["message"], r
        else:
            # the others learn which rank failed and why: a RankFailedError, not the error
            # that means "a rank did not come or died" (every rank came; one ran out of space)
            assert r["type"] == "RankFailedError", r
            assert any(f"rank {f} failed" in r["message"] for f in failing), r
    d = root / f"step-{step:08d}"
    assert not (d / "manifest.json").exists()
    assert not list(d.glob("*.safetensors")) and not list(d.glob(".manifest.json.tmp-*")), os.listdir(d)


def test_enospc_on_every_phase_fails_everywhere_and_keeps_earlier(tmp_path: Path) -> None:
    root = tmp_path / "root"
    out = run_ranks(budget_job, 2, str(root), timeout=180)
    check_failures(out, "data", {1}, root, 2)
    check_failures(out, "both", {0, 1}, root, 3)
    check_failures(out, "manifest", {0}, root, 4)
    mgr = shardpoint.CheckpointManager(root)
    assert [i.step for i in mgr.list()] == [1, 5] and mgr.latest().step == 5
    for info in mgr.list():
        assert_uniform(info.path, info.step)


@pytest.fixture
def tmpfs(tmp_path: Path):  # type: ignore[no-untyped-def]
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    try:
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=512k", "tmpfs", str(mnt)],
                           capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        pytest.skip(f"cannot mount a tmpfs here ({e}); the budget test covers a full disk")
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({r.stderr.decode().strip()}); the budget test covers a full disk")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True, timeout=30)


def tmpfs_job(rank: int, world: int, root: str) -> dict[str, Any]:
    mgr = shardpoint.CheckpointManager(root, timeout=60)
    mgr.save(uniform_state(rank, world, 1, 4096), 1)  # 2 x 16 KiB: fits
    out = {"big": _save_expecting_enospc(mgr, uniform_state(rank, world, 2, 200_000), 2)}  # 2 x 800 KB: cannot fit
    mgr.save(uniform_state(rank, world, 3, 4096), 3)  # the failed save's partial files are gone
    return out


def test_real_full_tmpfs(tmpfs: Path) -> None:
    root = tmpfs / "root"
    out = run_ranks(tmpfs_job, 2, str(root), timeout=180)
    failing = {r for r, o in enumerate(out) if o["big"]["cause"] == "OSError"}
    assert failing, out
    check_failures(out, "big", failing, root, 2)
    mgr = shardpoint.CheckpointManager(root)
    assert [i.step for i in mgr.list()] == [1, 3]
    for info in mgr.list():
        assert_uniform(info.path, info.step)


def test_full_tmpfs_leaves_no_partial_files(tmpfs: Path) -> None:
    """On a real full disk, a failed data write and a failed manifest write leave
    no partial or temporary file behind, and the error names the file."""
    st = LocalStorage(tmpfs / "ckpt")
    st.write_file("keep.bin", [b"x" * 1000])
    filler = tmpfs / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
    try:  # fill the disk up
        while os.write(fd, b"\0" * 4096):
            pass
    except OSError as e:
        assert e.errno == errno.ENOSPC
    finally:
        os.close(fd)
    with pytest.raises(OSError) as ei:
        st.write_file("data.safetensors", [b"y" * 65536])
    assert ei.value.errno == errno.ENOSPC and "data.safetensors" in str(ei.value)
    with pytest.raises(OSError) as ei:
        st.write_atomic("manifest.json", b"{" * 65536)
    assert ei.value.errno == errno.ENOSPC and "manifest.json" in str(ei.value)
    assert sorted(os.listdir(tmpfs / "ckpt")) == ["keep.bin"]
    os.remove(filler)
