"""The adapter protocol and its registry, owner hooks anywhere in the state tree, the
core's independence from every framework, the offline replica check, and the errors
that name what they are about."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import shardpoint
from shardpoint import errors
from shardpoint.adapters import Adapter, PlainAdapter, adapter_class, adapter_for, register
from shardpoint.api import save_offline
from shardpoint.errors import CorruptCheckpointError, ShardpointError
from shardpoint.format.datafile import dtype_from_name
from shardpoint.runtime import PROCESS

SRC = Path(__file__).resolve().parents[1] / "src" / "shardpoint"
FRAMEWORKS = ("deepspeed", "lightning", "pytorch_lightning", "transformers", "accelerate")


# -- the core never imports an integration or a framework ----------------------------------------
def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports (lazily too), relative imports resolved."""
    pkg = ["shardpoint", *path.relative_to(SRC).parent.parts]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = pkg[: len(pkg) - node.level + 1] if node.level else []
            mod = ".".join(base + ([node.module] if node.module else []))
            out.add(mod)
            if node.module is None or node.level:  # `from . import x`: x may be a module
                out.update(f"{mod}.{a.name}" for a in node.names)
    return out


def test_the_core_imports_no_integration_and_no_framework() -> None:
    # the core: everything but the integrations, the converters and the command line (a
    # front end that dispatches `shardpoint convert --from deepspeed` to a converter)
    core = [p for p in SRC.rglob("*.py") if p.relative_to(SRC).parts[0] not in ("integrations", "interop", "cli")]
    assert len(core) > 20 and SRC / "adapters.py" in core and SRC / "state.py" in core
    bad = {}
    for p in core:
        found = sorted(m for m in _imports(p)
                       if m.startswith(("shardpoint.integrations", "shardpoint.interop")) or m.split(".")[0] in FRAMEWORKS)
        if found:
            bad[str(p.relative_to(SRC))] = found
    assert bad == {}, f"core modules import integrations or frameworks: {bad}"
    # the check can fail: the integration itself imports the core and DeepSpeed
    ds = _imports(SRC / "integrations" / "deepspeed.py")
    assert "shardpoint.state" in ds and "deepspeed.runtime.zero.stage3" in ds


_BLOCKED = f"""
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {FRAMEWORKS!r}:
            raise ImportError(f"{{name}} is blocked in this test")
sys.meta_path.insert(0, Block())
import torch, shardpoint
from shardpoint import adapters, TrainState
m = torch.nn.Linear(3, 2)
opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
m(torch.ones(1, 3)).sum().backward(); opt.step()
shardpoint.save(TrainState(model=m, optimizer=opt), sys.argv[1])
m2 = torch.nn.Linear(3, 2); o2 = torch.optim.SGD(m2.parameters(), lr=0.5, momentum=0.9)
r = shardpoint.load(TrainState(model=m2, optimizer=o2), sys.argv[1])
assert torch.equal(m2.weight, m.weight) and o2.param_groups[0]["lr"] == 0.1, r
try:
    import deepspeed
except ImportError:
    pass
else:
    raise SystemExit("the blocker does not work")
print("ok", sorted(k for k in sys.modules if k.split(".")[0] in {FRAMEWORKS!r}))
"""


