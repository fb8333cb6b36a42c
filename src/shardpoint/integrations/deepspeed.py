"""DeepSpeed: save and resume ZeRO engines (stages 0-3) on any world size, and
import checkpoints written by DeepSpeed's own ``engine.save_checkpoint``.

A ZeRO rank owns a contiguous range of each parameter group's flattened fp32
master weights, and Adam's moments live in flat tensors of the same layout. This
module finds, for every parameter, the range this rank holds and hands the core
views into DeepSpeed's own flat buffers as :class:`~shardpoint.layout.FlatShard`
leaves, so a load on another world size copies straight into them.

The keys are the training-state layout (``docs/format.md``)::

    model/<fqn>                              fp32 master weights (buffers, frozen params as held)
    optimizer/state/<fqn>/{exp_avg,exp_avg_sq,step}
    optimizer/param_groups/<i>/<hyperparameter>, .../params = [fqn, ...]
    scheduler/...                            engine.lr_scheduler.state_dict()
    engine/{global_steps,global_samples,skipped_steps}
    client/...                               client_state
    rng/base_seed, rng/streams               every rank's RNG streams (per rank)

DeepSpeed is imported lazily: importing this module never imports deepspeed. The
core finds :class:`EngineAdapter` through :mod:`shardpoint.adapters` by the engine's
class name, so ``TrainState(model=engine)`` works without importing this module first.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Protocol

import torch

from .._optim import (
    Entries,
    Entry,
    OptimizerEntries,
    apply_param_groups,
    canonical_name,
    hyperparameters,
    param_names,
    zeros_like_entry,
)
from ..adapters import Adapter, KeyMap
from ..errors import UnsupportedConfigError, UsageError
from ..format.model import TensorEntry
from ..layout import FlatShard
from ..report import LoadReport
from ..state import TrainState

__all__ = [
    "save", "load", "convert", "EngineState", "EngineAdapter", "finish_load", "train_state_parts",
    "prepare_train_state", "apply_train_state",
]

_ADAM_STATE = ("step", "exp_avg", "exp_avg_sq")


class Engine(Protocol):
    """What this module uses of a DeepSpeed engine (``deepspeed.DeepSpeedEngine``,
    which has no type hints): its counters are set with ``setattr``."""

    @property
    def module(self) -> torch.nn.Module: ...

    @property
    def optimizer(self) -> Any: ...  # Any: DeepSpeed's untyped optimizer wrappers (ZeRO, BF16/FP16) or a torch optimizer

    @property
    def lr_scheduler(self) -> object: ...

    @property
    def global_steps(self) -> int: ...

    @property
    def global_samples(self) -> int: ...

    @property
    def skipped_steps(self) -> int: ...


# -- where each parameter's fp32 master and optimizer state live on this rank ---------------
@dataclass(slots=True)
class Piece:
    """What this rank holds of one trainable parameter.

    ``key`` is the tensor that keys the torch optimizer's state (a ZeRO flat
    partition, or the fp32 parameter itself); this rank's elements
    ``[start, start + numel)`` of the parameter's row-major flattening sit at
    ``key.view(-1)[offset : offset + numel]``, and so do its per-element optimizer
    states in ``optimizer.state[key]``."""

    fqn: str
    shape: tuple[int, ...]
    start: int
    numel: int
    key: torch.Tensor
    offset: int
    group: int
    sharded: bool  # False: every rank holds the whole parameter (no ZeRO partitioning)

    def view(self, flat: torch.Tensor) -> torch.Tensor | FlatShard:
        """The leaf for a tensor laid out like ``key`` (the master or a moment)."""
        part = flat.detach().view(-1).narrow(0, self.offset, self.numel)  # detached: loads copy into it
        return FlatShard(part, self.shape, self.start) if self.sharded else part.view(self.shape)


def torch_optimizer(engine: Engine) -> torch.optim.Optimizer:
    """The torch optimizer that DeepSpeed's wrapper (if any) steps."""
    opt = engine.optimizer
    if opt is None:
        raise UnsupportedConfigError("this DeepSpeed engine has no optimizer; shardpoint saves training engines")
    inner = getattr(opt, "optimizer", None)
    return inner if isinstance(inner, torch.optim.Optimizer) else opt


