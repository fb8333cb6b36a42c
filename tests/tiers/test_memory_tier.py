"""The memory tier in one process: the knobs, private files, the commit rule of a
snapshot (a torn one is never chosen), job identity, the drain's bytes against a
direct durable save, full shared memory (a real 2 MiB tmpfs), and `shardpoint ls`.
Multi-rank behaviour: tests/distributed/test_tiers.py; kills: tests/failure/test_tiers_sigkill.py."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import stat
import subprocess
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from shardpoint import CheckpointManager
from shardpoint.errors import CheckpointNotFoundError, UsageError
from shardpoint.format.digest import unseal
from shardpoint.format.manifest import MANIFEST_NAME
from shardpoint.load.locate import read_manifest
from shardpoint.storage import LocalStorage
from shardpoint.tiers import MemoryTier, TieredLoadReport
from shardpoint.verify import verify

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def shm() -> Iterator[Path]:
    """A fresh base folder in real shared memory, removed afterwards."""
    base = Path("/dev/shm") / f"shardpoint-test-{os.getpid()}-{os.urandom(4).hex()}"
    try:
        yield base
    finally:
        shutil.rmtree(base, ignore_errors=True)


def state(v: float, n: int = 1000) -> dict[str, object]:
    return {"w": torch.full((n,), v), "b": torch.arange(n, dtype=torch.float64) * v, "step": int(v)}


def train(mgr: CheckpointManager, steps: range, n: int = 1000) -> None:
    for s in steps:
        mgr.save(state(float(s), n), s)
    mgr.wait()


def tier(shm: Path, **kw: object) -> MemoryTier:
    return MemoryTier(**{"every": 1, "durable_every": 5, "keep": 2, "path": str(shm), "drain": "thread", **kw})  # type: ignore[arg-type]


def test_knobs_are_checked() -> None:
    with pytest.raises(UsageError, match="replicas=-1"):
        MemoryTier(durable_every=5, replicas=-1)
    assert MemoryTier(durable_every=5, replicas=2).replicas == 2  # clamped to the other hosts' number at open
    with pytest.raises(UsageError, match="durable_every"):
        MemoryTier()
    with pytest.raises(UsageError, match="keep=0"):
        MemoryTier(durable_every=5, keep=0)
    with pytest.raises(UsageError, match="absolute"):
        MemoryTier(durable_every=5, path="shm")
    with pytest.raises(UsageError, match="drain="):
        MemoryTier(durable_every=5, drain="fork")


def test_snapshots_durable_steps_and_bounds(tmp_path: Path, shm: Path) -> None:
    """Every step is snapshotted, every 5th drained; memory keeps 2 snapshots, the root
    keep_last=2; restore takes the newest (memory), in files only this user reads."""
    mgr = CheckpointManager(tmp_path / "root", keep_last=2, memory=tier(shm))
    train(mgr, range(1, 13))
    assert [i.step for i in mgr.list()] == [5, 10]
    area = mgr._tiers.area  # type: ignore[union-attr]
    assert [s.step for s in area.complete()] == [11, 12]
    assert stat.S_IMODE(os.stat(area.dir).st_mode) == 0o700
    for f in Path(area.dir).rglob("*"):
        assert stat.S_IMODE(f.stat().st_mode) == (0o700 if f.is_dir() else 0o600), f
    target = state(0.0)
    report = CheckpointManager(tmp_path / "root", memory=tier(shm)).restore(target)
    assert isinstance(report, TieredLoadReport)
    assert (report.step, report.tier, report.source) == (12, "memory", f"{area.dir}/step-00000012")
    assert torch.equal(target["w"], state(12.0)["w"]) and target["step"] == 12  # type: ignore[arg-type]
    for i in mgr.list():
        assert verify(i.path).ok


def test_torn_snapshot_is_never_chosen(tmp_path: Path, shm: Path) -> None:
    mgr = CheckpointManager(tmp_path / "root", memory=tier(shm, keep=3))
    train(mgr, range(1, 5))
    area = mgr._tiers.area  # type: ignore[union-attr]
    d4 = Path(area.dir) / "step-00000004"
    data = next(p for p in d4.iterdir() if p.suffix == ".safetensors")
    os.truncate(data, data.stat().st_size - 1)  # a snapshot cut short
    (Path(area.dir) / "step-00000003" / MANIFEST_NAME).unlink()  # a snapshot killed before its commit
    target = state(0.0)
    report = CheckpointManager(tmp_path / "root", memory=tier(shm, keep=3)).restore(target)
    assert report is not None and (report.step, report.tier) == (2, "memory")  # type: ignore[attr-defined]
    assert torch.equal(target["b"], state(2.0)["b"])  # type: ignore[arg-type]
    assert area.steps() == [2]  # the abandoned future (3, 4) is freed after the restore (1: beyond keep=3)


def test_durable_wins_when_newer_and_memory_when_torn_everywhere(tmp_path: Path, shm: Path) -> None:
    mgr = CheckpointManager(tmp_path / "root", memory=tier(shm))
    train(mgr, range(1, 6))
    area = mgr._tiers.area  # type: ignore[union-attr]
    for s in area.steps():
        (Path(area.dir) / f"step-{s:08d}" / MANIFEST_NAME).unlink()
    target = state(0.0)
    report = CheckpointManager(tmp_path / "root", memory=tier(shm)).restore(target)
    assert report is not None and (report.step, report.tier) == (5, "durable")  # type: ignore[attr-defined]
    assert torch.equal(target["w"], state(5.0)["w"])  # type: ignore[arg-type]
    assert CheckpointManager(tmp_path / "empty", memory=tier(shm)).restore(state(0.0)) is None


def test_another_jobs_snapshots_are_never_used(tmp_path: Path, shm: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Same base folder, same root: a job of another run id never sees the first's
    snapshots, not even when they are planted in its own folder."""
    root = tmp_path / "root"
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-a")
    a = CheckpointManager(root, memory=tier(shm, durable_every=100))
    train(a, range(1, 4))
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-b")
    b = CheckpointManager(root, memory=tier(shm, durable_every=100))
    assert b.restore(state(0.0)) is None
    mine = Path(b._tiers.area.dir)  # type: ignore[union-attr]
    assert mine != Path(a._tiers.area.dir)  # type: ignore[union-attr]
    shutil.copytree(a._tiers.area.dir, mine)  # type: ignore[union-attr]  # job.json still names job-a
    target = state(0.0)
    assert b.restore(target) is None and torch.equal(target["w"], state(0.0)["w"])  # type: ignore[arg-type]
    c = CheckpointManager(root, memory=tier(shm, durable_every=100, job="job-a"))  # explicit identity: the same job
    report = c.restore(state(0.0))
    assert report is not None and report.step == 3