def test_import_shardpoint_works_with_no_framework_installed(tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, "-c", _BLOCKED, str(tmp_path / "ck")], capture_output=True, text=True, timeout=300,
                       env={"PYTHONPATH": str(SRC.parent), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip() == "ok []", r.stdout


# -- the registry -----------------------------------------------------------------------------
class Engine:
    """A stand-in for a framework's engine: it owns a module and an optimizer."""

    def __init__(self, seed: int) -> None:
        torch.manual_seed(seed)
        self.module = torch.nn.Linear(4, 3)
        self.optimizer = torch.optim.AdamW(self.module.parameters(), lr=0.01)
        self.steps = 0
        self.refreshed = 0

    def train_step(self) -> None:
        self.module(torch.ones(2, 4)).pow(2).sum().backward()
        self.optimizer.step()
        self.optimizer.zero_grad()
        self.steps += 1


class PipelineEngine(Engine):
    """A subclass nobody registered (DeepSpeed's PipelineEngine is one)."""


class EngineAdapter(Adapter):
    """Delegates model and optimizer to the plain adapter and adds a counter and a refresh."""

    transient = ("model", "optimizer", "engine")

    def __init__(self, owner: Any, *, optimizer: Any = None, key_map: Any = None) -> None:
        super().__init__(owner)
        self.plain = PlainAdapter(owner.module, optimizer=owner.optimizer)

    def state(self) -> dict[str, Any]:
        return {**self.plain.state(), "engine": {"steps": self.owner.steps}}

    def prepare_load(self, entries: Any, select: Any) -> list[str]:
        return self.plain.prepare_load(entries, select)

    def apply(self, sd: Any) -> None:
        self.plain.apply(sd)
        self.owner.steps = sd["engine"]["steps"]

    def finish_load(self) -> None:
        self.owner.refreshed += 1


ENGINE = f"{Engine.__module__}.{Engine.__qualname__}"


@pytest.fixture
def registered():  # type: ignore[no-untyped-def]
    register(ENGINE, f"{__name__}:EngineAdapter")
    try:
        yield
    finally:
        PROCESS.adapters.pop(ENGINE)


def test_a_subclass_uses_its_parents_adapter(registered: None, tmp_path: Path) -> None:
    assert adapter_class(PipelineEngine(0)) is EngineAdapter and adapter_class(Engine(0)) is EngineAdapter
    assert adapter_class(torch.nn.Linear(1, 1)) is None and type(adapter_for(torch.nn.Linear(1, 1))) is PlainAdapter
    src = PipelineEngine(0)
    src.train_step()
    src.train_step()
    shardpoint.save(shardpoint.TrainState(model=src, rng=False), tmp_path / "ck")
    assert shardpoint.load_full(tmp_path / "ck")["engine"] == {"steps": 2}
    dst = PipelineEngine(1)
    report = shardpoint.load(shardpoint.TrainState(model=dst, rng=False), tmp_path / "ck")
    assert dst.steps == 2 and dst.refreshed == 1  # apply and finish_load ran
    assert torch.equal(dst.module.weight, src.module.weight)
    p, q = dst.module.weight, src.module.weight
    assert torch.equal(dst.optimizer.state[p]["exp_avg"], src.optimizer.state[q]["exp_avg"])
    assert report.created == ["optimizer/state/bias/exp_avg", "optimizer/state/bias/exp_avg_sq", "optimizer/state/bias/step",
                              "optimizer/state/weight/exp_avg", "optimizer/state/weight/exp_avg_sq",
                              "optimizer/state/weight/step"]
    assert report.missing == report.unexpected == []
    # without the registration the same object is a plain (non-module) owner: it cannot be saved that way
    PROCESS.adapters.pop(ENGINE)
    try:
        with pytest.raises(shardpoint.errors.UnsupportedTypeError, match="not PipelineEngine"):
            shardpoint.TrainState(model=PipelineEngine(0)).state_dict()
    finally:
        register(ENGINE, EngineAdapter)


def test_an_adapter_that_cannot_be_imported_says_which(tmp_path: Path) -> None:
    register(ENGINE, "no_such_package.adapters:Nope")
    try:
        with pytest.raises(errors.MissingDependencyError,
                           match=f"'no_such_package.adapters:Nope' registered for {ENGINE}") as ei:
            adapter_for(PipelineEngine(0))
        assert isinstance(ei.value, ImportError)
    finally:
        PROCESS.adapters.pop(ENGINE)


# -- owner hooks anywhere in the tree -----------------------------------------------------------
def _trained(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2))
    opt = torch.optim.AdamW(m.parameters(), lr=0.03)
    for _ in range(2):
        m(torch.randn(3, 4)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    return m, opt


def _fresh() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(99)
    m = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2))
    return m, torch.optim.AdamW(m.parameters(), lr=0.5)


@pytest.mark.parametrize("nested", [False, True])
def test_a_nested_train_state_restores_as_at_the_top(tmp_path: Path, nested: bool) -> None:
    m, opt = _trained(0)
    torch.manual_seed(1234)
    state = shardpoint.TrainState(model=m, optimizer=opt, step=2)
    shardpoint.save({"run": state, "note": "x"} if nested else state, tmp_path / "ck")
    want_draw = torch.rand(5)

    m2, o2 = _fresh()  # never stepped: its AdamW state must be created, then filled
    torch.manual_seed(7)
    st2 = shardpoint.TrainState(model=m2, optimizer=o2, step=0)
    report = shardpoint.load({"run": st2, "note": "y"} if nested else st2, tmp_path / "ck")
    assert torch.equal(torch.rand(5), want_draw), "RNG streams not restored"
    pre = "run/" if nested else ""
    assert report.per_rank == {f"{pre}rng/streams": "restored"}
    assert report.created == sorted(f"{pre}optimizer/state/{n}/{k}" for n, _ in m.named_parameters()
                                    for k in ("exp_avg", "exp_avg_sq", "step"))
    assert report.missing == report.unexpected == []
    assert st2.extra == {"step": 2} and o2.param_groups[0]["lr"] == 0.03
    for (n, p), p2 in zip(m.named_parameters(), m2.parameters()):
        assert torch.equal(p, p2), n
        for k in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opt.state[p][k], o2.state[p2][k]), (n, k)