def _namer(engine: Engine) -> Callable[[torch.Tensor, int], str]:
    """``name(param, group)``: the canonical name of an optimizer parameter in
    ``engine.module``, as TrainState names optimizer state."""
    names = param_names(engine.module)

    def name(p: torch.Tensor, group: int) -> str:
        n = names.get(id(p))
        if n is None:
            shape = tuple(getattr(p, "ds_shape", None) or p.shape)
            raise UnsupportedConfigError(
                f"param group {group} of the DeepSpeed optimizer holds a parameter of shape {shape} that is not a "
                "parameter of engine.module; shardpoint names optimizer state by the module's parameter names, so "
                "give deepspeed.initialize the parameters of the model it wraps (model_parameters=model.parameters())"
            )
        return n

    return name


def _kind(engine: Engine) -> str:
    opt = engine.optimizer
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
    from deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    if isinstance(opt, DeepSpeedZeroOptimizer_Stage3):
        if getattr(opt, "swap_optimizer", False):
            raise UnsupportedConfigError("ZeRO-3 with optimizer state swapped to NVMe is not supported; keep the optimizer state in memory")
        return "zero3"
    if isinstance(opt, DeepSpeedZeroOptimizer):
        return "zero12"
    if isinstance(opt, BF16_Optimizer):
        return "bf16"
    if isinstance(opt, FP16_Optimizer):
        return "fused"
    if isinstance(opt, FP16_UnfusedOptimizer):
        return "unfused"
    if isinstance(opt, torch.optim.Optimizer):
        return "plain"
    raise UnsupportedConfigError(
        f"DeepSpeed optimizer wrapper {type(opt).__module__}.{type(opt).__name__} is not supported; shardpoint "
        "knows ZeRO stages 0-3, BF16_Optimizer and FP16_Optimizer. Open an issue with your DeepSpeed config"
    )


def pieces(engine: Engine) -> list[Piece]:
    """This rank's piece of every trainable parameter, in optimizer order."""
    name = _namer(engine)
    opt, kind = engine.optimizer, _kind(engine)
    out: list[Piece] = []

    if kind in ("zero12", "bf16"):
        lp_groups = opt.bit16_groups if kind == "zero12" else opt.bf16_groups
        hp_flats = opt.single_partition_of_fp32_groups if kind == "zero12" else opt.fp32_groups_flat_partition
        for g, (lps, flat) in enumerate(zip(lp_groups, hp_flats, strict=True)):
            for p in lps:
                m = getattr(p, "_hp_mapping", None)
                if m is None:
                    continue  # no element of p lies in this rank's partition
                lp, hp = m.lp_fragment_address, m.hp_fragment_address
                out.append(Piece(name(p, g), tuple(p.shape), int(lp.start), int(lp.numel), flat, int(hp.start), g, True))
    elif kind == "zero3":
        for sg, params in enumerate(opt.fp16_groups):
            flat = opt.fp32_partitioned_groups_flat[sg]
            g = int(opt.sub_group_to_group_id[sg])
            for p in params:
                _, offset, pnumel = opt.grad_position[opt.get_param_id(p)]
                rank = opt._get_param_partition_rank(p)
                start = rank * int(pnumel)
                n = max(0, min(int(pnumel), int(p.ds_numel) - start))
                if n:
                    out.append(Piece(name(p, g), tuple(p.ds_shape), start, n, flat, int(offset), g, True))
    elif kind == "fused":
        for g, (lps, flat) in enumerate(zip(opt.fp16_groups, opt.fp32_groups_flat, strict=True)):
            offset = 0
            for p in lps:
                out.append(Piece(name(p, g), tuple(p.shape), 0, p.numel(), flat, offset, g, False))
                offset += p.numel()
    elif kind == "unfused":
        for g, (lps, hps) in enumerate(zip(opt.fp16_groups, opt.fp32_groups, strict=True)):
            for p, hp in zip(lps, hps, strict=True):
                out.append(Piece(name(p, g), tuple(p.shape), 0, p.numel(), hp, 0, g, False))
    else:
        for g, group in enumerate(opt.param_groups):
            for p in group["params"]:
                out.append(Piece(name(p, g), tuple(p.shape), 0, p.numel(), p, 0, g, False))
    return out


