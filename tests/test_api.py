"""save / load / load_full / metadata in one plain process, without
torch.distributed: every kind of leaf, in-place loads, seed 003 (lazily absent
keys), strictness and only/exclude, Stateful objects, overwrite, and data files
that safetensors opens."""

from __future__ import annotations

import copy
import json
import math
import os
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch

import shardpoint
from shardpoint import CheckpointNotFoundError, CorruptCheckpointError, KeyMismatchError, ShardpointError
from shardpoint.layout import FlatShard
from shardpoint.tree import walk
from tests.failure._util import sealed

# dtypes safetensors names; the rest are stored as raw bytes ("U8") with the true dtype in the manifest
SAFETENSORS_DTYPES = [
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
    torch.int8, torch.uint8, torch.bool, torch.uint16, torch.uint32, torch.uint64,
    torch.float8_e4m3fn, torch.float8_e5m2,
]
BYTES_DTYPES = [torch.complex64, torch.complex128, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz]


def sample(dtype: torch.dtype, shape: tuple[int, ...] = (3, 5), seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * 7
    if dtype == torch.bool:
        return x > 0
    if dtype.is_complex:
        return torch.complex(x, x.flip(-1) if x.dim() else x).to(dtype)
    if dtype in (torch.uint8, torch.uint16, torch.uint32, torch.uint64):
        return x.abs().to(dtype)
    return x.to(dtype)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaN-safe, and for dtypes without comparison kernels)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return a.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() == b.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


PLAIN = {
    "none": None, "true": True, "false": False, "int": 3, "neg": -7, "big": 2**100 + 1, "negbig": -(2**70),
    "float": 0.1, "inf": math.inf, "ninf": -math.inf, "nan": math.nan, "negzero": -0.0, "tiny": 5e-324,
    "str": "héllo/%2F", "empty_str": "", "bytes": b"\x00\xff\x80", "empty_bytes": b"",
}


def full_state() -> dict:
    return {
        "tensors": {str(dt).removeprefix("torch."): sample(dt, seed=i) for i, dt in enumerate(SAFETENSORS_DTYPES + BYTES_DTYPES)},
        "shapes": {"scalar": torch.tensor(2.5), "empty": torch.zeros(0, 3), "vec": torch.arange(7, dtype=torch.int64),
                   "4d": sample(torch.float32, (2, 1, 3, 2))},
        "numpy": {"f32": np.arange(6, dtype=np.float32).reshape(2, 3), "i16": np.arange(-2, 2, dtype=np.int16),
                  "bool": np.array([True, False])},
        "plain": dict(PLAIN),
        "nested": (1, [2, (3.5, "x", None)], {"k": torch.ones(2), 0: "int key", "0": "str key"}),
        "": {"a/b": torch.full((2,), 4.0)},
    }


def zero_like(state):  # type: ignore[no-untyped-def]
    """The same structure with every tensor zeroed and every plain value changed."""
    if isinstance(state, torch.Tensor):
        return torch.zeros_like(state)
    if isinstance(state, np.ndarray):
        return np.zeros_like(state)
    if isinstance(state, dict):
        return {k: zero_like(v) for k, v in state.items()}
    if isinstance(state, list):
        return [zero_like(v) for v in state]
    if isinstance(state, tuple):
        return tuple(zero_like(v) for v in state)
    return "placeholder"


def assert_same(got, want, where: str = "") -> None:  # type: ignore[no-untyped-def]
    assert type(got) is type(want), f"{where}: {type(got).__name__} != {type(want).__name__}"
    if isinstance(want, torch.Tensor):
        assert same_bytes(got, want), f"{where}: tensors differ"
    elif isinstance(want, np.ndarray):
        assert got.dtype == want.dtype and np.array_equal(got, want), where
    elif isinstance(want, dict):
        assert list(got) == list(want) or set(got) == set(want), f"{where}: keys {list(got)} != {list(want)}"
        for k in want:
            assert_same(got[k], want[k], f"{where}/{k}")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_same(g, w, f"{where}/{i}")
    elif isinstance(want, float) and math.isnan(want):
        assert math.isnan(got), where
    elif isinstance(want, float):
        assert got == want and math.copysign(1, got) == math.copysign(1, want), f"{where}: {got!r} != {want!r}"
    else:
        assert got == want, f"{where}: {got!r} != {want!r}"


def tensors_of(state, prefix: str = ""):  # type: ignore[no-untyped-def]
    if isinstance(state, torch.Tensor):
        yield prefix, state
    elif isinstance(state, dict):
        for k, v in state.items():
            yield from tensors_of(v, f"{prefix}/{k}")
    elif isinstance(state, (list, tuple)):
        for i, v in enumerate(state):
            yield from tensors_of(v, f"{prefix}/{i}")


# --- round trips --------------------------------------------------------------------

def test_round_trip_every_leaf_kind_in_place(tmp_path: Path) -> None:
    state = full_state()
    shardpoint.save(state, tmp_path / "ckpt")
    target = zero_like(state)
    ptrs = {k: t.data_ptr() for k, t in tensors_of(target)}
    objs = {k: t for k, t in tensors_of(target)}
    report = shardpoint.load(target, tmp_path / "ckpt")
    assert_same(target, state)
    assert {k: t.data_ptr() for k, t in tensors_of(target)} == ptrs, "a tensor was replaced instead of filled"
    assert all(t is objs[k] for k, t in tensors_of(target))
    assert not report.missing and not report.created and not report.unexpected and not report.skipped
    assert "plain/nan" in report.loaded and "%/a%2Fb" in report.loaded and "nested/2/%30" in report.loaded
    assert report.world_size == 1


def test_load_full_rebuilds_everything(tmp_path: Path) -> None:
    state = full_state()
    shardpoint.save(state, tmp_path / "ckpt")
    assert_same(shardpoint.load_full(tmp_path / "ckpt"), state)


