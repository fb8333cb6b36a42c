"""DCP in and out: a checkpoint written by ``torch.distributed.checkpoint.save`` on
4 FSDP2 ranks loads through shardpoint on 2, byte for byte; a shardpoint checkpoint
saved on 4 ranks exported to DCP loads with ``dcp.load`` on 3; hostile pickles in
``.metadata`` or in a data blob are refused without running."""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch

from tests._dist import run_ranks

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(240)]


def _fsdp(world: int, seed: int, steps: int) -> tuple[Any, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 13), torch.nn.ReLU(), torch.nn.Linear(13, 5))
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    for i in range(steps):
        torch.manual_seed(100 + i)
        model(torch.randn(4, 6)).square().sum().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def _state(model: Any, opt: Any) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd}


def _full(state: Any, prefix: str = "") -> dict[str, Any]:
    """Every leaf, DTensors gathered (collective), keyed by path."""
    from torch.distributed.tensor import DTensor

    out: dict[str, Any] = {}
    items = state.items() if isinstance(state, dict) else enumerate(state) if isinstance(state, list) else None
    if items is None:
        v = state.full_tensor() if isinstance(state, DTensor) else state
        return {prefix: v.clone() if isinstance(v, torch.Tensor) else v}
    for k, v in items:
        out.update(_full(v, f"{prefix}/{k}"))
    return out


def _save_both(rank: int, world: int, dcp_dir: str, sp_dir: str) -> dict[str, Any] | None:
    import torch.distributed.checkpoint as dcp

    import shardpoint

    model, opt = _fsdp(world, seed=0, steps=2)
    state = _state(model, opt)
    dcp.save(state, checkpoint_id=dcp_dir)
    shardpoint.save(state, sp_dir)
    full = _full(state)
    return full if rank == 0 else None


def _load_shardpoint(rank: int, world: int, path: str) -> dict[str, Any] | None:
    import shardpoint

    model, opt = _fsdp(world, seed=1, steps=1)
    state = _state(model, opt)
    report = shardpoint.load(state, path)
    assert report.missing == [] and report.unexpected == [], report
    full = _full(state)
    return full if rank == 0 else None


def _load_dcp(rank: int, world: int, path: str) -> dict[str, Any] | None:
    import torch.distributed.checkpoint as dcp

    model, opt = _fsdp(world, seed=1, steps=1)
    state = _state(model, opt)
    dcp.load(state, checkpoint_id=path)
    full = _full(state)
    return full if rank == 0 else None


def _assert_same(got: dict[str, Any], ref: dict[str, Any]) -> None:
    assert sorted(got) == sorted(ref)
    for k, v in ref.items():
        if isinstance(v, torch.Tensor):
            g = got[k]
            assert g.dtype == v.dtype and g.shape == v.shape, k
            assert torch.equal(g.view(-1).view(torch.uint8), v.view(-1).view(torch.uint8)), k  # byte for byte
        else:
            assert got[k] == v, k


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, dict[str, Any]]:
    root = tmp_path_factory.mktemp("dcp")
    ref = run_ranks(_save_both, 4, str(root / "dcp"), str(root / "sp"), timeout=180)[0]
    return root / "dcp", root / "sp", ref


def test_dcp_from_4_ranks_loads_through_shardpoint_on_2(saved: tuple[Path, Path, dict[str, Any]], tmp_path: Path) -> None:
    import shardpoint
    from shardpoint.interop import import_dcp

    dcp_dir, _, ref = saved
    assert import_dcp(dcp_dir, tmp_path / "sp", progress=False) == 4
    meta = shardpoint.metadata(tmp_path / "sp")
    assert meta.world_size == 4
    # FSDP2 row blocks stay row blocks: one chunk per old rank that held rows
    assert len(meta.tensors["model/0.weight"].chunks) == 4
    from shardpoint.verify import verify

    assert verify(tmp_path / "sp").ok
    got = run_ranks(_load_shardpoint, 2, str(tmp_path / "sp"), timeout=180)[0]
    _assert_same(got, ref)


def test_shardpoint_from_4_ranks_exports_to_dcp_that_loads_on_3(saved: tuple[Path, Path, dict[str, Any]], tmp_path: Path) -> None:
    from shardpoint.interop import export_dcp

    _, sp_dir, ref = saved
    export_dcp(sp_dir, tmp_path / "dcp", progress=False)
    assert (tmp_path / "dcp" / ".metadata").exists()
    got = run_ranks(_load_dcp, 3, str(tmp_path / "dcp"), timeout=180)[0]
    _assert_same(got, ref)


class _Evil:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> Any:
        return (os.system, (f"touch {self.marker}",))


def test_hostile_metadata_is_refused_without_running(tmp_path: Path) -> None:
    from shardpoint import ShardpointError
    from shardpoint.interop import import_dcp

    marker = tmp_path / "ran"
    (tmp_path / "dcp").mkdir()
    (tmp_path / "dcp" / ".metadata").write_bytes(pickle.dumps(_Evil(str(marker))))
    with pytest.raises(ShardpointError, match=r"refusing to unpickle posix\.system: it is not one of the classes DCP"):
        import_dcp(tmp_path / "dcp", tmp_path / "sp", progress=False)
    assert not marker.exists()
    assert not (tmp_path / "sp").exists()