def _group_fqns(engine: Engine) -> list[list[str]]:
    """The fqns of each optimizer param group, in the group's order (every rank alike)."""
    name = _namer(engine)
    opt, kind = engine.optimizer, _kind(engine)
    if kind == "zero12":
        groups = opt.bit16_groups
    elif kind == "bf16":
        groups = opt.bf16_groups
    elif kind in ("fused", "unfused"):
        groups = opt.fp16_groups
    elif kind == "zero3":
        n = len(torch_optimizer(engine).param_groups)
        rows: list[list[str]] = [[] for _ in range(n)]
        for sg, params in enumerate(opt.fp16_groups):
            g = int(opt.sub_group_to_group_id[sg])
            rows[g] += [name(p, g) for p in params]
        return rows
    else:
        groups = [g["params"] for g in opt.param_groups]
    return [[name(p, g) for p in ps] for g, ps in enumerate(groups)]


def _zero3_frozen(engine: Engine, p: Any) -> FlatShard | None:  # Any: a parameter with DeepSpeed's ds_* attributes
    """A frozen ZeRO-3 parameter: this rank's partition, in the module's dtype."""
    opt = engine.optimizer
    pnumel = int(p.partition_numel())
    start = opt._get_param_partition_rank(p) * pnumel
    n = max(0, min(pnumel, int(p.ds_numel) - start))
    return FlatShard(p.ds_tensor.detach().view(-1).narrow(0, 0, n), tuple(p.ds_shape), start) if n else None


def _model_leaves(engine: Engine, ps: list[Piece]) -> dict[str, object]:
    """``model/``: the fp32 master of every trainable parameter (under each of its
    names, tied weights included), frozen parameters as held, persistent buffers."""
    names = param_names(engine.module)
    by_fqn = {pc.fqn: pc for pc in ps}
    trainable = {fqn for row in _group_fqns(engine) for fqn in row}
    zero3 = _kind(engine) == "zero3"
    out: dict[str, object] = {}
    for prefix, mod in engine.module.named_modules(remove_duplicate=False):
        for n, p in mod._parameters.items():
            if p is None:
                continue
            fqn = canonical_name(f"{prefix}.{n}" if prefix else n)
            own = names[id(p)]
            if own in trainable:
                pc = by_fqn.get(own)
                leaf: object = pc.view(pc.key) if pc is not None else None  # None: this rank holds none of it
            elif zero3 and hasattr(p, "ds_tensor"):
                leaf = _zero3_frozen(engine, p)
            else:
                leaf = p.data
            if leaf is not None:
                out[fqn] = leaf
        for n, b in mod._buffers.items():
            if b is not None and n not in mod._non_persistent_buffers_set:
                out[canonical_name(f"{prefix}.{n}" if prefix else n)] = b
    return out


def _optimizer_leaves(engine: Engine, ps: list[Piece]) -> dict[str, object]:
    topt = torch_optimizer(engine)
    state: dict[str, object] = {}
    for pc in ps:
        st = topt.state.get(pc.key)
        if not st:
            continue  # never stepped: DeepSpeed creates the state at the first step
        row: dict[str, object] = {}
        for name, v in st.items():
            if torch.is_tensor(v) and v.dim() > 0 and v.shape == pc.key.shape:
                row[name] = pc.view(v)
            elif (torch.is_tensor(v) and v.dim() == 0) or isinstance(v, (bool, int, float)) or v is None:
                row[name] = v  # step: one per flat partition, the same for every parameter in it
            else:
                raise UnsupportedConfigError(
                    f"optimizer state {name!r} of parameter {pc.fqn!r} is a {type(v).__name__} of shape "
                    f"{tuple(getattr(v, 'shape', ()))}, neither laid out like the parameters nor a scalar; "
                    "shardpoint saves DeepSpeed optimizers whose state is per element (Adam, AdamW, SGD momentum)"
                )
        state[pc.fqn] = row
    groups: list[dict[str, object]] = []
    for g, fqns in zip(topt.param_groups, _group_fqns(engine), strict=True):
        groups.append(hyperparameters(g, fqns))
    return {"state": state, "param_groups": groups}