def test_root_may_be_a_single_tensor_or_list(tmp_path: Path) -> None:
    t = sample(torch.float32)
    shardpoint.save(t, tmp_path / "t")
    target = torch.zeros_like(t)
    shardpoint.load(target, tmp_path / "t")
    assert torch.equal(target, t)
    assert torch.equal(shardpoint.load_full(tmp_path / "t"), t)
    shardpoint.save([t, 1], tmp_path / "l")
    target = [torch.zeros_like(t), 0]
    report = shardpoint.load(target, tmp_path / "l")
    assert torch.equal(target[0], t) and target[1] == 1 and report.loaded == ["0", "1"]


def test_noncontiguous_and_view_tensors(tmp_path: Path) -> None:
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    state = {"t": base.t(), "slice": base[1:3, ::2], "exp": torch.ones(1, 3).expand(4, 3)}
    shardpoint.save(state, tmp_path / "ckpt")
    target = {"t": torch.zeros(6, 4).t().contiguous().t(), "slice": torch.zeros(2, 3), "exp": torch.zeros(4, 3)}
    ptr = target["t"].data_ptr()
    shardpoint.load(target, tmp_path / "ckpt")
    for k in state:
        assert torch.equal(target[k], state[k]), k
    assert target["t"].data_ptr() == ptr and not target["t"].is_contiguous()


def test_dtype_of_target_is_kept_and_reported_as_cast(tmp_path: Path) -> None:
    shardpoint.save({"w": torch.tensor([1.5, 2.5])}, tmp_path / "ckpt")
    target = {"w": torch.zeros(2, dtype=torch.float64)}
    report = shardpoint.load(target, tmp_path / "ckpt")
    assert target["w"].dtype == torch.float64 and target["w"].tolist() == [1.5, 2.5]
    assert report.cast == ["w"]


def test_flat_shard_in_one_process(tmp_path: Path) -> None:
    """A ZeRO-style flat partition held whole by one process round-trips in place."""
    w = sample(torch.float32, (3, 4))
    buf = w.reshape(-1).clone()
    shardpoint.save({"w": FlatShard(buf, (3, 4), 0)}, tmp_path / "ckpt")
    assert torch.equal(shardpoint.load_full(tmp_path / "ckpt")["w"], w)
    out = torch.zeros(12)
    shardpoint.load({"w": FlatShard(out, (3, 4), 0)}, tmp_path / "ckpt")
    assert torch.equal(out, buf)
    with pytest.raises(ShardpointError, match="'half'.*gap"):
        shardpoint.save({"half": FlatShard(buf[:5], (3, 4), 0)}, tmp_path / "half")
    assert not (tmp_path / "half" / "manifest.json").exists()


def test_meta_device_target_raises_naming_the_key(tmp_path: Path) -> None:
    shardpoint.save({"model": {"w": torch.ones(3), "b": torch.ones(1)}}, tmp_path / "ckpt")
    target = {"model": {"w": torch.empty(3, device="meta"), "b": torch.zeros(1)}}
    with pytest.raises(KeyMismatchError, match=r"'model/w' is on the meta device"):
        shardpoint.load(target, tmp_path / "ckpt")
    assert target["model"]["b"].item() == 0, "nothing may be loaded when the load is refused"
    with pytest.raises(ShardpointError, match=r"'model/w' is on the meta device"):
        shardpoint.save({"model": {"w": torch.empty(3, device="meta")}}, tmp_path / "meta")


def test_unsupported_leaf_is_refused_naming_the_key(tmp_path: Path) -> None:
    with pytest.raises(ShardpointError, match=r"'a/x' holds a builtins.set"):
        shardpoint.save({"a": {"x": {1, 2}}}, tmp_path / "ckpt")
    with pytest.raises(ShardpointError, match="dict key of type float"):
        shardpoint.save({"a": {1.5: 1}}, tmp_path / "ckpt")
    assert not (tmp_path / "ckpt" / "manifest.json").exists()


# --- seed 003: keys the local state lacks ----------------------------------------------

def test_seed_003_lazily_absent_key_is_created(tmp_path: Path) -> None:
    dl_state = {"dl_state": {"data": {"a": "b"}}}
    shardpoint.save(dl_state, tmp_path / "ckpt")
    loaded = copy.deepcopy(dl_state)
    loaded["dl_state"].pop("data")
    report = shardpoint.load(loaded, tmp_path / "ckpt")
    assert loaded == {"dl_state": {"data": {"a": "b"}}}
    assert "data" in loaded["dl_state"] and "a" in loaded["dl_state"]["data"]
    assert report.created == ["dl_state/data/a"]
    assert report.loaded == [] and report.unexpected == [] and report.missing == []


def test_seed_003_create_false_reports_unexpected(tmp_path: Path) -> None:
    shardpoint.save({"dl_state": {"data": {"a": "b"}}}, tmp_path / "ckpt")
    loaded: dict = {"dl_state": {}}
    report = shardpoint.load(loaded, tmp_path / "ckpt", create=False)
    assert loaded == {"dl_state": {}}
    assert report.unexpected == ["dl_state/data/a"] and report.created == []


def test_created_tensors_and_containers_keep_their_saved_types(tmp_path: Path) -> None:
    state = {"opt": {"state": {0: {"exp_avg": torch.arange(3.0), "step": torch.tensor(4.0)}}, "hist": [1, (2, 3)]}}
    shardpoint.save(state, tmp_path / "ckpt")
    target: dict = {"opt": {}}
    report = shardpoint.load(target, tmp_path / "ckpt")
    assert_same(target, state)
    assert report.created == ["opt/hist/0", "opt/hist/1/0", "opt/hist/1/1", "opt/state/0/exp_avg", "opt/state/0/step"]