def test_hostile_value_in_a_data_file_is_refused_without_running(tmp_path: Path) -> None:
    import warnings

    import torch.distributed.checkpoint as dcp

    from shardpoint.interop import import_dcp

    marker = tmp_path / "ran"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.ones(3), "evil": _Evil(str(marker))}, checkpoint_id=tmp_path / "dcp", no_dist=True)
    assert not marker.exists()
    from shardpoint.errors import UnsupportedCheckpointError

    with pytest.raises(UnsupportedCheckpointError, match=r"DCP key 'evil' .* needs pickled code to load \(posix\.system\)"):
        import_dcp(tmp_path / "dcp", tmp_path / "sp", progress=False)
    assert not marker.exists()


def test_single_process_round_trip_keeps_nesting_and_values(tmp_path: Path) -> None:
    import warnings

    import torch.distributed.checkpoint as dcp

    import shardpoint
    from shardpoint.interop import export_dcp, import_dcp

    state = {"model": {"w": torch.randn(4, 3), "b": torch.arange(3.0)}, "it": 7,
             "optim": {"param_groups": [{"lr": 0.1, "params": ["w", "b"], "betas": (0.9, 0.99)}]}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=tmp_path / "a", no_dist=True)
        import_dcp(tmp_path / "a", tmp_path / "sp", progress=False)
        got = shardpoint.load_full(tmp_path / "sp")
        assert got["it"] == 7 and got["optim"] == state["optim"]
        assert torch.equal(got["model"]["w"], state["model"]["w"])
        export_dcp(tmp_path / "sp", tmp_path / "b", progress=False)
        back = {"model": {"w": torch.zeros(4, 3), "b": torch.zeros(3)}, "it": 0, "optim": {"param_groups": [{"lr": 0.0, "params": [], "betas": ()}]}}
        dcp.load(back, checkpoint_id=tmp_path / "b", no_dist=True)
    assert back["it"] == 7 and back["optim"] == state["optim"] and torch.equal(back["model"]["w"], state["model"]["w"])


def test_train_state_checkpoint_exports_without_its_per_rank_rng(tmp_path: Path) -> None:
    import warnings

    import torch.distributed.checkpoint as dcp

    import shardpoint
    from shardpoint.interop import export_dcp

    model = torch.nn.Linear(3, 2)
    shardpoint.save(shardpoint.TrainState(model=model, rng=True, step=4), tmp_path / "sp")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        left = export_dcp(tmp_path / "sp", tmp_path / "dcp", progress=False)
        assert left and all(k.startswith("rng/") for k in left)
        back = {"model": {"weight": torch.zeros(2, 3), "bias": torch.zeros(2)}, "extra": {"step": 0}}
        dcp.load(back, checkpoint_id=tmp_path / "dcp", no_dist=True)
    assert torch.equal(back["model"]["weight"], model.weight.detach()) and back["extra"]["step"] == 4


def test_missing_metadata_names_the_cause(tmp_path: Path) -> None:
    from shardpoint import CheckpointNotFoundError
    from shardpoint.interop import import_dcp

    (tmp_path / "d").mkdir()
    with pytest.raises(CheckpointNotFoundError, match=r"\.metadata is missing"):
        import_dcp(tmp_path / "d", tmp_path / "sp", progress=False)


def _hand_written_dcp(folder: Path, t: torch.Tensor, boxes: list[tuple[int, tuple[int, ...], tuple[int, ...]]]) -> None:
    """A DCP directory made with DCP's own metadata classes: ``boxes`` are
    (writer rank, offsets, sizes) of ``t``, each a torch.save blob in that rank's file."""
    import io

    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    folder.mkdir()
    chunks, storage, files = [], {}, {}
    for rank, off, size in boxes:
        blob = io.BytesIO()
        torch.save(t[tuple(slice(o, o + s) for o, s in zip(off, size))].clone(), blob)
        buf = files.setdefault(rank, bytearray())
        storage[MetadataIndex("w", torch.Size(off))] = _StorageInfo(f"__{rank}_0.distcp", len(buf), len(blob.getvalue()))
        buf += blob.getvalue()
        chunks.append(ChunkStorageMetadata(offsets=torch.Size(off), sizes=torch.Size(size)))
    for rank, buf in files.items():
        (folder / f"__{rank}_0.distcp").write_bytes(bytes(buf))
    md = TensorStorageMetadata(properties=TensorProperties(dtype=t.dtype), size=t.shape, chunks=chunks)
    meta = Metadata(state_dict_metadata={"w": md}, planner_data={"w": ("w",)}, storage_data=storage)
    (folder / ".metadata").write_bytes(pickle.dumps(meta))


@pytest.mark.parametrize("boxes,chunks", [
    ([(0, (0, 0), (2, 6)), (1, (2, 0), (2, 6))], 2),  # row blocks (FSDP2): kept as each rank's shard
    ([(0, (0, 0), (4, 3)), (1, (0, 3), (4, 3))], 1),  # column blocks (tensor parallel): assembled on rank 0
    ([(0, (0, 0), (2, 3)), (0, (0, 3), (2, 3)), (1, (2, 0), (2, 6))], 1),  # a 2-D mesh: two boxes on rank 0
])
def test_boxes_of_any_shape_import_exactly(tmp_path: Path, boxes: list[Any], chunks: int) -> None:
    import shardpoint
    from shardpoint.interop import import_dcp

    t = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    _hand_written_dcp(tmp_path / "dcp", t, boxes)
    assert import_dcp(tmp_path / "dcp", tmp_path / "sp", progress=False) == 2
    assert torch.equal(shardpoint.load_full(tmp_path / "sp")["w"], t)
    assert len(shardpoint.metadata(tmp_path / "sp").tensors["w"].chunks) == chunks
