"""Exactly one writer: an attempt of a job that is frozen (SIGSTOP by PID) while a
newer attempt restores from the same root, saves and exits, then wakes (SIGCONT),
gets :class:`FencedError` on every rank and writes nothing; ``latest`` never goes
back; the newer attempt's checkpoints are neither overwritten nor deleted; every
kept checkpoint loads and verifies; the final restore returns the newer attempt's
values. The same with two attempts alive at once, and on the S3 loopback server.

Each attempt is two real gloo ranks (tests/failure/_attempt.py) filling every tensor
with ``step * 10 + attempt``: attempt A is 1, attempt B is 2."""

from __future__ import annotations

import hashlib
import os
import queue
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

import shardpoint
from shardpoint.load.locate import read_manifest
from shardpoint.storage import Storage, storage_for
from shardpoint.verify import verify
from tests._dist import _context, free_port
from tests.failure import _attempt
from tests.s3server import s3_bucket, s3_endpoint  # noqa: F401 - fixtures

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]

A, B = 1, 2


class Attempt:
    """One attempt: two ranks running ``plan`` on ``root``."""

    def __init__(self, ident: int, root: Any, plan: list[list[Any]], folder: Path,
                 hold: dict[str, Any] | None = None) -> None:
        ctx = _context()
        self.ident, self.folder, self.q = ident, folder, ctx.Queue()
        port = free_port()
        self.procs = [ctx.Process(target=_attempt.main, args=(r, 2, port, root, ident, plan, hold, str(folder), self.q),
                                  daemon=True) for r in range(2)]
        for p in self.procs:
            p.start()

    def pids(self) -> list[int]:
        files = [self.folder / f"pid-{self.ident}-{r}" for r in range(2)]
        _until(lambda: all(f.exists() and f.read_text() for f in files), 60, "the ranks to start")
        return [int(f.read_text()) for f in files]

    def held(self, timeout: float = 120) -> None:
        """Wait until a rank of this attempt is held at its phase."""
        _until(lambda: any((self.folder / f"at-{self.ident}-{r}").exists() for r in range(2)), timeout,
               f"attempt {self.ident} to reach its hold")

    def freeze(self) -> None:
        for pid in self.pids():
            os.kill(pid, signal.SIGSTOP)
        for pid in self.pids():  # stopped for real, not just signalled
            _until(lambda pid=pid: _state(pid).startswith("T"), 10, f"pid {pid} to stop")

    def thaw(self) -> None:
        (self.folder / f"go-{self.ident}").touch()
        for pid in self.pids():
            os.kill(pid, signal.SIGCONT)

    def release(self) -> None:
        (self.folder / f"go-{self.ident}").touch()

    def outcomes(self, timeout: float = 240) -> list[list[str]]:
        """Each rank's outcomes, in rank order (killing the attempt if it overruns)."""
        got: dict[int, list[str]] = {}
        deadline = time.monotonic() + timeout
        try:
            while len(got) < 2:
                try:
                    rank, outs = self.q.get(timeout=max(0.1, min(1.0, deadline - time.monotonic())))
                    got[rank] = outs
                except queue.Empty:
                    if time.monotonic() > deadline:
                        raise AssertionError(f"attempt {self.ident} did not finish: {got}") from None
        finally:
            self.kill()
        for r, outs in got.items():
            assert not any(o.startswith("CRASH") for o in outs), f"attempt {self.ident} rank {r}: {outs}"
        return [got[0], got[1]]

    def kill(self) -> None:
        for p in self.procs:
            if p.is_alive():
                try:
                    os.kill(p.pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass
                p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()


def _state(pid: int) -> str:
    return subprocess.run(["ps", "-o", "stat=", "-p", str(pid)], capture_output=True, text=True).stdout.strip()


def _until(cond: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def _tree(st: Storage) -> dict[str, str]:
    """Every file under the root with a digest of its bytes."""
    return {name: hashlib.sha256(bytes(st.read(name))).hexdigest() for name in st.list()}


def _referenced(st: Storage) -> set[str]:
    """The files the root's committed checkpoints consist of, and its pointer and owners."""
    mgr = shardpoint.CheckpointManager(st)
    out = {n for n in st.list() if n == "latest" or n.startswith("owners/")}
    for info in mgr.list():
        folder = os.path.basename(info.path.rstrip("/"))
        out.add(f"{folder}/manifest.json")
        m = read_manifest(st.child(folder))
        out |= {f"{folder}/{f}" for f in m.stored_files()}
    return out


def _check_root(st: Storage, newest: int) -> dict[str, Any]:
    """Every committed checkpoint verifies and holds one step of one attempt; latest
    is ``newest``; a fresh restore of it gives attempt B's values."""
    mgr = shardpoint.CheckpointManager(st)
    info = mgr.latest()
    assert info is not None and info.step == newest, (info, [i.step for i in mgr.list()])
    held = {}
    for i in mgr.list():
        res = verify(st.child(os.path.basename(i.path.rstrip("/"))))
        assert res.ok, f"step {i.step}: {res.summary()}"
        vals = _attempt.values(shardpoint.load_full(st.child(os.path.basename(i.path.rstrip("/")))))
        assert len(vals) == 1, f"step {i.step} holds {vals}"
        held[i.step] = vals.pop()
    from shardpoint.layout import FlatShard

    state = _attempt.make_state(0, 1)
    state["model"]["w"] = FlatShard(__import__("torch").zeros(2 * _attempt.N), (2 * _attempt.N,), 0)
    report = shardpoint.CheckpointManager(st).restore(state)
    assert report is not None and report.step == newest
    assert _attempt.values(state) == {newest * 10.0 + B}, _attempt.values(state)
    return held


def _fenced(outcome: str) -> bool:
    return outcome.startswith("FencedError: ") and "generation" in outcome and "no longer owns" in outcome


# A: restore, 2, 4, then 6 (held at ``phase``), then 8. B: restore (4), 6, 8, 10, exit.
CASES = {
    "before the commit": ({"phase": "before_commit", "save": 3}, True),
    "after the data is written": ({"phase": "written", "save": 3}, True),
    "between the manifest and latest": ({"phase": "committed", "save": 3}, True),
    "in a background save": ({"phase": "before_commit", "save": 3}, False),
}


def _root(where: str, tmp_path: Path, request: pytest.FixtureRequest) -> tuple[Any, Storage]:
    if where == "local":
        return str(tmp_path / "ckpt"), storage_for(tmp_path / "ckpt")
    server = request.getfixturevalue("s3_endpoint")
    bucket = request.getfixturevalue("s3_bucket")
    url = f"s3://{bucket}/run"
    return {"url": url, "storage_options": server.storage_options}, storage_for(url, server.storage_options)


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("where", ["local", pytest.param("s3", marks=pytest.mark.s3)])
def test_a_frozen_attempt_wakes_fenced(case: str, where: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    hold, blocking = CASES[case]
    root, st = _root(where, tmp_path, request)
    plan_a = [["restore"], ["save", 2, True], ["save", 4, True], ["save", 6, blocking]]
    plan_a += [] if blocking else [["wait"]]
    plan_a += [["save", 8, True]]
    a = Attempt(A, root, plan_a, tmp_path, hold)
    try:
        a.held()
        a.freeze()
        b = Attempt(B, root, [["restore"], ["save", 6, True], ["save", 8, True], ["save", 10, True]], tmp_path)
        out_b = b.outcomes()
        after_b = _tree(st)
        kept_b = {i.step: read_manifest(st.child(os.path.basename(i.path.rstrip("/")))).save_id
                  for i in shardpoint.CheckpointManager(st).list()}
        a.thaw()
        out_a = a.outcomes()
    finally:
        a.kill()
    for r in range(2):
        assert out_b[r] == ["restored 4", "ok", "ok", "ok"], out_b
        assert out_a[r][:3] == ["restored None", "ok", "ok"], out_a
        # the held save (in the background: its wait) and the next save, refused on every rank
        refused = out_a[r][3:] if blocking else out_a[r][4:]
        assert blocking or out_a[r][3] == "ok", out_a[r]  # the background save started
        assert len(refused) == 2 and all(_fenced(o) for o in refused), out_a[r]
    msg = out_a[0][-2]
    assert "generation 1" in msg and "generation 2" in msg and st.url in msg and "nothing was written" in msg, msg
    # nothing the stale attempt did is visible: every file B left is there, unchanged;
    # only files no checkpoint refers to (A's own leftovers) may have gone
    after_a = _tree(st)
    assert {n: h for n, h in after_a.items() if n in after_b} == after_a, set(after_a) - set(after_b)
    gone = set(after_b) - set(after_a)
    assert not gone & _referenced(st), gone
    assert {i.step: read_manifest(st.child(os.path.basename(i.path.rstrip("/")))).save_id
            for i in shardpoint.CheckpointManager(st).list()} == kept_b
    held = _check_root(st, 10)
    # B's steps, and the step B restored from (kept as long as B runs)
    assert held == {4: 4 * 10.0 + A, 8: 8 * 10.0 + B, 10: 10 * 10.0 + B}, held


@pytest.mark.parametrize("where", ["local", pytest.param("s3", marks=pytest.mark.s3)])
def test_two_attempts_alive_at_once(where: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    """A saves odd steps; B starts while A runs, restores and saves even steps. Once B
    claimed the root, every save of A is refused on every rank (and writes nothing),
    B's all commit, and B's are the ones that stay."""
    root, st = _root(where, tmp_path, request)
    plan_a = [["restore"]] + [x for s in range(1, 40, 2) for x in (["save", s, True], ["sleep", 0.3])]
    a = Attempt(A, root, plan_a, tmp_path)
    try:
        _until(lambda: (i := shardpoint.CheckpointManager(st).latest()) is not None and i.step >= 5, 120,
               "attempt A to commit step 5")
        b = Attempt(B, root, [["restore"]] + [x for s in range(42, 52, 2) for x in (["save", s, True], ["sleep", 0.2])],
                    tmp_path)
        out_b = b.outcomes()
        out_a = a.outcomes()
    finally:
        a.kill()
    assert all(o[0].startswith("restored ") for o in out_b), out_b
    restored_b = int(out_b[0][0].split()[1])
    assert restored_b >= 5 and restored_b % 2 == 1, out_b
    for r in range(2):
        assert out_b[r][1:] == ["ok"] * 10, out_b[r]
        saves = out_a[r][1:][::2]  # each save's outcome (a sleep after each)
        fenced = [i for i, o in enumerate(saves) if o != "ok"]
        assert fenced, f"attempt A was never fenced: {saves}"
        assert all(_fenced(o) for o in saves[fenced[0]:]), saves  # once fenced, always fenced
        assert [o.split(":")[0] for o in out_a[r]] == [o.split(":")[0] for o in out_a[0]], out_a  # alike on every rank
    # nothing A wrote stays: every file under the root belongs to a committed checkpoint, latest or owners/
    assert set(st.list()) <= _referenced(st), set(st.list()) - _referenced(st)
    held = _check_root(st, 50)
    assert held[48] == 48 * 10.0 + B and held[50] == 50 * 10.0 + B, held
    assert all(v == s * 10.0 + (B if s >= 42 else A) for s, v in held.items()), held