def test_empty_str_key_is_not_the_root(tmp_path: Path) -> None:
    state = {"": {"": torch.ones(2)}, "x": 1}
    shardpoint.save(state, tmp_path / "ckpt")
    assert sorted(shardpoint.metadata(tmp_path / "ckpt").tensors) == ["%/%"]
    target: dict = {"x": 0}
    report = shardpoint.load(target, tmp_path / "ckpt")
    assert report.created == ["%/%"] and torch.equal(target[""][""], torch.ones(2)) and target["x"] == 1


# --- strictness and selection -----------------------------------------------------------

def model_state(seed: int) -> dict:
    return {
        "model": {"w": sample(torch.float32, (4, 3), seed), "b": sample(torch.float32, (3,), seed + 1)},
        "model_ema": {"w": sample(torch.float32, (4, 3), seed + 2)},
        "optim": {"state": {"w": {"exp_avg": sample(torch.float32, (4, 3), seed + 3)}}, "lr": 0.1 * (seed + 1)},
    }


def test_strict_load_names_missing_keys(tmp_path: Path) -> None:
    shardpoint.save(model_state(0), tmp_path / "ckpt")
    target = model_state(1)
    target["model"]["extra"] = torch.zeros(2)
    before = copy.deepcopy(target)
    with pytest.raises(KeyMismatchError, match=r"\['model/extra'\]"):
        shardpoint.load(target, tmp_path / "ckpt")
    assert_same(target, before)  # refused before anything was modified
    report = shardpoint.load(target, tmp_path / "ckpt", strict=False)
    assert report.missing == ["model/extra"] and torch.equal(target["model"]["extra"], torch.zeros(2))
    assert torch.equal(target["model"]["w"], model_state(0)["model"]["w"])


def test_only_model_leaves_optimizer_untouched(tmp_path: Path) -> None:
    saved = model_state(0)
    shardpoint.save(saved, tmp_path / "ckpt")
    target = model_state(1)
    other = copy.deepcopy(target)
    report = shardpoint.load(target, tmp_path / "ckpt", only=["model"])
    assert_same(target["model"], saved["model"])
    assert_same(target["optim"], other["optim"])
    assert_same(target["model_ema"], other["model_ema"]), "only=['model'] must not match 'model_ema'"
    assert report.loaded == ["model/b", "model/w"]
    assert report.skipped == ["model_ema/w", "optim/lr", "optim/state/w/exp_avg"]
    assert report.created == [] and report.unexpected == []


def test_exclude_and_only_string(tmp_path: Path) -> None:
    saved = model_state(0)
    shardpoint.save(saved, tmp_path / "ckpt")
    target = model_state(1)
    report = shardpoint.load(target, tmp_path / "ckpt", exclude="model")
    assert report.skipped == ["model/b", "model/w"]
    assert_same(target["model_ema"], saved["model_ema"]) and target["optim"]["lr"] == saved["optim"]["lr"]
    target = model_state(1)
    report = shardpoint.load(target, tmp_path / "ckpt", only="model_ema")
    assert report.loaded == ["model_ema/w"]


def test_only_does_not_create_outside_the_selection(tmp_path: Path) -> None:
    shardpoint.save(model_state(0), tmp_path / "ckpt")
    target: dict = {"model": {}}
    report = shardpoint.load(target, tmp_path / "ckpt", only=["model"])
    assert sorted(target) == ["model"] and sorted(target["model"]) == ["b", "w"]
    assert report.created == ["model/b", "model/w"]


def test_shape_mismatch_is_refused_naming_the_key(tmp_path: Path) -> None:
    shardpoint.save({"w": torch.ones(3, 4)}, tmp_path / "ckpt")
    with pytest.raises(KeyMismatchError, match=r"'w'.*\(3, 4\)"):
        shardpoint.load({"w": torch.zeros(4, 3)}, tmp_path / "ckpt")


# --- Stateful objects ---------------------------------------------------------------------

def train(model: torch.nn.Module, opt: torch.optim.Optimizer, sched, steps: int, seed: int) -> None:  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(5, 4, generator=g)
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        sched.step()


def make_training(seed: int):  # type: ignore[no-untyped-def]
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    return model, opt, sched


def test_stateful_optimizer_and_scheduler_resume_exactly(tmp_path: Path) -> None:
    model, opt, sched = make_training(0)
    train(model, opt, sched, 3, seed=1)
    shardpoint.save({"model": model, "optim": opt, "sched": sched}, tmp_path / "ckpt")
    train(model, opt, sched, 2, seed=2)  # the uninterrupted run

    model2, opt2, sched2 = make_training(9)  # fresh: no optimizer state yet (lazily created)
    ptrs = [p.data_ptr() for p in model2.parameters()]
    report = shardpoint.load({"model": model2, "optim": opt2, "sched": sched2}, tmp_path / "ckpt")
    assert [p.data_ptr() for p in model2.parameters()] == ptrs
    assert "optim/state/0/exp_avg" in report.created and "model/0.weight" in report.loaded
    assert sched2.last_epoch == 3 and opt2.param_groups[0]["lr"] == pytest.approx(0.025)
    train(model2, opt2, sched2, 2, seed=2)
    for p, q in zip(model.parameters(), model2.parameters(), strict=True):
        assert torch.equal(p, q)
    for (_, a), (_, b) in zip(sorted(opt.state_dict()["state"].items()), sorted(opt2.state_dict()["state"].items()), strict=True):
        for name in a:
            assert torch.equal(a[name], b[name]), name
    assert sched.state_dict() == sched2.state_dict()


def test_stateful_load_state_dict_called_once_with_filled_dict(tmp_path: Path) -> None:
    class Counter:
        def __init__(self, n: int) -> None:
            self.n, self.calls = n, []

        def state_dict(self) -> dict:
            return {"n": self.n, "hist": torch.full((2,), float(self.n))}

        def load_state_dict(self, sd: dict) -> None:
            self.calls.append(sd)
            self.n = sd["n"]

    shardpoint.save({"c": Counter(5)}, tmp_path / "ckpt")
    c = Counter(1)
    shardpoint.load({"c": c}, tmp_path / "ckpt")
    assert c.n == 5 and len(c.calls) == 1 and torch.equal(c.calls[0]["hist"], torch.full((2,), 5.0))
    c2 = Counter(1)
    shardpoint.load({"c": c2, "x": 1}, tmp_path / "ckpt", strict=False, exclude=["c"])
    assert c2.calls == [], "a Stateful object left out by exclude= must not be loaded"


