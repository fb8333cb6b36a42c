"""Incremental checkpoints (CheckpointManager(incremental=True)): unchanged chunks
are stored by reference, every checkpoint still loads, verifies and reshards on
its own, retention keeps exactly the referenced data, and a write the version
counter does not see (``p.data``) is never skipped."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import shardpoint
from shardpoint.cli import main as cli
from shardpoint.layout import FlatShard
from shardpoint.tree import decode_key
from shardpoint.verify import verify
from tests._dist import run_ranks

MiB = 1 << 20


# -- a LoRA-style run on 2 real gloo ranks ------------------------------------------------------
class Lora(nn.Module):
    """A frozen base (~4.7 MB) with a rank-4 adapter."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.base = nn.Sequential(nn.Linear(768, 768), nn.Linear(768, 768))
        self.base.requires_grad_(False)
        self.a = nn.Parameter(torch.randn(4, 768) * 0.01)
        self.b = nn.Parameter(torch.zeros(768, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + x @ self.a.T @ self.b.T


def _train_and_save(rank: int, world: int, root: str, full: str) -> dict[str, Any]:
    model = Lora()
    opt = torch.optim.Adam([model.a, model.b], lr=1e-2)
    mgr = shardpoint.CheckpointManager(root, incremental=True)
    g = torch.Generator().manual_seed(1)  # the same batches on both ranks: the replicas agree
    for step in range(10):
        loss = model(torch.randn(8, 768, generator=g)).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        state = {"model": model.state_dict(), "optim": opt.state_dict(), "step": step}
        mgr.save(state, step)
        shardpoint.save(state, f"{full}/{step}")  # a full save of the same state
    adapter = sum(p.numel() * p.element_size() for p in (model.a, model.b))
    optim = sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values())
    return {"adapter_and_optim": adapter + optim}


def _targets(path: str, rank: int, world: int) -> dict[str, Any]:
    """A state for ``path``'s tensors on ``world`` ranks: big 2-D tensors as flat
    (ZeRO-style) shards of this rank, the rest whole."""
    state: dict[Any, Any] = {}
    for key, t in shardpoint.metadata(path).tensors.items():
        numel = t.shape.numel() if hasattr(t.shape, "numel") else int(torch.Size(t.shape).numel())
        if len(t.shape) == 2 and numel >= world:
            lo, hi = numel * rank // world, numel * (rank + 1) // world
            leaf: Any = FlatShard(torch.zeros(hi - lo, dtype=t.dtype), t.shape, lo)
        else:
            leaf = torch.zeros(t.shape, dtype=t.dtype)
        node = state
        segs = decode_key(key)
        for s in segs[:-1]:
            node = node.setdefault(s, {})
        node[segs[-1]] = leaf
    return state


def _leaves(x: Any, out: dict[str, bytes], prefix: str = "") -> dict[str, bytes]:
    if isinstance(x, dict):
        for k, v in x.items():
            _leaves(v, out, f"{prefix}/{k}")
    else:
        t = x.local if isinstance(x, FlatShard) else x
        out[prefix] = bytes(t.reshape(-1).contiguous().view(torch.uint8).numpy())
    return out


def _load_resharded(rank: int, world: int, root: str, full: str) -> list[str]:
    """Each incremental step and its full twin loaded on ``world`` ranks: the same bytes."""
    bad = []
    for step in range(10):
        inc_path = f"{root}/step-{step:08d}"
        a, b = _targets(inc_path, rank, world), _targets(f"{full}/{step}", rank, world)
        shardpoint.load(a, inc_path, create=False)
        shardpoint.load(b, f"{full}/{step}", create=False)
        if _leaves(a, {}) != _leaves(b, {}):
            bad.append(f"step {step}: rank {rank} of {world} differs")
    return bad


def _step_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.iterdir())


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_lora_on_two_ranks_writes_only_the_adapter(tmp_path: Path) -> None:
    root, full = tmp_path / "inc", tmp_path / "full"
    (res, _) = run_ranks(_train_and_save, 2, str(root), str(full), timeout=180)
    want = res["adapter_and_optim"]
    full_size = _step_bytes(full / "0")
    assert _step_bytes(root / "step-00000000") >= full_size * 0.95  # the first save writes everything
    for step in range(1, 10):
        written = _step_bytes(root / f"step-{step:08d}")  # data files, indexes and the manifest
        assert written <= want * 1.05 + MiB, f"step {step} wrote {written} bytes; adapter + optimizer: {want}"
        assert full_size > 4 * MiB  # so a rewritten base could not pass the bound above
    for step in range(10):
        path = root / f"step-{step:08d}"
        res_v = verify(str(path))
        assert res_v.ok, res_v.summary()
        a, b = shardpoint.load_full(str(path)), shardpoint.load_full(str(full / str(step)))  # 1 rank
        assert _leaves(a["model"], {}) == _leaves(b["model"], {}) and _leaves(a["optim"]["state"], {}) == \
            _leaves(b["optim"]["state"], {})
        assert a["step"] == step
    assert shardpoint.metadata(str(root / "step-00000009")).referenced > 4 * MiB
    bad = run_ranks(_load_resharded, 3, str(root), str(full), timeout=180)  # 3 ranks, resharded
    assert not [b for r in bad for b in r]