def train_state_parts(engine: Engine) -> dict[str, object]:
    """The nested state of a DeepSpeed engine (live views, no copies): ``model``,
    ``optimizer``, ``scheduler`` (if the engine has one) and ``engine``. Used by
    :func:`save` and by ``TrainState(model=engine)``."""
    ps = pieces(engine)
    out: dict[str, object] = {
        "model": _model_leaves(engine, ps),
        "optimizer": _optimizer_leaves(engine, ps),
        "engine": {
            "global_steps": int(engine.global_steps),
            "global_samples": int(engine.global_samples),
            "skipped_steps": int(engine.skipped_steps),
        },
    }
    if engine.lr_scheduler is not None:
        out["scheduler"] = engine.lr_scheduler
    return out


# -- loading ---------------------------------------------------------------------------------
def prepare_train_state(engine: Engine, entries: Entries, select: Callable[[str], bool]) -> list[str]:
    """Before a load: create the optimizer state of an engine that has never stepped
    (zeros, laid out like DeepSpeed's flat partitions, as the optimizer's first step
    would), for every partition that the checkpoint has selected state for, so that
    the load fills it in place. Returns the checkpoint keys whose state was created."""
    topt = torch_optimizer(engine)
    by_key: dict[int, tuple[torch.Tensor, list[Piece]]] = {}
    for pc in pieces(engine):
        by_key.setdefault(id(pc.key), (pc.key, []))[1].append(pc)
    adam = isinstance(topt, (torch.optim.Adam, torch.optim.AdamW))
    saved = OptimizerEntries(entries, select)
    created: list[str] = []
    for key, kps in by_key.values():
        if topt.state.get(key):
            continue
        found: dict[str, tuple[str, Entry]] = {}
        for pc in kps:
            for name, ke in saved.of(pc.fqn).items():
                found.setdefault(name, ke)
                created.append(ke[0])
        if not found:
            continue
        want = dict.fromkeys(found)
        if adam:
            want.update(dict.fromkeys(_ADAM_STATE))
            if topt.param_groups[kps[0].group].get("amsgrad"):
                want["max_exp_avg_sq"] = None
        new: dict[str, object] = {}
        for name in want:
            hit = found.get(name)
            if hit is None:  # Adam state the checkpoint lacks: as Adam's first step makes it
                new[name] = torch.zeros((), dtype=torch.float32) if name == "step" else torch.zeros_like(key).detach()
            elif not isinstance(hit[1], TensorEntry):
                new[name] = 0  # a plain value, set from the checkpoint by apply_train_state
            elif name != "step" and tuple(hit[1].shape) == kps[0].shape:  # per element: like the partition
                new[name] = torch.zeros_like(key, memory_format=torch.preserve_format).detach()
            else:  # a scalar (step) or another shape: as saved
                new[name] = zeros_like_entry(hit[0], hit[1], None)
        topt.state[key] = new
    return created


def apply_train_state(engine: Engine, sd: Mapping[str, object]) -> None:
    """After the tensors were filled in place: set hyperparameters, plain optimizer
    values and the engine's counters. Not collective; :func:`finish_load` (collective)
    must follow to refresh the low-precision weights."""
    topt = torch_optimizer(engine)
    opt_sd = sd.get("optimizer")
    if isinstance(opt_sd, Mapping):
        saved_groups = opt_sd.get("param_groups")
        if saved_groups is not None:
            apply_param_groups(topt.param_groups, saved_groups, _group_fqns(engine))
        saved_state = opt_sd.get("state") or {}
        for pc in pieces(engine):
            for name, v in (saved_state.get(pc.fqn) or {}).items():
                if (v is None or isinstance(v, (bool, int, float))) and pc.key in topt.state:
                    topt.state[pc.key][name] = v  # a plain value (tensors were filled in place)
    counters = sd.get("engine")
    if isinstance(counters, Mapping):
        for name in ("global_steps", "global_samples", "skipped_steps"):
            if name in counters:
                setattr(engine, name, int(counters[name]))