# --- load_full, metadata ---------------------------------------------------------------------

def test_load_full_keys_and_metadata(tmp_path: Path) -> None:
    state = model_state(0)
    state["rng"] = shardpoint.PerRank({"seed": 7})
    shardpoint.save(state, tmp_path / "ckpt")
    part = shardpoint.load_full(tmp_path / "ckpt", keys=["model"])
    assert sorted(part) == ["model"] and sorted(part["model"]) == ["b", "w"]
    assert torch.equal(part["model"]["w"], state["model"]["w"])
    assert shardpoint.load_full(tmp_path / "ckpt", keys="rng") == {"rng": {0: {"seed": 7}}}
    meta = shardpoint.metadata(tmp_path / "ckpt")
    assert meta.world_size == 1 and meta.version == shardpoint.format.FORMAT_VERSION
    assert sorted(meta.tensors) == ["model/b", "model/w", "model_ema/w", "optim/state/w/exp_avg"]
    w = meta.tensors["model/w"]
    assert w.shape == (4, 3) and w.dtype == torch.float32 and w.chunks == (((0, 0), (4, 3)),) and w.nbytes == 48
    assert meta.values == {"optim/lr": 0.1} and meta.per_rank == {"rng": [0]}
    assert meta.nbytes == sum(f.stat().st_size for f in (tmp_path / "ckpt").glob("*.safetensors"))
    assert abs(meta.created.timestamp() - json.loads((tmp_path / "ckpt" / "manifest.json").read_text())["created"]) < 1e-3


def test_missing_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(CheckpointNotFoundError, match="no checkpoint at"):
        shardpoint.load({}, tmp_path / "nothing")
    with pytest.raises(CheckpointNotFoundError):
        shardpoint.load_full(tmp_path / "nothing")
    with pytest.raises(CheckpointNotFoundError):
        shardpoint.metadata(tmp_path / "nothing")


# --- overwrite ------------------------------------------------------------------------------

def data_files(path: Path) -> set[str]:
    return {f.name for f in path.iterdir() if f.suffix == ".safetensors"}


def test_overwrite_false_refuses_and_keeps_the_checkpoint(tmp_path: Path) -> None:
    p = tmp_path / "ckpt"
    shardpoint.save({"w": torch.ones(3)}, p)
    files = sorted(os.listdir(p))
    manifest = (p / "manifest.json").read_bytes()
    with pytest.raises(ShardpointError, match="already exists.*overwrite=True"):
        shardpoint.save({"w": torch.zeros(3)}, p)
    assert sorted(os.listdir(p)) == files and (p / "manifest.json").read_bytes() == manifest
    assert torch.equal(shardpoint.load_full(p)["w"], torch.ones(3))


def test_overwrite_true_replaces_and_removes_old_data(tmp_path: Path) -> None:
    p = tmp_path / "ckpt"
    shardpoint.save({"w": torch.ones(3), "old": torch.ones(2)}, p)
    old = data_files(p)
    shardpoint.save({"w": torch.zeros(3)}, p, overwrite=True)
    new = data_files(p)
    assert old and new and not (old & new), "the old checkpoint's data files must be gone"
    indexes = {f.removesuffix(".safetensors") + ".index.json" for f in new}  # each data file's CRC index
    assert sorted(os.listdir(p)) == sorted(new | indexes | {"manifest.json"}), "no temporary or old files may be left"
    full = shardpoint.load_full(p)
    assert sorted(full) == ["w"] and torch.equal(full["w"], torch.zeros(3))


def test_overwrite_leaves_no_moment_without_a_loadable_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """At every phase boundary of an overwriting save, a fresh load finds the old
    checkpoint whole (until the manifest is replaced) or the new one (after)."""
    from shardpoint.runtime import PROCESS

    p = tmp_path / "ckpt"
    shardpoint.save({"w": torch.ones(1000), "step": 1}, p)
    seen: dict[str, tuple[float, int]] = {}

    def look(phase: str) -> None:
        full = shardpoint.load_full(p)  # verifies every checksum
        values = set(full["w"].tolist())
        assert len(values) == 1, f"{phase}: a mix of old and new values {values}"
        seen[phase] = (values.pop(), full["step"])

    monkeypatch.setattr(PROCESS.seams, "phase", look)
    shardpoint.save({"w": torch.full((1000,), 2.0), "step": 2}, p, overwrite=True)
    assert seen == {"planned": (1.0, 1), "written": (1.0, 1), "before_commit": (1.0, 1), "committed": (2.0, 2)}


