"""Reshard on real gloo ranks: FSDP2 4 -> 2, 3, 1, 4; Shard(0) -> Shard(1);
replicated <-> sharded; 2-D mesh (2x2) -> 1-D mesh of 3; a single-process load of
a 4-rank checkpoint. Byte-exact, in place, and reading only the bytes needed."""

from __future__ import annotations

import pytest
import torch

import shardpoint
from tests._dist import run_ranks

pytestmark = pytest.mark.distributed
BATCH = 12  # divisible by 1, 2, 3 and 4 ranks


def make_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    # odd row counts give uneven FSDP shards on 3 and 4 ranks
    return torch.nn.Sequential(torch.nn.Linear(8, 10), torch.nn.ReLU(), torch.nn.Linear(10, 7), torch.nn.Linear(7, 3))


def batch(rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(123)
    x, y = torch.randn(BATCH, 8, generator=g), torch.randn(BATCH, 3, generator=g)
    n = BATCH // world
    return x[rank * n : (rank + 1) * n], y[rank * n : (rank + 1) * n]


def fsdp(seed: int, world: int):  # type: ignore[no-untyped-def]
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    model = make_model(seed)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, opt


def train_step(model, opt, rank: int, world: int) -> None:  # type: ignore[no-untyped-def]
    x, y = batch(rank, world)
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()


def full_state(model, opt) -> dict[str, torch.Tensor]:  # type: ignore[no-untyped-def]
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    out = {f"model/{k}": v.full_tensor().clone() for k, v in msd.items()}
    for fqn, st in osd["state"].items():
        for name, v in st.items():
            out[f"optim/{fqn}/{name}"] = v.full_tensor().clone() if hasattr(v, "full_tensor") else v.clone()
    return out


def save_fsdp(rank: int, world: int, path: str) -> dict[str, torch.Tensor] | None:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, opt = fsdp(0, world)
    train_step(model, opt, rank, world)
    msd, osd = get_state_dict(model, opt)
    shardpoint.save({"model": msd, "optim": osd}, path)
    before = full_state(model, opt)
    train_step(model, opt, rank, world)  # the uninterrupted run's next step
    after = full_state(model, opt)
    return {"before": before, "after": after} if rank == 0 else None


def load_fsdp(rank: int, world: int, path: str) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, opt = fsdp(1, world)  # different init: the load must overwrite everything
    train_step(model, opt, rank, world)  # creates the optimizer state to load into
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    locals_ = [(k, v) for k, v in msd.items()] + [
        (f"{fqn}/{n}", v) for fqn, st in osd["state"].items() for n, v in st.items() if isinstance(v, torch.Tensor)
    ]
    ptrs = {k: (v.to_local() if hasattr(v, "to_local") else v).data_ptr() for k, v in locals_}
    needed = sum(
        (v.to_local() if hasattr(v, "to_local") else v).numel() * v.element_size() for _k, v in locals_
    )
    report = shardpoint.load(state, path, verify=False)
    ptrs_after = {k: (v.to_local() if hasattr(v, "to_local") else v).data_ptr() for k, v in locals_}
    set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
    loaded = full_state(model, opt)
    train_step(model, opt, rank, world)
    stepped = full_state(model, opt)
    report2 = shardpoint.load(state, path)  # verified: reads whole CRC blocks
    return {
        "loaded": loaded, "stepped": stepped, "same_ptrs": ptrs == ptrs_after, "bytes_read": report.bytes_read,
        "needed": needed, "bytes_read_verified": report2.bytes_read, "report": report,
    }


@pytest.fixture(scope="module")
def fsdp_ckpt(tmp_path_factory):  # type: ignore[no-untyped-def]
    path = str(tmp_path_factory.mktemp("fsdp") / "ckpt")
    out = run_ranks(save_fsdp, 4, path, timeout=180)
    return path, out[0]


@pytest.mark.parametrize("world", [2, 3, 4])
def test_fsdp2_reshard(fsdp_ckpt, world: int) -> None:  # type: ignore[no-untyped-def]
    path, ref = fsdp_ckpt
    results = run_ranks(load_fsdp, world, path, timeout=180)
    for r, res in enumerate(results):
        assert res["same_ptrs"], f"rank {r}: a target tensor was replaced instead of filled in place"
        assert res["bytes_read"] == res["needed"], f"rank {r} read {res['bytes_read']} bytes, its targets need {res['needed']}"
        assert res["bytes_read_verified"] >= res["needed"]
        assert not res["report"].missing and not res["report"].created
    for key, want in ref["before"].items():
        got = results[0]["loaded"][key]
        assert got.dtype == want.dtype and torch.equal(got, want), f"{key} differs after loading on {world} ranks"
    for key, want in ref["after"].items():
        got = results[0]["stepped"][key]
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=f"{key}: next step differs on {world} ranks")