# -- single process ------------------------------------------------------------------------------
def _data_files(root: Path) -> set[str]:
    return {f"{p.parent.name}/{p.name}" for p in root.glob("step-*/*.safetensors")}


def _expected(root: Path) -> set[str]:
    """Own data files of the committed checkpoints plus every file they refer to."""
    out = set()
    for man in root.glob("step-*/manifest.json"):
        m = shardpoint.format.Manifest.parse(man.read_bytes())
        out |= {f"{man.parent.name}/{f}" for f in m.files}
        out |= {r.removeprefix("../") for r in m.refs}
    return out


def test_retention_keeps_exactly_the_referenced_data(tmp_path: Path) -> None:
    frozen, head = torch.randn(256, 1024), torch.zeros(64)
    orig = frozen.clone()
    state = {"frozen": frozen, "head": head, "step": 0}
    mgr = shardpoint.CheckpointManager(tmp_path, keep_last=2, incremental=True)
    for step in range(10):
        head.fill_(step)
        state["step"] = step
        if step == 6:
            frozen.mul_(2)  # changes once: from step 6 on, references go to step 6's file
        mgr.save(state, step)
        assert [i.step for i in mgr.list()] == [max(0, step - 1), step][-min(step + 1, 2):]
        assert _data_files(tmp_path) == _expected(tmp_path)
        for info in mgr.list():
            got = shardpoint.load_full(info.path)
            assert int(got["head"][0]) == got["step"] == info.step
            assert torch.equal(got["frozen"], orig * 2 if info.step >= 6 else orig)
    # step 0's data went with its last referrer; step 6 is dropped by the policy but its data stays
    assert _data_files(tmp_path) == {"step-00000006/" + os.listdir(tmp_path / "step-00000006")[0]} | {
        f"step-0000000{s}/{f}" for s in (8, 9) for f in os.listdir(tmp_path / f"step-0000000{s}") if f.endswith("tensors")}
    assert not (tmp_path / "step-00000000").exists()


def test_keep_last_one(tmp_path: Path) -> None:
    frozen = torch.randn(1000)
    mgr = shardpoint.CheckpointManager(tmp_path, keep_last=1, incremental=True)
    for step in range(4):
        mgr.save({"frozen": frozen, "step": step}, step)
        assert [i.step for i in mgr.list()] == [step]
        assert torch.equal(shardpoint.load_full(mgr.latest().path)["frozen"], frozen)
    assert mgr.latest().referenced == frozen.numel() * 4 and _data_files(tmp_path) == _expected(tmp_path)


def test_mutation_through_data_is_never_skipped(tmp_path: Path) -> None:
    """``p.data.add_`` does not bump ``p._version`` (checked here), so the version
    proof would hold: the design never skips reading the bytes, and their CRCs differ."""
    p = nn.Parameter(torch.randn(512, 512), requires_grad=False)
    mgr = shardpoint.CheckpointManager(tmp_path, incremental=True)
    mgr.save({"p": p}, 0)
    mgr.save({"p": p}, 1)
    assert mgr.latest().referenced == p.numel() * 4  # unchanged: referenced
    v = p._version
    p.data[100, 7] += 1.0  # one element of one block
    assert p._version == v, "torch now bumps the version through .data; the test's premise changed"
    mgr.save({"p": p}, 2)
    info = mgr.latest()
    assert info.referenced == 0 and info.size >= p.numel() * 4  # written again, not referenced
    assert torch.equal(shardpoint.load_full(info.path)["p"], p.detach())


def test_unchanged_without_version_proof_is_referenced_after_a_digest(tmp_path: Path) -> None:
    """A tensor rebuilt each save (no version proof): equal bytes are referenced only
    once a 128-bit digest of them is on record (the save after it is first seen
    equal), never on a CRC match alone."""
    mgr = shardpoint.CheckpointManager(tmp_path, incremental=True)
    seen = []
    for step in range(3):
        mgr.save({"t": torch.arange(300_000, dtype=torch.float32)}, step)  # a new tensor each time
        seen.append(mgr.latest().referenced)
    assert seen == [0, 0, 300_000 * 4]