def test_checkpoint_replaced_during_a_load_is_said_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A load that read the manifest just before an overwriting save committed finds
    its data files gone: the error says the checkpoint was replaced, not damaged."""
    from shardpoint.load import read as _read

    p = tmp_path / "ckpt"
    shardpoint.save({"w": torch.ones(1000)}, p)
    run = _read.Reader.run

    def overwrite_then_read(self: _read.Reader, jobs: list[_read.ReadJob]) -> None:
        monkeypatch.setattr(_read.Reader, "run", run)
        shardpoint.save({"w": torch.full((1000,), 2.0)}, p, overwrite=True)  # commits, removes the old files
        run(self, jobs)

    monkeypatch.setattr(_read.Reader, "run", overwrite_then_read)
    with pytest.raises(shardpoint.errors.CheckpointReplacedError,
                       match="replaced or removed while this load read it.*nothing is damaged") as e:
        shardpoint.load({"w": torch.zeros(1000)}, p)
    assert not isinstance(e.value, CorruptCheckpointError)
    target = {"w": torch.zeros(1000)}
    shardpoint.load(target, p)  # loading again finds the new checkpoint
    assert torch.equal(target["w"], torch.full((1000,), 2.0))


def test_saving_onto_a_file_or_an_unwritable_path_is_refused_clearly(tmp_path: Path) -> None:
    f = tmp_path / "notes.txt"
    f.write_text("mine")
    with pytest.raises(shardpoint.errors.UsageError, match=f"{f} exists and is not a directory.*Save to another path"):
        shardpoint.save({"w": torch.ones(2)}, f)
    with pytest.raises(ShardpointError, match="is not a directory"):
        shardpoint.CheckpointManager(f).save(shardpoint.TrainState(rng=False, w=torch.ones(2)), 1)
    assert f.read_text() == "mine"
    with pytest.raises(shardpoint.errors.StorageError, match="cannot create the checkpoint directory /proc/"):
        shardpoint.save({"w": torch.ones(2)}, "/proc/shardpoint-test/ckpt")


# --- the format as others see it ---------------------------------------------------------------

def test_newer_format_version_is_refused_clearly(tmp_path: Path) -> None:
    p = tmp_path / "ckpt"
    shardpoint.save({"w": torch.ones(3)}, p)
    doc = json.loads((p / "manifest.json").read_text())
    doc["version"] = shardpoint.format.FORMAT_VERSION + 1
    (p / "manifest.json").write_bytes(sealed(doc))
    for call in (lambda: shardpoint.load({"w": torch.zeros(3)}, p), lambda: shardpoint.load_full(p), lambda: shardpoint.metadata(p)):
        with pytest.raises(ShardpointError, match=f"format version {shardpoint.format.FORMAT_VERSION + 1} is newer than this shardpoint "
                                                  "reads.*upgrade shardpoint"):
            call()


def test_every_data_file_opens_with_safetensors(tmp_path: Path) -> None:
    from safetensors import safe_open

    state = full_state()
    state["rng"] = shardpoint.PerRank({"state": torch.arange(5, dtype=torch.uint8)})
    state["per_rank"] = {"rng": {"state": torch.ones(5, dtype=torch.uint8)}}  # same name but not per-rank
    p = tmp_path / "ckpt"
    shardpoint.save(state, p)
    files = data_files(p)
    assert files
    manifest = json.loads((p / "manifest.json").read_text())
    expected = {k: n.obj for k, n in walk(state).leaves.items() if isinstance(n.obj, torch.Tensor)}
    seen = {}
    checked = 0
    for f in files:
        with safe_open(str(p / f), framework="pt") as fh:
            assert fh.metadata() == {"format": "shardpoint"}
            for name in fh.keys():
                seen[name] = fh.get_tensor(name)
    for key, e in manifest["entries"].items():
        if e["kind"] != "tensor":
            continue
        e = {**manifest["layouts"][e["layout"]], **e}  # version 3: the shape and layout in the entry's row
        want = expected.get(key)
        if e.get("chunks") == []:  # a tensor with no elements has no bytes to write
            assert math.prod(e["shape"]) == 0, key
            checked += want is not None
            continue
        assert e["grid"]["ranks"] == [0], key  # one process: the whole tensor, one chunk, in rank 0's file
        name = f"{key}@{','.join('0' for _ in e['shape'])}"
        want = expected.get(key)
        got = seen[name]
        dtype = getattr(torch, e["dtype"])
        if dtype in SAFETENSORS_DTYPES:
            assert got.dtype == dtype and tuple(got.shape) == tuple(e["shape"]), key
        else:  # raw bytes, true dtype in the manifest
            assert got.dtype == torch.uint8 and got.dim() == 1, key
            got = got.view(dtype).reshape(e["shape"])
        if want is not None:  # (numpy arrays are checked by the round trip)
            assert same_bytes(got, want), key
            checked += 1
    assert checked == len(expected)
    assert torch.equal(seen["/per_rank/rng/state@0"], torch.arange(5, dtype=torch.uint8))
    assert torch.equal(seen["per_rank/rng/state@0"], torch.ones(5, dtype=torch.uint8))
    # every saved dtype safetensors knows came back as itself
    for dt in SAFETENSORS_DTYPES:
        name = str(dt).removeprefix("torch.")
        assert same_bytes(seen[f"tensors/{name}@0,0"], state["tensors"][name]), name


def test_corrupt_byte_is_caught_naming_file_and_key(tmp_path: Path) -> None:
    p = tmp_path / "ckpt"
    shardpoint.save({"a": torch.arange(100, dtype=torch.float32), "b": torch.ones(10)}, p)
    (f,) = data_files(p)
    offset = json.loads((p / (f.removesuffix(".safetensors") + ".index.json")).read_text())["chunks"]["a@0"][0]
    raw = bytearray((p / f).read_bytes())
    raw[offset + 17] ^= 0x01
    (p / f).write_bytes(bytes(raw))
    with pytest.raises(CorruptCheckpointError, match=rf"checksum mismatch in {f}.*'a'"):
        shardpoint.load({"a": torch.zeros(100), "b": torch.zeros(10)}, p)
    with pytest.raises(CorruptCheckpointError, match="'a'"):
        shardpoint.load_full(p)
    target = {"b": torch.zeros(10)}
    shardpoint.load(target, p, only=["b"])  # the damage is in another key's bytes
    assert torch.equal(target["b"], torch.ones(10))
    shardpoint.load({"a": torch.zeros(100)}, p, strict=False, verify=False)


def test_empty_containers_come_back(tmp_path: Path) -> None:
    """An optimizer saved before its first step has an empty ``state`` dict; created
    and per-rank values must keep it, or load_state_dict fails."""
    model, _opt, _sched = make_training(0)
    fresh = torch.optim.AdamW(model.parameters(), lr=0.1)
    state = {"optim": fresh.state_dict(), "rng": shardpoint.PerRank({"gen": {}, "hist": [[], ()], "n": 1})}
    shardpoint.save(state, tmp_path / "ckpt")
    target: dict = {}
    report = shardpoint.load(target, tmp_path / "ckpt")
    assert report.per_rank == {"rng": "restored"} and "rng" in report.created
    assert target["optim"]["state"] == {} and len(target["optim"]["param_groups"]) == 1
    torch.optim.AdamW(model.parameters(), lr=0.5).load_state_dict(target["optim"])
    assert isinstance(target["rng"], shardpoint.PerRank) and target["rng"].value == {"gen": {}, "hist": [[], ()], "n": 1}


def test_load_full_keeps_empty_containers(tmp_path: Path) -> None:
    shardpoint.save({"a": {}, "l": [], "b": 1}, tmp_path / "ckpt")
    assert shardpoint.load_full(tmp_path / "ckpt") == {"a": {}, "l": [], "b": 1}


def test_per_rank_keys_are_checked_like_any_other(tmp_path: Path) -> None:
    shardpoint.save({"w": torch.ones(2), "rng": shardpoint.PerRank({"seed": 3})}, tmp_path / "ckpt")
    with pytest.raises(KeyMismatchError, match=r"\['rng2'\]"):
        shardpoint.load({"w": torch.zeros(2), "rng": shardpoint.PerRank(None), "rng2": shardpoint.PerRank(0)}, tmp_path / "ckpt")
    with pytest.raises(KeyMismatchError, match="'w' is a PerRank value in the local state but a tensor"):
        shardpoint.load({"w": shardpoint.PerRank(torch.zeros(2)), "rng": shardpoint.PerRank({"seed": 0})}, tmp_path / "ckpt")
    with pytest.raises(KeyMismatchError, match="'rng' is a plain value in the local state but a per_rank"):
        shardpoint.load({"w": torch.zeros(2), "rng": 5}, tmp_path / "ckpt")
    target = {"w": torch.zeros(2), "rng": shardpoint.PerRank({"seed": 0}), "rng2": shardpoint.PerRank(0)}
    report = shardpoint.load(target, tmp_path / "ckpt", strict=False)
    assert report.missing == ["rng2"] and target["rng"].value == {"seed": 3} and report.per_rank == {"rng": "restored"}
    report = shardpoint.load(target, tmp_path / "ckpt", exclude=["rng"], strict=False)
    assert report.skipped == ["rng"] and report.per_rank == {}


def test_save_offline_compares_replicas_and_names_the_key(tmp_path: Path) -> None:
    """Replicated bytes that differ between two offline "ranks" are refused, naming the
    key and the ranks; nothing is committed and no data file is left."""
    from shardpoint.api import save_offline

    def ranks(differ: bool):  # type: ignore[no-untyped-def]
        for r in range(2):
            yield r, {"shared": torch.ones(3) + (r if differ else 0), "mine": shardpoint.PerRank(torch.full((2,), float(r)))}

    with pytest.raises(shardpoint.errors.RankMismatchError,
                       match=r"key 'shared' is replicated but its bytes differ between ranks \(ranks \[0\]; ranks \[1\]"):
        save_offline(ranks(True), tmp_path / "bad", world_size=2)
    assert not (tmp_path / "bad" / "manifest.json").exists() and not list((tmp_path / "bad").glob("r*"))
    save_offline(ranks(False), tmp_path / "good", world_size=2)
    full = shardpoint.load_full(tmp_path / "good")
    assert torch.equal(full["shared"], torch.ones(3)) and torch.equal(full["mine"][1], torch.ones(2))


def test_a_load_reads_only_the_indexes_of_the_files_it_needs(tmp_path: Path) -> None:
    """Each data file's CRC index is read only by a load that needs that file's
    chunks: with rank 1's index gone, keys held in rank 0's file still load, and a key
    with chunks in rank 1's file names the missing index."""
    from shardpoint.api import save_offline
    from shardpoint.layout import FlatShard

    full = torch.arange(8.0)
    states = ((r, {"only0": torch.ones(2) if r == 0 else None, "split": FlatShard(full[4 * r : 4 * r + 4].clone(), (8,), 4 * r)})
              for r in range(2))
    p = tmp_path / "ckpt"
    save_offline(((r, {k: v for k, v in s.items() if v is not None}) for r, s in states), p, world_size=2)
    m = json.loads((p / "manifest.json").read_text())
    row = m["layouts"][m["entries"]["split"]["layout"]]
    assert row["grid"] == {"cuts": [4], "ranks": {"first": 0, "step": 1}}  # two shards: O(1) entry
    (rank1,) = [f["index"]["name"] for f in m["files"].values() if f["rank"] == 1]
    (p / rank1).unlink()
    assert torch.equal(shardpoint.load_full(p, keys=["only0"])["only0"], torch.ones(2))
    target = {"split": FlatShard(torch.zeros(4), (8,), 0)}  # the first half: rank 0's file only
    shardpoint.load(target, p, only=["split"])
    assert torch.equal(target["split"].local, full[:4])
    with pytest.raises(CorruptCheckpointError, match=rf"index .*{rank1}"):
        shardpoint.load_full(p, keys=["split"])