def test_fsdp2_checkpoint_in_one_process(fsdp_ckpt) -> None:  # type: ignore[no-untyped-def]
    path, ref = fsdp_ckpt
    full = shardpoint.load_full(path)
    for key, want in ref["before"].items():
        top, rest = key.split("/", 1)
        if top == "model":
            assert torch.equal(full["model"][rest], want)
        else:
            fqn, name = rest.rsplit("/", 1)
            assert torch.equal(torch.as_tensor(full["optim"]["state"][fqn][name]), want)
    # and load() without torch.distributed into plain full tensors, in place
    model = make_model(5)
    sd = model.state_dict()
    ptrs = {k: v.data_ptr() for k, v in sd.items()}
    report = shardpoint.load({"model": sd}, path, only=["model"])
    assert {k: v.data_ptr() for k, v in sd.items()} == ptrs
    assert report.skipped and all(k.startswith("optim/") for k in report.skipped)
    for k, v in sd.items():
        assert torch.equal(v, ref["before"][f"model/{k}"])


# --- plain DTensor layouts ---------------------------------------------------------

def _global(shape: tuple[int, ...]) -> torch.Tensor:
    return torch.arange(int(torch.tensor(shape).prod()), dtype=torch.float32).reshape(shape) * 0.5 + 1


def save_layouts(rank: int, world: int, path: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh1 = init_device_mesh("cpu", (world,))
    mesh2 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    state = {
        "rows": distribute_tensor(_global((9, 5)), mesh1, [Shard(0)]),
        "rep": distribute_tensor(_global((6, 4)), mesh1, [Replicate()]),
        "plain": _global((3, 3)),  # replicated plain tensor
        "grid": distribute_tensor(_global((7, 6)), mesh2, [Shard(0), Shard(1)]),
        "mixed": distribute_tensor(_global((5, 6)), mesh2, [Replicate(), Shard(1)]),
    }
    shardpoint.save(state, path)


def load_layouts(rank: int, world: int, path: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    z = lambda s, p: distribute_tensor(torch.zeros(s), mesh, p)  # noqa: E731
    state = {
        "rows": z((9, 5), [Shard(1)]),  # Shard(0) -> Shard(1)
        "rep": z((6, 4), [Shard(0)]),  # replicated -> sharded
        "plain": z((3, 3), [Shard(0)]),
        "grid": z((7, 6), [Shard(0)]),  # 2-D mesh (2x2) -> 1-D mesh
        "mixed": z((5, 6), [Replicate()]),  # sharded -> replicated
    }
    shardpoint.load(state, path)
    return {k: v.full_tensor() for k, v in state.items()}


@pytest.mark.parametrize("world", [3])
def test_dtensor_layouts(tmp_path, world: int) -> None:  # type: ignore[no-untyped-def]
    path = str(tmp_path / "ckpt")
    run_ranks(save_layouts, 4, path)
    out = run_ranks(load_layouts, world, path)
    shapes = {"rows": (9, 5), "rep": (6, 4), "plain": (3, 3), "grid": (7, 6), "mixed": (5, 6)}
    for r in range(world):
        for k, s in shapes.items():
            assert torch.equal(out[r][k], _global(s)), f"rank {r}: {k}"
    full = shardpoint.load_full(path)
    for k, s in shapes.items():
        assert torch.equal(full[k], _global(s))
    meta = shardpoint.metadata(path)
    assert meta.world_size == 4 and len(meta.tensors["grid"].chunks) == 4 and len(meta.tensors["rep"].chunks) == 1