def test_nested_owners_and_a_checkpoint_without_rng(tmp_path: Path) -> None:
    """Two TrainStates side by side, one saved without RNG: each gets its own part of
    the report, and the one whose checkpoint has no streams says so."""
    a, oa = _trained(0)
    b, _ = _trained(1)
    shardpoint.save({"a": shardpoint.TrainState(model=a, optimizer=oa, rng=False), "b": shardpoint.TrainState(model=b)},
                    tmp_path / "ck")
    a2, oa2 = _fresh()
    b2, _ = _fresh()
    report = shardpoint.load({"a": shardpoint.TrainState(model=a2, optimizer=oa2), "b": shardpoint.TrainState(model=b2)},
                             tmp_path / "ck")
    assert report.per_rank == {"a/rng/streams": "not in checkpoint", "b/rng/streams": "restored"}
    assert all(k.startswith("a/optimizer/state/") for k in report.created) and len(report.created) == 12
    assert torch.equal(b2[2].bias, b[2].bias) and torch.equal(oa2.state[a2[0].weight]["exp_avg"], oa.state[a[0].weight]["exp_avg"])


def test_a_checkpoint_parameter_the_model_lacks_is_unexpected(tmp_path: Path) -> None:
    m, opt = _trained(0)
    shardpoint.save(shardpoint.TrainState(model=m, optimizer=opt, rng=False), tmp_path / "ck")
    small = torch.nn.Sequential(torch.nn.Linear(4, 5))
    o = torch.optim.AdamW(small.parameters())
    with pytest.raises(shardpoint.KeyMismatchError, match="have no place in the state's model or optimizer"):
        shardpoint.load(shardpoint.TrainState(model=small, optimizer=o, rng=False), tmp_path / "ck",
                        exclude=["optimizer/param_groups"])  # strict (the default) refuses a larger model
    report = shardpoint.load(shardpoint.TrainState(model=small, optimizer=o, rng=False), tmp_path / "ck",
                             exclude=["optimizer/param_groups"], strict=False)
    assert "model/2.weight" in report.unexpected and "optimizer/state/2.weight/exp_avg" in report.unexpected
    assert not [k for k in report.created if "2." in k]


# -- offline replicas ---------------------------------------------------------------------------
def _rank_state(rank: int, b: torch.Tensor) -> dict[str, Any]:
    from shardpoint.layout import FlatShard

    return {"w": FlatShard(torch.arange(4.0) + 4 * rank, (8,), 4 * rank), "b": b}


def test_save_offline_refuses_replicas_that_differ(tmp_path: Path) -> None:
    same = [(r, _rank_state(r, torch.ones(3))) for r in range(2)]
    save_offline(iter(same), str(tmp_path / "ok"), world_size=2)
    assert torch.equal(shardpoint.load_full(tmp_path / "ok")["w"], torch.arange(8.0))
    differ = [(0, _rank_state(0, torch.ones(3))), (1, _rank_state(1, torch.tensor([1.0, 2.0, 1.0])))]
    with pytest.raises(ShardpointError, match=r"key 'b' is replicated but its bytes differ between ranks \(ranks \[0\]; ranks \[1\]"):
        save_offline(iter(differ), str(tmp_path / "bad"), world_size=2)
    assert not (tmp_path / "bad" / "manifest.json").exists() and not list((tmp_path / "bad").glob("*.safetensors"))


# -- errors that name what they are about --------------------------------------------------------
def test_an_unknown_dtype_names_the_key() -> None:
    with pytest.raises(CorruptCheckpointError, match=r"key 'optimizer/state/w/exp_avg' has dtype 'float99'.*upgrade"):
        dtype_from_name("float99", key="optimizer/state/w/exp_avg")
    with pytest.raises(ShardpointError, match="dtype 'float99'"):
        dtype_from_name("float99")
    assert dtype_from_name("bfloat16") is torch.bfloat16


def test_a_deepspeed_optimizer_parameter_outside_the_module_names_its_group() -> None:
    from shardpoint.integrations.deepspeed import _namer

    module = torch.nn.Linear(2, 3)
    name = _namer(SimpleNamespace(module=module))
    assert name(module.weight, 0) == "weight"
    with pytest.raises(errors.UnsupportedConfigError,
                       match=r"param group 1 .* shape \(7, 5\) that is not a parameter of engine.module"):
        name(torch.nn.Parameter(torch.zeros(7, 5)), 1)


def test_an_optimizer_parameter_outside_the_model_names_group_and_index(tmp_path: Path) -> None:
    m = torch.nn.Linear(2, 3)
    opt = torch.optim.SGD([{"params": m.parameters()}, {"params": [torch.nn.Parameter(torch.zeros(4))]}], lr=0.1)
    with pytest.raises(errors.UsageError,
                       match=r"param_groups\[1\] parameter 0 \(shape \(4,\)\) is not a parameter of the model"):
        shardpoint.save(shardpoint.TrainState(model=m, optimizer=opt), tmp_path / "ck")