def test_a_sparse_tensor_is_refused_naming_its_key(tmp_path: Path) -> None:
    """A sparse tensor cannot be streamed as bytes: the save says which key and what
    to do, on every rank, before anything is written."""
    from shardpoint.errors import UnsupportedTypeError

    with pytest.raises(UnsupportedTypeError, match=r"key 'emb' is a torch.sparse_coo tensor.*to_dense\(\)") as e:
        shardpoint.save({"emb": torch.eye(3).to_sparse(), "w": torch.ones(2)}, tmp_path / "c")
    assert isinstance(e.value, TypeError) and isinstance(e.value, shardpoint.ShardpointError)
    assert not (tmp_path / "c").exists() or not any((tmp_path / "c").iterdir())


def test_importing_shardpoint_changes_nothing_at_exit() -> None:
    """A script that only imports shardpoint exits as it would without it: no
    threading exit hook, no thread, no process group (the save in flight's exit hook
    is registered by the first save or restore). Its one ``atexit`` hook only lets
    torch's gloo worker threads finish with the GIL (shardpoint/_exit.py): with no
    gloo worker it returns at once and does nothing."""
    import subprocess
    import sys

    code = ("import atexit, concurrent.futures, threading, torch\n"
            "before = (list(threading._threading_atexits), threading.active_count())\n"
            "callbacks = atexit._ncallbacks()\n"
            "import shardpoint, shardpoint._exit as x\n"
            "assert (list(threading._threading_atexits), threading.active_count()) == before\n"
            "assert atexit._ncallbacks() == callbacks + 1 and x.gloo_workers() == []\n"
            "assert x.settle_gloo_workers() == 0\n"
            "shardpoint.save({'w': torch.ones(2)}, __import__('sys').argv[1])\n"
            "assert len(threading._threading_atexits) == len(before[0]) + 1\n")
    with tempfile.TemporaryDirectory() as d:
        subprocess.run([sys.executable, "-c", code, f"{d}/c"], check=True, timeout=120)