def _poisoned_run(mgr: CheckpointManager) -> None:
    """Steps 1-8 with a loss each; step 7's weights are NaN, step 8's loss spikes."""
    for s in range(1, 9):
        st = state(float(s))
        if s == 7:
            st["w"] = torch.full((1000,), float("nan"))
        mgr.save(st, s, metrics={"loss": 1e6 if s == 8 else float(s)})
    mgr.wait()


def test_memory_snapshots_pass_health_and_accept(tmp_path: Path, shm: Path) -> None:
    """The ladder applies what a durable restore applies to memory snapshots too: a
    snapshot with NaN weights is passed over, and so is one ``accept`` rejects (a loss
    spike), each warned and named in ``passed_over``; ``restore(step=N)`` loads a
    snapshot held only in memory as asked (warning that it is unhealthy)."""
    mgr = CheckpointManager(tmp_path / "root", memory=tier(shm, keep=3))
    _poisoned_run(mgr)
    assert [i.step for i in mgr.list()] == [5]
    assert mgr._tiers.area.steps() == [6, 7, 8]  # type: ignore[union-attr]

    target = state(0.0)
    report = CheckpointManager(tmp_path / "root", memory=tier(shm, keep=3)).restore(target)
    assert report is not None and (report.step, report.tier, report.passed_over) == (8, "memory", {})  # type: ignore[attr-defined]

    target = state(0.0)
    with pytest.warns(UserWarning, match=r"restoring memory snapshot 7 as asked, although it holds non-finite.*'w'"):
        report = CheckpointManager(tmp_path / "root", memory=tier(shm, keep=3)).restore(target, step=7)
    assert report is not None and (report.step, report.tier) == (7, "memory")  # type: ignore[attr-defined]
    assert torch.isnan(target["w"]).all() and target["step"] == 7  # type: ignore[union-attr]
    assert mgr._tiers.area.steps() == [6, 7]  # type: ignore[union-attr]  # 8: the abandoned future

    mgr._tiers.area.remove(7)  # type: ignore[union-attr]
    # 6, 7 (NaN), 8 (spike) in memory again, by a new attempt (the managers above restored:
    # each claimed the root, and the first one is now stale)
    _poisoned_run(CheckpointManager(tmp_path / "root", memory=tier(shm, keep=3)))
    target = state(0.0)
    with pytest.warns(UserWarning) as seen:  # accept= decides; it keeps the health verdict by asking for it
        report = CheckpointManager(tmp_path / "root", memory=tier(shm, keep=3)).restore(
            target, accept=lambda i: i.healthy and i.metrics["loss"] < 100)
    assert report is not None and (report.step, report.tier) == (6, "memory")  # type: ignore[attr-defined]
    assert torch.equal(target["w"], state(6.0)["w"])  # type: ignore[arg-type]
    assert list(report.passed_over) == [8, 7], report.passed_over
    assert "rejected" in report.passed_over[8] and "1000000.0" in report.passed_over[8]
    assert "non-finite" in report.passed_over[7] and "'w'" in report.passed_over[7]
    said = [str(w.message) for w in seen]
    assert any("memory snapshot 8" in m and "rejected" in m for m in said), said
    assert any("memory snapshot 7" in m and "non-finite" in m for m in said), said