@torch.no_grad()
def finish_load(engine: Engine) -> None:
    """Collective over the engine's data-parallel group: copy the fp32 masters into
    the module's low-precision weights (all-gathering ZeRO-1/2 partitions, gathering
    ZeRO-3 persistent parameters) and link DeepSpeed's per-parameter views of the
    optimizer state, so ``safe_get_full_optimizer_state`` works before the next step."""
    opt, kind = engine.optimizer, _kind(engine)
    topt = torch_optimizer(engine)
    if kind in ("zero12", "bf16"):
        opt.update_lp_params()
        flats = opt.single_partition_of_fp32_groups if kind == "zero12" else opt.fp32_groups_flat_partition
        if all(topt.state.get(f) for f in flats):
            opt._hp_optimizer_states_linked = False
            opt._lazy_init_hp_params_optimizer_state()
    elif kind == "zero3":
        opt.checkpoint_event_prologue()
        for sg in range(len(opt.fp16_groups)):
            opt._reassign_or_swap_out_partitioned_parameters(sg)
        opt.checkpoint_event_epilogue()
    elif kind == "fused":
        for lp, hp in zip(opt.fp16_groups_flat, opt.fp32_groups_flat, strict=True):
            lp.copy_(hp)
    elif kind == "unfused":
        for lps, hps in zip(opt.fp16_groups, opt.fp32_groups, strict=True):
            for lp, hp in zip(lps, hps, strict=True):
                lp.data.copy_(hp.data)


class EngineAdapter(Adapter):
    """The :mod:`shardpoint.adapters` adapter of a DeepSpeed engine (and of its
    subclasses: ``PipelineEngine``, ``DeepSpeedHybridEngine``): its parts are
    :func:`train_state_parts`; a load creates a never-stepped optimizer's state
    (:func:`prepare_train_state`), applies hyperparameters and counters
    (:func:`apply_train_state`) and refreshes the low-precision weights
    (:func:`finish_load`, collective)."""

    transient = ("model", "optimizer", "engine")

    owner: Engine

    def __init__(self, owner: Engine, *, optimizer: object = None, key_map: KeyMap | None = None) -> None:
        super().__init__(owner, optimizer=optimizer, key_map=key_map)
        if key_map is not None:
            raise UnsupportedConfigError(
                "key_map is not supported for a DeepSpeed engine: load the checkpoint into the plain model "
                "(TrainState(model=model, key_map=...)) before deepspeed.initialize, or rename the module's layers"
            )
        if optimizer is not None and optimizer is not owner.optimizer and optimizer is not torch_optimizer(owner):
            raise UsageError(
                "TrainState(model=engine, optimizer=...) was given an optimizer that is not the engine's; a DeepSpeed "
                "engine saves its own optimizer (engine.optimizer): leave optimizer= out"
            )

    def state(self) -> dict[str, object]:
        return train_state_parts(self.owner)

    def prepare_load(self, entries: Entries, select: Callable[[str], bool]) -> list[str]:
        return prepare_train_state(self.owner, entries, select)

    def apply(self, sd: Mapping[str, object]) -> None:
        apply_train_state(self.owner, sd)

    def finish_load(self) -> None:
        finish_load(self.owner)