def test_a_location_that_is_not_a_checkpoint_says_so(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Not found says not found (not "disappeared while reading it"); a path of the wrong
    type and a load into nothing are usage errors naming what to give."""
    from shardpoint.errors import UsageError

    with pytest.raises(shardpoint.CheckpointNotFoundError, match=r"no checkpoint at .*nowhere: nothing is there"):
        shardpoint.load({"w": torch.zeros(2)}, tmp_path / "nowhere")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("hello")
    with pytest.raises(shardpoint.CheckpointNotFoundError, match="it has no manifest.json"):
        shardpoint.load({"w": torch.zeros(2)}, tmp_path / "other")
    with pytest.raises(UsageError, match="a checkpoint location is a path or a URL, not int 5"):
        shardpoint.save({"w": torch.zeros(2)}, 5)  # type: ignore[arg-type]
    shardpoint.save({"w": torch.ones(2)}, tmp_path / "ok")
    with pytest.raises(UsageError, match="fills state in place"):
        shardpoint.load(None, tmp_path / "ok")


def test_only_and_exclude_that_match_nothing_are_refused_naming_the_closest(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from shardpoint.errors import UsageError

    m = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    shardpoint.save(shardpoint.TrainState(model=m, optimizer=opt, rng=False), tmp_path / "c")
    m2 = torch.nn.Linear(3, 2)
    state = shardpoint.TrainState(model=m2, optimizer=torch.optim.SGD(m2.parameters(), lr=0.1), rng=False)
    with pytest.raises(UsageError, match=r"only='modle' matches no key.*did you mean 'model'"):
        shardpoint.load(state, tmp_path / "c", only="modle")
    with pytest.raises(UsageError, match=r"exclude='optimiser' matches no key.*did you mean 'optimizer'"):
        shardpoint.load(state, tmp_path / "c", exclude=["optimiser"])
    report = shardpoint.load(state, tmp_path / "c", only=["model/weight"])  # a whole key is a prefix too
    assert report.loaded == ["model/weight"]
    # a part that may be absent (a trainer asks for its grad scaler whether it has one or not) beside one
    # that matches is no error; alone, it would load nothing
    report = shardpoint.load(state, tmp_path / "c", only=["model", "grad_scaler"])
    assert report.loaded == ["model/bias", "model/weight"]
    with pytest.raises(UsageError, match=r"only='grad_scaler' matches no key.*the top-level keys are"):
        shardpoint.load(state, tmp_path / "c", only="grad_scaler")


def test_strict_refuses_a_larger_model_and_a_selective_load_stays_selective(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A checkpoint of a 3-layer model into a 2-layer one: strict=True refuses it before
    anything changes, naming the keys (as load_state_dict(strict=True) does); strict=False
    loads the two layers and reports the third unexpected. A checkpoint part the state
    does not hold at all (its optimizer) stays a selective load under strict=True."""
    big = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(3)])
    opt = torch.optim.SGD(big.parameters(), lr=0.1)
    shardpoint.save(shardpoint.TrainState(model=big, optimizer=opt, rng=False), tmp_path / "c")
    small = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(2)])
    before = [p.detach().clone() for p in small.parameters()]
    with pytest.raises(shardpoint.KeyMismatchError, match=r"2 key\(s\) of the checkpoint have no place.*'model/2.bias'"):
        shardpoint.load(shardpoint.TrainState(model=small, rng=False), tmp_path / "c")
    assert all(torch.equal(a, b) for a, b in zip(before, small.parameters())), "nothing was modified"
    report = shardpoint.load(shardpoint.TrainState(model=small, rng=False), tmp_path / "c", strict=False)
    assert [k for k in report.unexpected if k.startswith("model/")] == ["model/2.bias", "model/2.weight"]
    assert torch.equal(small[1].weight, big[1].weight)
    same = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(3)])
    report = shardpoint.load(shardpoint.TrainState(model=same, rng=False), tmp_path / "c")  # no optimizer given
    assert torch.equal(same[2].weight, big[2].weight) and not [k for k in report.unexpected if k.startswith("model/")]


@pytest.mark.parametrize("kind", ["quantized", "complex32", "nested"])
def test_tensor_kinds_the_format_cannot_hold_are_refused_at_save(tmp_path, kind) -> None:  # type: ignore[no-untyped-def]
    """Refused before anything is written, naming the key, the kind and what to save
    instead (it used to fail as "the manifest is damaged" or "Internal error")."""
    from shardpoint.errors import UnsupportedTypeError

    make = {"quantized": lambda: torch.quantize_per_tensor(torch.ones(4), 0.1, 0, torch.qint8),
            "complex32": lambda: torch.ones(4, dtype=torch.complex32),
            "nested": lambda: torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])}
    with pytest.raises(UnsupportedTypeError, match=r"key 'net/x'.*" + {"quantized": "int_repr", "complex32": "complex64",
                                                                           "nested": "unbind"}[kind]):
        shardpoint.save({"net": {"x": make[kind]()}, "ok": torch.ones(2)}, tmp_path / "c")
    assert not (tmp_path / "c").exists() or not any((tmp_path / "c").iterdir())


