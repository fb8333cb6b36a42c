"""The error classes a caller catches (issue 33, item 3): each one is documented in
docs/errors.md with an example, and each case below meets its class through the public
calls a user makes (the collective ones on real ranks in tests/distributed/test_commit.py,
test_rank_failing_after_write_leaves_no_manifest: ``RankFailedError`` with ``.rank``)."""

from __future__ import annotations

import inspect
import json
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

import shardpoint
from shardpoint import errors
from shardpoint.format.boxes import Box
from shardpoint.plan import plan_reads
from shardpoint.plan.save import PlanError

ROOT = Path(__file__).resolve().parents[1]
#: Error classes that live beside the code that raises them, documented all the same.
ELSEWHERE = ["RetryOptionError", "DrainAborted", "PlanError"]


def _documented() -> dict[str, str]:
    """docs/errors.md's table: class name -> its row."""
    rows = {}
    for line in (ROOT / "docs" / "errors.md").read_text().splitlines():
        m = re.match(r"\| `(\w+)`", line)
        if m:
            rows[m.group(1)] = line
    return rows


def test_every_error_class_is_documented_with_an_example() -> None:
    classes = [n for n, c in inspect.getmembers(errors, inspect.isclass)
               if issubclass(c, errors.ShardpointError) and c.__module__ == errors.__name__]
    assert sorted(classes) == sorted(errors.__all__)
    rows = _documented()
    assert sorted(set(classes + ELSEWHERE) - set(rows)) == []
    for name in classes + ELSEWHERE:
        cells = [c.strip() for c in rows[name].strip("|").split("|")]
        assert len(cells) == 4 and cells[3], f"{name}: no example in its row: {rows[name]}"


def test_usage_errors_are_also_the_builtin_a_caller_already_catches() -> None:
    assert issubclass(errors.AllocationError, MemoryError)
    assert issubclass(errors.MissingDependencyError, ImportError)
    assert issubclass(errors.ConversionError, errors.CorruptCheckpointError)
    assert issubclass(errors.ObjectStoreError, errors.StorageError)
    assert issubclass(PlanError, errors.UsageError) and issubclass(PlanError, ValueError)
    with pytest.raises(PlanError, match=r"only partly covered") as ei:  # the pure read planner, as it is
        plan_reads([Box((0,), (2,))], [Box((0,), (4,))])
    assert isinstance(ei.value, errors.ShardpointError)


def test_a_rank_failed_error_keeps_the_rank() -> None:
    e = errors.RankFailedError("rank 3 failed: OSError: no space", rank=3)
    assert (e.rank, e.ranks, str(e)) == (3, [3], "rank 3 failed: OSError: no space")
    peers = errors.RankFailedError("a transfer with ranks [1, 2] failed", ranks=[2, 1])
    assert (peers.rank, peers.ranks) == (None, [1, 2])


def test_restore_with_nothing_fit_is_an_unhealthy_checkpoint_error(tmp_path: Path) -> None:
    state = shardpoint.TrainState(model=torch.nn.Linear(2, 2), rng=False)
    mgr = shardpoint.CheckpointManager(tmp_path / "root")
    mgr.save(state, 1)
    mgr.save(state, 2)
    with warnings.catch_warnings(), pytest.raises(
            errors.UnhealthyCheckpointError, match=r"is fit to resume from \(step 2: .*step 1: .*restore\(state, step=N\)"):
        warnings.simplefilter("ignore")
        mgr.restore(state, accept=lambda info: False)
    assert mgr.restore(state, step=2) is not None  # one loads as it is, as the message says


def test_a_memory_tier_on_a_file_is_a_memory_tier_error(tmp_path: Path) -> None:
    f = tmp_path / "afile"
    f.write_text("mine")
    mgr = shardpoint.CheckpointManager(tmp_path / "root", memory=shardpoint.MemoryTier(every=1, durable_every=2,
                                                                                       path=str(f)))
    with pytest.raises(errors.MemoryTierError, match=f"memory tier's folder {f} .*MemoryTier\\(path=...\\)"):
        mgr.save(shardpoint.TrainState(model=torch.nn.Linear(2, 2), rng=False), 1)
    assert f.read_text() == "mine"


def test_a_safetensors_index_storing_a_tensor_twice_is_a_conversion_error(tmp_path: Path) -> None:
    safetensors = pytest.importorskip("safetensors.torch")
    from shardpoint.interop.hf import import_hf

    src = tmp_path / "hf"
    src.mkdir()
    for name in ("a", "b"):
        safetensors.save_file({"w": torch.ones(2)}, str(src / f"{name}.safetensors"))
    (src / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": "a.safetensors",
                                                                                 "v": "b.safetensors"}}))
    with pytest.raises(errors.ConversionError, match=r"b.safetensors: tensor 'w' is stored twice") as ei:
        import_hf(src, tmp_path / "out", progress=False)
    assert isinstance(ei.value, errors.CorruptCheckpointError)
    assert not (tmp_path / "out").exists()


_ALLOC = """
import resource, sys
import shardpoint
vm = int(next(line for line in open("/proc/self/status") if line.startswith("VmSize")).split()[1]) * 1024
resource.setrlimit(resource.RLIMIT_AS, (vm + (32 << 20), resource.getrlimit(resource.RLIMIT_AS)[1]))
try:
    shardpoint.load_full(sys.argv[1])
except shardpoint.errors.AllocationError as e:
    print("caught", isinstance(e, MemoryError), e)
"""


@pytest.mark.timeout(120)
def test_a_tensor_too_large_for_the_memory_left_is_an_allocation_error(tmp_path: Path) -> None:
    """A real allocation failure: the process's address space is capped below the tensor."""
    shardpoint.save({"big": torch.zeros(64 << 20, dtype=torch.uint8)}, tmp_path / "big")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run([sys.executable, "-c", _ALLOC, str(tmp_path / "big")], env=env, capture_output=True,
                         text=True, timeout=100)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("caught True key 'big': cannot allocate a uint8 tensor of shape [67108864]"), out.stdout
    assert "load fewer keys at once" in out.stdout


def _save_after_the_exit_handler_closed_the_channels(rank: int, world: int, root: str) -> dict[str, object]:
    import torch.distributed as dist

    from shardpoint.collective import close_channels

    shardpoint.save({"w": torch.ones(4)}, f"{root}/first")  # the channel exists and works
    dist.barrier()
    close_channels()  # what the exit handler does first while a save may still run on a thread
    try:
        shardpoint.save({"w": torch.ones(4)}, f"{root}/second")
    except errors.ShardpointError as e:
        return {"type": type(e).__name__, "msg": str(e)}
    return {"type": None}


@pytest.mark.distributed
@pytest.mark.timeout(200)
@pytest.mark.parametrize("world", [1, 2])  # one rank: its collectives make no gloo call, and still refuse
def test_a_save_after_the_channels_closed_is_a_channel_closed_error(tmp_path: Path, world: int) -> None:
    from tests._dist import run_ranks

    out = run_ranks(_save_after_the_exit_handler_closed_the_channels, world, str(tmp_path), timeout=150)
    for r in out:
        assert r["type"] == "ChannelClosedError" and "the process is exiting" in str(r["msg"]), out
    assert not (tmp_path / "second" / "manifest.json").exists()