class EngineState(TrainState):
    """A DeepSpeed engine, its client state and this rank's RNG streams as one
    Stateful object for :func:`shardpoint.save` / :func:`shardpoint.load` and
    :class:`~shardpoint.CheckpointManager`. A load into it refreshes the engine's
    low-precision weights (collective, after every rank loaded).

    Args:
        engine: the DeepSpeed engine.
        client_state: a dict saved under ``client/`` and updated in place on load.
        rng: as :class:`~shardpoint.TrainState`'s: the RNG streams of every rank
            (dropout masks continue exactly on the same world size).
    """

    def __init__(self, engine: Engine, client_state: dict[str, Any] | None = None, *, rng: bool | int = True) -> None:
        super().__init__(model=engine, rng=rng)
        self.engine = engine
        self.client_state = client_state

    def state_dict(self) -> dict[str, Any]:
        out = super().state_dict()
        if self.client_state is not None:
            out["client"] = self.client_state
        return out

    def load_state_dict(self, sd: Mapping[str, Any]) -> None:
        super().load_state_dict(sd)
        if self.client_state is not None and isinstance(sd.get("client"), Mapping) and sd["client"] is not self.client_state:
            self.client_state.update(sd["client"])

    def _transient(self) -> tuple[str, ...]:
        # client state nobody asked for, a scheduler the engine does not have: created nowhere
        out = super()._transient()
        out += ("client",) if self.client_state is None else ()
        return out + (("scheduler",) if self.engine.lr_scheduler is None else ())


# -- the public API ----------------------------------------------------------------------------
def save(
    engine: Engine,
    path: str | os.PathLike[str],
    *,
    client_state: dict[str, Any] | None = None,
    rng: bool | int = True,
    overwrite: bool = False,
    timeout: timedelta | float = timedelta(minutes=10),
    storage_options: dict[str, Any] | None = None,
) -> None:
    """Save a DeepSpeed engine (ZeRO stage 0-3): fp32 master weights, optimizer state,
    param_groups, LR scheduler, global steps and samples, and ``client_state``.
    Collective: every rank calls it. Each rank writes only the ZeRO partition it
    owns; the checkpoint loads on any world size with :func:`load`, or into a plain
    PyTorch / FSDP2 model with :class:`shardpoint.TrainState`.

    ``client_state`` must be the same on every rank (wrap per-rank values in
    :class:`shardpoint.PerRank`). ``rng`` (True, a base seed, or False) saves every
    rank's RNG streams, as :class:`shardpoint.TrainState` does, so a resume on the same
    ranks continues bit for bit (dropout included)."""
    from .. import api

    api.save(EngineState(engine, client_state, rng=rng), path, overwrite=overwrite, timeout=timeout,
             storage_options=storage_options)


def load(
    engine: Engine,
    path: str | os.PathLike[str],
    *,
    client_state: dict[str, Any] | None = None,
    rng: bool | int = True,
    only: list[str] | str | None = None,
    exclude: list[str] | str | None = None,
    strict: bool = True,
    timeout: timedelta | float = timedelta(minutes=10),
    storage_options: dict[str, Any] | None = None,
) -> LoadReport:
    """Load a checkpoint into a DeepSpeed engine, in place, on any world size and ZeRO
    stage. Collective. The engine, its module, optimizer and LR scheduler stay the
    same objects. An engine that has never stepped gets its optimizer state created
    (no dummy step). The module's low-precision weights are refreshed from the loaded
    fp32 masters. Each rank's RNG streams are restored (a rank new since the save
    derives fresh ones; ``report.per_rank["rng/streams"]`` says which); a checkpoint
    saved without them leaves the streams alone.

    Args:
        client_state: a dict that receives the saved client state (updated in place).
        rng: True, a base seed for new ranks, or False to leave RNG alone.
        only / exclude: key prefixes to load or to leave out, e.g.
            ``exclude=["optimizer"]`` to load weights only.
        strict: raise :class:`~shardpoint.KeyMismatchError` if the engine has state
            the checkpoint lacks.
    """
    from .. import api

    state = EngineState(engine, client_state, rng=rng)
    return api.load(state, path, strict=strict, only=only, exclude=exclude, timeout=timeout, storage_options=storage_options)


def convert(src: str | os.PathLike[str], dst: str | os.PathLike[str], *, tag: str | None = None,
            progress: bool = True, overwrite: bool = False) -> None:
    """Convert a checkpoint written by DeepSpeed's ``engine.save_checkpoint`` (ZeRO 1,
    2 or 3; fp32 or bf16) into a shardpoint checkpoint that loads on any world size.
    See :func:`shardpoint.interop.deepspeed.convert`."""
    from ..interop.deepspeed import convert as _convert

    _convert(src, dst, tag=tag, progress=progress, overwrite=overwrite)