def test_a_model_that_is_not_a_module_is_refused_naming_what_to_give(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from shardpoint.errors import UnsupportedTypeError

    with pytest.raises(UnsupportedTypeError, match=r"TrainState\(model=...\) takes a torch.nn.Module.*not dict"):
        shardpoint.save(shardpoint.TrainState(model={}), tmp_path / "c")


def test_small_chunks_health_is_each_keys_own(tmp_path: Path) -> None:
    """Small tensors are scanned for NaN and infinity in batches; each key's finding is
    still its own: finite values whose sum overflows are finite, a NaN and an infinity
    among hundreds of finite tensors are found in just their keys, of every dtype."""
    from shardpoint.format.manifest import Manifest

    state: dict[str, torch.Tensor] = {f"ok{i}": torch.full((16,), float(i)) for i in range(600)}
    state["big"] = torch.full((8,), 6e4, dtype=torch.float16)  # sums past float16's range, every value finite
    state["big32"] = torch.full((4,), 3e38)  # past float32's
    state["nan"] = torch.tensor([1.0, float("nan"), 2.0])
    state["inf"] = torch.tensor([float("-inf"), 1.0])
    state["half_inf"] = torch.tensor([1.0, float("inf")], dtype=torch.float16)
    state["ints"] = torch.arange(5)
    shardpoint.save(state, tmp_path / "c")
    m = Manifest.parse((tmp_path / "c" / "manifest.json").read_bytes())
    assert sorted(m.nonfinite or ()) == ["half_inf", "inf", "nan"]
    assert list(m.nan or ()) == ["nan"]


def test_a_save_and_load_warn_nothing_where_warnings_are_errors(tmp_path: Path) -> None:
    """Under ``-W error`` (a test suite's ``filterwarnings = error``) a save of small and
    large tensors, blocking and not, and a load go through: the health scan hands torch a
    writable buffer (a read-only one made torch warn, once per process, and the save
    fail). A fresh process, since torch warns only once."""
    import subprocess
    import sys

    code = ("import sys, torch, shardpoint\n"
            "state = {f't{i}': torch.randn(16) for i in range(50)}\n"
            "state.update(big=torch.randn(1 << 18), strided=torch.randn(30, 70).t(), h=torch.ones(9, dtype=torch.bfloat16))\n"
            "shardpoint.save(state, sys.argv[1] + '/c')\n"
            "shardpoint.save(state, sys.argv[1] + '/a', blocking=False).wait()\n"
            "back = {k: torch.zeros_like(v) for k, v in state.items()}\n"
            "shardpoint.load(back, sys.argv[1] + '/a')\n"
            "assert all(torch.equal(back[k], v) for k, v in state.items())\n")
    r = subprocess.run([sys.executable, "-W", "error", "-c", code, str(tmp_path)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]


def test_parameters_that_require_grad_load_in_place_whole_and_in_parts(tmp_path: Path) -> None:
    """A load writes a parameter's memory directly (no detached alias, issue 34): the
    same Parameter objects, still leaves that require grad with no grad made, hold the
    saved values, whether a read fills the whole tensor or, cast or strided, a part of
    it; a tuple container comes back equal."""
    saved = {"w": torch.randn(6, 4), "b": torch.randn(4).to(torch.bfloat16), "t": (torch.arange(3.0), 2)}
    shardpoint.save(saved, tmp_path / "ck")
    w, b = torch.nn.Parameter(torch.zeros(6, 4)), torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16))
    state = {"w": w, "b": b, "t": (torch.nn.Parameter(torch.zeros(3)), 0)}
    report = shardpoint.load(state, tmp_path / "ck")
    assert state["w"] is w and state["b"] is b
    for p in (w, b, state["t"][0]):
        assert p.requires_grad and p.is_leaf and p.grad is None
    assert torch.equal(w.detach(), saved["w"]) and torch.equal(b.detach(), saved["b"])
    assert torch.equal(state["t"][0].detach(), saved["t"][0]) and state["t"][1] == 2
    # into a float64 parameter (a cast) and a non-contiguous view of one (a strided copy)
    big = torch.nn.Parameter(torch.zeros(4, 6, dtype=torch.float64))
    into = {"w": big.t(), "b": torch.nn.Parameter(torch.zeros(4)), "t": (torch.zeros(3), 0)}
    report = shardpoint.load(into, tmp_path / "ck")
    assert sorted(report.cast) == ["b", "w"]
    assert torch.equal(big.detach().t(), saved["w"].double()) and big.grad is None and big.is_leaf
    assert torch.equal(into["b"].detach(), saved["b"].float())


def test_a_conjugate_or_negative_view_is_loaded_as_the_values_it_shows(tmp_path: Path) -> None:
    """A view whose conjugate or negative bit is set shows other values than the bytes
    in its memory: a load copies into it (no raw bytes written under it), so each
    view then shows the saved values."""
    z, r = torch.randn(5, dtype=torch.complex64), torch.randn(5)
    shardpoint.save({"z": z, "r": r}, tmp_path / "ck")
    zmem, rmem = torch.zeros(5, dtype=torch.complex64), torch.zeros(5, dtype=torch.complex64)
    into = {"z": zmem.conj(), "r": rmem.conj().imag}  # the conjugate bit; the negative bit (a real view)
    assert into["z"].is_conj() and into["r"].is_neg()
    shardpoint.load(into, tmp_path / "ck")
    assert torch.equal(into["z"].resolve_conj(), z) and torch.equal(zmem, z.conj())
    assert torch.equal(into["r"].resolve_neg(), r) and torch.equal(rmem.imag, -r)