def test_export_is_self_contained_and_cli_shows_bytes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "root"
    frozen = torch.randn(100_000)
    mgr = shardpoint.CheckpointManager(root, keep_last=1, incremental=True)
    for step in range(3):
        mgr.save({"frozen": frozen, "step": torch.tensor(step)}, step)
    dst = tmp_path / "copy"
    assert cli(["export", str(root / "step-00000002"), str(dst)]) == 0
    shutil.rmtree(root)  # nothing of the source is needed any more
    assert b'"refs"' not in (dst / "manifest.json").read_bytes()
    assert shardpoint.metadata(str(dst)).referenced == 0
    got = shardpoint.load_full(str(dst))
    assert torch.equal(got["frozen"], frozen) and int(got["step"]) == 2
    assert verify(str(dst)).ok
    (ix,) = [json.loads(p.read_bytes())["chunks"] for p in dst.glob("*.index.json")]
    assert ix["frozen@0"][0] % 64 == 0 and ix["step@"][0] == ix["frozen@0"][0] + 400_000  # aligned as a save lays it out
    # ls and info show own and referenced bytes
    mgr = shardpoint.CheckpointManager(root, incremental=True)
    mgr.save({"frozen": frozen}, 0)
    mgr.save({"frozen": frozen}, 1)
    capsys.readouterr()
    assert cli(["ls", "--json", str(root)]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["step"], r["referenced"]) for r in rows] == [(0, 0), (1, 400_000)]
    assert cli(["info", str(root / "step-00000001")]) == 0
    assert "by reference" in capsys.readouterr().out
    out = mgr.export(tmp_path / "copy2", 1)
    assert shardpoint.metadata(out).referenced == 0 and verify(out).ok


def test_base_deleted_by_hand_fails_the_save_then_recovers(tmp_path: Path) -> None:
    frozen = torch.randn(10_000)
    mgr = shardpoint.CheckpointManager(tmp_path, incremental=True)
    mgr.save({"frozen": frozen}, 0)
    shutil.rmtree(tmp_path / "step-00000000")
    with pytest.raises(shardpoint.ShardpointError, match="step-00000000/r00000-.*missing"):
        mgr.save({"frozen": frozen}, 1)
    assert mgr.list() == []
    mgr.save({"frozen": frozen}, 1)  # the failed save forgot the base: this one writes everything
    assert torch.equal(shardpoint.load_full(mgr.latest().path)["frozen"], frozen)


def test_plain_save_and_default_manager_write_no_references(tmp_path: Path) -> None:
    frozen = torch.randn(10_000)
    mgr = shardpoint.CheckpointManager(tmp_path)
    mgr.save({"frozen": frozen}, 0)
    mgr.save({"frozen": frozen}, 1)
    assert [i.referenced for i in mgr.list()] == [0, 0]
    assert b'"refs"' not in (tmp_path / "step-00000001" / "manifest.json").read_bytes()


def test_a_crash_inside_retention_leaves_no_manifest_referring_to_removed_data(tmp_path: Path) -> None:
    """Retention drops an older step whose data a newer doomed step refers to: every
    doomed manifest goes before any file, so a crash between two folders (here: an
    error at the first folder dropped) leaves every checkpoint that still has a
    manifest loadable, never one that refers to a removed file."""
    from shardpoint.runtime import PROCESS

    frozen = torch.randn(4096)
    state = {"frozen": frozen, "step": 0}
    mgr = shardpoint.CheckpointManager(tmp_path, incremental=True)
    for step in range(3):
        state["step"] = step
        if step == 2:
            frozen.mul_(2)  # step 1 refers to step 0's file; step 2 writes its own
        mgr.save(state, step)
    assert mgr.list()[1].referenced > 0

    def crash(phase: str) -> None:
        if phase == "dropped":
            raise OSError("injected: the process dies between two folders")

    PROCESS.seams.phase = crash
    state["step"] = 3
    try:  # a new attempt keeping one step drops steps 0, 1 and 2 after saving 3 (its first save: no references)
        with pytest.warns(UserWarning, match="injected"):  # retention's failure is warned; the save committed
            shardpoint.CheckpointManager(tmp_path, keep_last=1, incremental=True).save(state, 3)
    finally:
        PROCESS.seams.phase = None
    left = [d for d in sorted(os.listdir(tmp_path)) if (tmp_path / d / "manifest.json").exists()]
    for d in left:  # whatever is left committed loads, its references included
        assert shardpoint.load_full(tmp_path / d)["step"] == int(d.split("-")[1])
    assert left == ["step-00000003"], left  # none of the doomed steps is left committed