def test_memory_rejected_everywhere_falls_to_the_root(tmp_path: Path, shm: Path) -> None:
    """When ``accept`` rejects every snapshot (and the root's newer steps), the durable
    restore takes the newest step it accepts, and ``passed_over`` names the snapshots
    too. An explicit step held nowhere raises, naming both tiers' steps."""
    mgr = CheckpointManager(tmp_path / "root", memory=tier(shm, keep=3))
    _poisoned_run(mgr)
    target = state(0.0)
    with pytest.warns(UserWarning):
        report = CheckpointManager(tmp_path / "root", memory=tier(shm, keep=3)).restore(
            target, accept=lambda i: i.step <= 5)
    assert report is not None and (report.step, report.tier) == (5, "durable")  # type: ignore[attr-defined]
    assert torch.equal(target["w"], state(5.0)["w"])  # type: ignore[arg-type]
    assert list(report.passed_over) == [8, 7, 6], report.passed_over
    with pytest.raises(CheckpointNotFoundError, match=r"step 3 .*committed steps: \[5\]; memory snapshots the present "
                       r"hosts hold in full: \[\]"):
        CheckpointManager(tmp_path / "root", memory=tier(shm, keep=3)).restore(state(0.0), step=3)


def _normalised(folder: Path) -> dict[str, object]:
    """A checkpoint folder's contents with its save id (in names and bytes), its time,
    its seal and its indexes' digests (over bytes naming the save id) taken out."""
    man = read_manifest(LocalStorage(folder))
    sid = man.save_id.encode()
    out: dict[str, object] = {}
    for f in sorted(folder.iterdir()):
        data = f.read_bytes()
        if f.name == MANIFEST_NAME:
            doc = json.loads(unseal(data, str(f)))
            doc.pop("created")
            for entry in doc["files"].values():
                entry["index"].pop("crc32")
            data = json.dumps(doc, sort_keys=True).encode()
        out[f.name.replace(man.save_id, "ID")] = data.replace(sid, b"ID")
    return out


def test_drained_checkpoint_equals_a_direct_save(tmp_path: Path, shm: Path) -> None:
    for drain in ("thread", "process"):
        tiered = CheckpointManager(tmp_path / drain / "tiered", memory=tier(shm, durable_every=3, drain=drain))
        direct = CheckpointManager(tmp_path / drain / "direct")
        st = state(3.0, 300_000)
        tiered.save(st, 3, metrics={"loss": 1.5})
        tiered.wait()
        direct.save(st, 3, metrics={"loss": 1.5})
        a, b = _normalised(tmp_path / drain / "tiered" / "step-00000003"), _normalised(tmp_path / drain / "direct" / "step-00000003")
        assert a == b and len(a) == 3, drain
        assert (tmp_path / drain / "tiered" / "latest").read_bytes() == (tmp_path / drain / "direct" / "latest").read_bytes()
        snap = Path(tiered._tiers.area.dir) / "step-00000003"  # type: ignore[union-attr]
        for f in snap.iterdir():  # the durable files are the snapshot's, byte for byte
            assert (tmp_path / drain / "tiered" / "step-00000003" / f.name).read_bytes() == f.read_bytes()
        tiered._tiers.close()  # type: ignore[union-attr]


@contextlib.contextmanager
def small_tmpfs(path: Path, size: str) -> Iterator[Path]:
    path.mkdir(parents=True)
    got = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(path)],
                         capture_output=True, text=True, timeout=30)
    if got.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs to fill ({got.stderr.strip() or got.returncode}); needs root")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True, timeout=30)


def test_full_shared_memory_skips_snapshots_not_training(tmp_path: Path) -> None:
    """A 2 MiB tmpfs holds one snapshot of a 1.2 MB state, not two: later snapshots are
    skipped with a warning, steps due for durability are saved directly, the run finishes."""
    with small_tmpfs(tmp_path / "tmpfs", "2m") as small:
        mgr = CheckpointManager(tmp_path / "root", memory=tier(small, durable_every=3))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            train(mgr, range(1, 8), n=75_000)
        skipped = mgr._tiers.skipped  # type: ignore[union-attr]
        assert skipped and 1 not in skipped, skipped
        assert any("skipped: shared memory" in str(w.message) for w in caught)
        assert [i.step for i in mgr.list()] == [3, 6]
        for i in mgr.list():
            assert verify(i.path).ok
        target = state(0.0, 75_000)
        report = CheckpointManager(tmp_path / "root", memory=tier(small, durable_every=3)).restore(target)
        assert report is not None and report.step is not None and report.step >= 6
        assert torch.equal(target["w"], state(float(report.step), 75_000)["w"])  # type: ignore[arg-type]


def test_ls_shows_the_tiers(tmp_path: Path, shm: Path) -> None:
    from shardpoint.cli import main

    mgr = CheckpointManager(tmp_path / "root", memory=tier(shm))
    train(mgr, range(1, 7))
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(["ls", str(tmp_path / "root"), "--json", "--memory-path", str(shm)]) == 0
    rows = json.loads(buf.getvalue())
    assert [(r["step"], r["tier"].split(" ")[0], r["status"]) for r in rows] == [
        (5, "durable", "committed"), (5, "memory", "committed"), (6, "memory", "committed")]
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(["ls", str(tmp_path / "root"), "--memory-path", str(shm)]) == 0
    assert "memory" in buf.getvalue() and "durable" in buf.getvalue()


def _open_area(base: str, identity: str, go: object) -> None:
    from shardpoint.tiers.shm import JobArea

    go.wait()  # type: ignore[attr-defined]
    JobArea(base, identity).open()


def test_ranks_opening_the_job_folder_at_once_all_see_it_as_theirs() -> None:
    """Every rank opens the job's folder at the first snapshot, at the same moment: the
    identity file is published whole, so no rank reads it half-written and takes the
    folder for another job's (seen once on a loaded CI machine)."""
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    for trial in range(10):
        base = f"/dev/shm/shardpoint-test-race-{os.getpid()}-{trial}-{os.urandom(4).hex()}"
        try:
            go = ctx.Event()
            procs = [ctx.Process(target=_open_area, args=(base, "run=r\0root=/x", go)) for _ in range(6)]
            for p in procs:
                p.start()
            go.set()
            for p in procs:
                p.join(60)
            assert [p.exitcode for p in procs] == [0] * 6, trial
            assert sorted(os.listdir(os.path.join(base, os.listdir(base)[0]))) == ["job.json"]
        finally:
            shutil.rmtree(base, ignore_errors=True)


def test_old_snapshots_are_freed_in_the_background_with_room(tmp_path: Path, shm: Path) -> None:
    """With room in shared memory, a freed snapshot loses its manifest and leaves its
    step folder at once; its bytes go in a thread (the training process does not wait
    for the unlinks), and nothing of it is left once that thread is done."""
    mgr = CheckpointManager(tmp_path / "root", memory=tier(shm, durable_every=100))
    train(mgr, range(1, 4))
    area = mgr._tiers.area  # type: ignore[union-attr]
    mgr.save(state(4.0), 4)
    assert area._freeing is not None  # step 2 went in the background
    assert 2 not in area.steps()
    area.settle()
    mgr.wait()
    assert area.steps() == [3, 4]
    assert not [n for n in os.listdir(area.dir) if n.startswith(".freeing-")]
    # a process that died while freeing leaves a renamed folder: the next free removes it
    os.makedirs(os.path.join(area.dir, ".freeing-3-1"))
    area.free(2, set())
    assert not [n for n in os.listdir(area.dir) if n.startswith(".freeing-")]
