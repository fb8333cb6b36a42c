"""Import a checkpoint written by DeepSpeed's ``engine.save_checkpoint``.

A DeepSpeed ZeRO checkpoint is one optimizer file per data-parallel rank
(``[bf16_]zero_pp_rank_<r>_mp_rank_00_optim_states.pt``) holding that rank's flat
fp32 partition and the Adam moments laid out like it, plus a model-states file with
the parameter names and shapes in flattening order, the buffers, the LR scheduler
and the counters. Each old rank's file becomes that rank's state of
:class:`~shardpoint.layout.FlatShard` leaves (the same partition, now labelled with
the element range of every parameter it covers) and is written by
``save_offline`` before the next one is read: peak memory is the largest file.

Files are read with ``torch.load(weights_only=True)`` and an explicit allowlist of
the four classes DeepSpeed puts in them (unpickled as local stand-ins, so DeepSpeed
need not be installed); anything else is refused, naming the class.
"""

from __future__ import annotations

import enum
import math
import os
import pickle
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypedDict

import torch

from ..errors import CheckpointNotFoundError, ConversionError, UnsupportedCheckpointError
from ..layout import FlatShard
from ..state import canonical_name
from ._progress import Progress

__all__ = ["convert", "rank_states", "inspect", "SAFE_GLOBALS", "DeepSpeedCheckpoint"]

#: Keys of DeepSpeed's model-states file that are DeepSpeed's own; the rest is client state.
_DS_KEYS = {
    "module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
    "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd", "sparse_tensor_module_names",
    "skipped_steps", "global_steps", "global_samples", "dp_world_size", "mp_world_size",
    "checkpoint_parallel_dimensions", "ds_config", "ds_version", "universal_checkpoint_info", "autoep_layers",
    "ds_autoep_layers", "mp_rank", "iteration",
}


class ZeroStageEnum(int, enum.Enum):
    """Stand-in for ``deepspeed.runtime.zero.config.ZeroStageEnum``."""

    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3


class LossScaler:
    """Stand-in for ``deepspeed.runtime.fp16.loss_scaler.LossScaler`` (its fields land in ``__dict__``)."""


class DynamicLossScaler(LossScaler):
    """Stand-in for ``deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler``."""


@dataclass  # no slots: the unpickler fills __dict__
class fragment_address:  # noqa: N801 - DeepSpeed's name
    """Stand-in for ``deepspeed.utils.tensor_fragment.fragment_address``."""

    numel: int
    start: int


#: The classes DeepSpeed 0.19's ZeRO checkpoints contain besides tensors and builtins,
#: each mapped to a local stand-in: reading a checkpoint never imports (or runs)
#: DeepSpeed code, and works where DeepSpeed is not installed.
_STAND_INS: list[Callable[..., object] | tuple[Callable[..., object], str]] = [
    (ZeroStageEnum, "deepspeed.runtime.zero.config.ZeroStageEnum"),
    (LossScaler, "deepspeed.runtime.fp16.loss_scaler.LossScaler"),
    (DynamicLossScaler, "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"),
    (fragment_address, "deepspeed.utils.tensor_fragment.fragment_address"),
]
SAFE_GLOBALS = [entry[1] for entry in _STAND_INS if isinstance(entry, tuple)]


def load_file(path: str) -> Any:  # Any: what DeepSpeed pickled (a dict, read by its known keys)
    """``torch.load`` one DeepSpeed file: weights only, memory-mapped, allowlisted classes."""
    try:
        with torch.serialization.safe_globals(_STAND_INS):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as e:
        try:
            bad = [g for g in torch.serialization.get_unsafe_globals_in_checkpoint(path) if g not in SAFE_GLOBALS]
        except Exception:  # noqa: BLE001 - fall back to torch's own message
            bad = re.findall(r"GLOBAL ([\w.]+)", str(e))
        raise UnsupportedCheckpointError(
            f"{path}: refusing to unpickle {', '.join(bad) or 'an object'}: "
            f"{'it is' if len(bad) == 1 else 'they are'} not among the classes DeepSpeed puts in its checkpoints "
            f"({', '.join(SAFE_GLOBALS)}), and unpickling an unknown class can run arbitrary code. If you trust "
            "this file, load it with torch.load(weights_only=False), drop the object, and save it again"
        ) from None


# -- finding the files -----------------------------------------------------------------------------
@dataclass(slots=True)
class DeepSpeedCheckpoint:
    """The files of one DeepSpeed checkpoint tag."""

    folder: str
    stage: int  # 1/2 (one flat partition per param group) or 3 (per-parameter partitions)
    world_size: int
    optim_files: list[str]
    model_files: list[str]  # one (stage 1/2) or one per rank (stage 3)


def _natural(name: str) -> list[int | str]:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def inspect(src: str | os.PathLike[str], tag: str | None = None) -> DeepSpeedCheckpoint:
    """Find the files of the checkpoint ``tag`` (default: the one ``src/latest``
    names; ``src`` may also be the tag folder itself)."""
    src = os.fspath(src)
    if not os.path.isdir(src):
        raise CheckpointNotFoundError(f"no DeepSpeed checkpoint at {src}: not a directory")
    if tag is not None:
        folder = os.path.join(src, tag)
    elif any(f.endswith("_optim_states.pt") for f in os.listdir(src)):
        folder = src
    else:
        latest = os.path.join(src, "latest")
        if not os.path.exists(latest):
            raise CheckpointNotFoundError(
                f"{src} has no 'latest' file and no *_optim_states.pt files; pass tag= (e.g. 'global_step100') "
                "or the tag folder itself"
            )
        with open(latest) as f:
            folder = os.path.join(src, f.read().strip())
    if not os.path.isdir(folder):
        raise CheckpointNotFoundError(f"DeepSpeed checkpoint tag folder {folder} does not exist")
    names = sorted(os.listdir(folder), key=_natural)
    optim = [n for n in names if re.fullmatch(r"(bf16_)?zero_pp_rank_\d+_mp_rank_\d+_optim_states\.pt", n)]
    if not optim:
        raise UnsupportedCheckpointError(
            f"{folder} holds no ZeRO optimizer files (*zero_pp_rank_*_optim_states.pt): it is not a ZeRO stage 1-3 "
            "checkpoint. For ZeRO stage 0, load it with engine.load_checkpoint and save the engine with "
            "shardpoint.integrations.deepspeed.save"
        )
    if any(not n.endswith("mp_rank_00_optim_states.pt") for n in optim):
        raise UnsupportedCheckpointError(f"{folder}: model-parallel checkpoints (mp_rank > 0) are not supported")
    # every name matched the pattern above, so the search finds the rank in each
    by_rank = {int(m.group(1)): os.path.join(folder, n) for n in optim if (m := re.search(r"zero_pp_rank_(\d+)_", n))}
    world = len(by_rank)
    if sorted(by_rank) != list(range(world)):
        raise ConversionError(f"{folder}: optimizer files for ranks {sorted(by_rank)}; expected ranks 0..{world - 1}. "
                              "Convert the step folder with every rank's files (copy the missing ones back)")
    z3_models = [n for n in names if re.fullmatch(r"zero_pp_rank_\d+_mp_rank_00_model_states\.pt", n)]
    if z3_models:
        stage = 3
        models = {int(m.group(1)): os.path.join(folder, n) for n in z3_models if (m := re.search(r"zero_pp_rank_(\d+)_", n))}
        if sorted(models) != list(range(world)):
            raise ConversionError(f"{folder}: ZeRO-3 model-states files for ranks {sorted(models)}; expected "
                                  f"0..{world - 1}. Convert the step folder with every rank's files")
        model_files = [models[r] for r in range(world)]
    else:
        stage = 2
        model_files = [os.path.join(folder, "mp_rank_00_model_states.pt")]
        if not os.path.exists(model_files[0]):
            raise ConversionError(f"{folder} has no mp_rank_00_model_states.pt; convert the step folder DeepSpeed "
                                  "wrote (global_stepN/) with all of its files")
    return DeepSpeedCheckpoint(folder, stage, world, [by_rank[r] for r in range(world)], model_files)


# -- one old rank's state ---------------------------------------------------------------------------
def _numel(shape: Iterable[int]) -> int:
    return math.prod(int(s) for s in shape)


class _ModelStates(TypedDict, total=False):
    """The keys of DeepSpeed's model-states file read here (any other key is client state)."""

    module: dict[str, torch.Tensor]
    buffer_names: list[str]
    param_shapes: list[dict[str, Sequence[int]]]  # per flat group: fqn -> shape
    frozen_param_shapes: dict[str, Sequence[int]]
    frozen_param_fragments: dict[str, torch.Tensor]
    shared_params: dict[str, str]  # alias -> source
    lr_scheduler: object
    global_steps: int
    global_samples: int
    skipped_steps: int
    mp_world_size: int | None


class _ParamGroup(TypedDict, total=False):
    """An optimizer param group as DeepSpeed saves it: its parameters' indexes, and hyperparameters."""

    params: list[int]


# osd is DeepSpeed's optimizer file as loaded (Any: read by its known keys)
def _global_state(model_sd: _ModelStates, groups: list[_ParamGroup], group_fqns: list[list[str]]) -> dict[str, object]:
    """What rank 0 writes once: param_groups, scheduler, counters, client state."""
    out: dict[str, object] = {}
    if groups:  # an elastic checkpoint keeps no param_groups
        pgs = []
        for g, fqns in zip(groups, group_fqns, strict=True):
            hp = {k: v for k, v in g.items() if k != "params"}
            hp["params"] = list(fqns)
            pgs.append(hp)
        out["optimizer"] = {"param_groups": pgs}
    if model_sd.get("lr_scheduler") is not None:
        out["scheduler"] = model_sd["lr_scheduler"]
    out["engine"] = {
        "global_steps": int(model_sd.get("global_steps", 0)),
        "global_samples": int(model_sd.get("global_samples", 0)),
        "skipped_steps": int(model_sd.get("skipped_steps", 0)),
    }
    client = {k: v for k, v in model_sd.items() if k not in _DS_KEYS}
    if client:
        out["client"] = client
    return out


def _buffers(model_sd: _ModelStates) -> dict[str, object]:
    names = set(model_sd.get("buffer_names") or [])
    return {canonical_name(k): v for k, v in (model_sd.get("module") or {}).items() if k in names}


def _base_state(osd: dict[str, Any]) -> tuple[list[Mapping[str, object]], list[_ParamGroup]]:
    """(per flat group: its optimizer state, per param group: hyperparameters)."""
    base = osd.get("base_optimizer_state", osd.get("optimizer_state_dict"))
    if base is None:
        raise ConversionError("a DeepSpeed optimizer file without base_optimizer_state / optimizer_state_dict: not a "
                              "ZeRO optimizer-states file DeepSpeed wrote; check the files in the folder")
    if isinstance(base, list):  # elastic_checkpoint: one unpadded state per group, no param_groups
        return base, []
    state = base.get("state", {})
    return [state.get(i, {}) for i in range(len(state))], list(base.get("param_groups", []))


def _slices(rank_flat_lo: int, n: int, layout: list[tuple[str, tuple[int, ...], int]]) -> Iterator[tuple[str, tuple[int, ...], int, int, int]]:
    """For a rank holding elements ``[lo, lo + n)`` of a group's flat vector in which
    parameter ``fqn`` starts at ``offset``: (fqn, shape, start in the parameter,
    offset in the rank's partition, numel) of each overlap."""
    hi = rank_flat_lo + n
    for fqn, shape, off in layout:
        numel = _numel(shape)
        a, b = max(off, rank_flat_lo), min(off + numel, hi)
        if a < b:
            yield fqn, shape, a - off, a - rank_flat_lo, b - a


def _state_leaves(state: Mapping[str, object], flat_numel: int, fqn: str, shape: tuple[int, ...], start: int, pos: int,
                  n: int) -> dict[str, object]:
    row: dict[str, object] = {}
    for name, v in state.items():
        if torch.is_tensor(v) and v.dim() == 1 and v.numel() >= flat_numel and v.numel() > 0:
            row[name] = FlatShard(v.narrow(0, pos, n), shape, start)
        elif (torch.is_tensor(v) and v.dim() == 0) or isinstance(v, (bool, int, float)):
            row[name] = v
        else:
            raise UnsupportedCheckpointError(
                f"optimizer state {name!r} of {fqn!r} has an unexpected layout ({type(v).__name__}); the converter "
                "reads per-element optimizer state (Adam, AdamW, SGD momentum); for other optimizers consolidate the "
                "weights with DeepSpeed's zero_to_fp32 and import those")
    return row


def _zero12_rank(ck: DeepSpeedCheckpoint, rank: int, model_sd: _ModelStates, cursor: list[int]) -> dict[str, object]:
    """Stage 1/2 (and BF16_Optimizer): rank ``rank`` holds elements
    ``[cursor[g], cursor[g] + n)`` of group g's unpadded flat vector (ranks' unpadded
    partitions are consecutive, as zero_to_fp32 concatenates them)."""
    osd = load_file(ck.optim_files[rank])["optimizer_state_dict"]
    fp32 = osd["single_partition_of_fp32_groups"]
    states, groups = _base_state(osd)
    paddings = osd.get("param_alignment_paddings")
    model: dict[str, object] = {}
    opt_state: dict[str, object] = {}
    for g, shapes in enumerate(model_sd["param_shapes"]):
        layout: list[tuple[str, tuple[int, ...], int]] = []
        off = 0
        for j, (name, shape) in enumerate(shapes.items()):
            layout.append((canonical_name(name), tuple(int(s) for s in shape), off))
            off += _numel(shape) + (paddings[g][j] if paddings is not None else 0)
        flat = fp32[g]
        for fqn, shape, start, pos, n in _slices(cursor[g], flat.numel(), layout):
            model[fqn] = FlatShard(flat.narrow(0, pos, n), shape, start)
            if g < len(states) and states[g]:
                opt_state[fqn] = _state_leaves(states[g], flat.numel(), fqn, shape, start, pos, n)
        cursor[g] += flat.numel()
    out: dict[str, object] = {"model": model, "optimizer": {"state": opt_state}}
    if rank == 0:
        fqns = [[canonical_name(n) for n in shapes] for shapes in model_sd["param_shapes"]]
        _merge(out, _global_state(model_sd, groups, fqns))  # no "model" in it: out["model"] stays model
        for name, t in (model_sd.get("frozen_param_fragments") or {}).items():
            model[canonical_name(name)] = t
        model.update(_buffers(model_sd))
    _shared(model, model_sd)
    return out


def _zero3_rank(ck: DeepSpeedCheckpoint, rank: int, model_sd: _ModelStates) -> dict[str, object]:
    """Stage 3: every parameter is partitioned on its own into ``ceil(numel / world)``
    elements per rank; a rank's flat groups hold its partitions back to back."""
    world = ck.world_size
    osd = load_file(ck.optim_files[rank])["optimizer_state_dict"]
    flats = osd["fp32_flat_groups"]
    states, groups = _base_state(osd)
    model: dict[str, object] = {}
    opt_state: dict[str, object] = {}
    if len(model_sd["param_shapes"]) != len(flats):
        raise ConversionError(
            f"{ck.optim_files[rank]} holds {len(flats)} flat groups but the model states name {len(model_sd['param_shapes'])}; "
            "the files are not from the same save"
        )
    for sg, shapes in enumerate(model_sd["param_shapes"]):  # one per ZeRO-3 sub-group, in flat order
        pos = 0
        for name, shape_ in shapes.items():
            fqn, shape = canonical_name(name), tuple(int(s) for s in shape_)
            numel = _numel(shape)
            pn = math.ceil(numel / world)
            start = rank * pn
            n = max(0, min(pn, numel - start))
            if n:
                model[fqn] = FlatShard(flats[sg].narrow(0, pos, n), shape, start)
                if sg < len(states) and states[sg]:
                    opt_state[fqn] = _state_leaves(states[sg], flats[sg].numel(), fqn, shape, start, pos, n)
            pos += pn
        if pos != flats[sg].numel():
            raise ConversionError(
                f"{ck.optim_files[rank]}: flat group {sg} holds {flats[sg].numel()} elements, its parameters' "
                f"partitions {pos}; the file does not match the model states"
            )
    for name, frag in (model_sd.get("frozen_param_fragments") or {}).items():
        shape = tuple(int(s) for s in model_sd["frozen_param_shapes"][name])
        pn = math.ceil(_numel(shape) / world)
        n = max(0, min(pn, _numel(shape) - rank * pn))
        if n:
            model[canonical_name(name)] = FlatShard(frag.reshape(-1).narrow(0, 0, n), shape, rank * pn)
    out: dict[str, object] = {"model": model, "optimizer": {"state": opt_state}}
    if rank == 0:
        # param groups list the sub-groups (flat groups) they own, by index
        fqns: list[list[str]] = [[] for _ in groups]
        owner = {int(i): gi for gi, g in enumerate(groups) for i in g.get("params", [])}
        for i, d in enumerate(model_sd["param_shapes"]):
            fqns[owner.get(i, 0)] += [canonical_name(n) for n in d]
        _merge(out, _global_state(model_sd, groups, fqns))  # no "model" in it: out["model"] stays model
        model.update(_buffers(model_sd))
    _shared(model, model_sd)
    return out


def _shared(model: dict[str, object], model_sd: _ModelStates) -> None:
    """Tied weights: DeepSpeed saves one and names the other in ``shared_params``."""
    for alias, source in (model_sd.get("shared_params") or {}).items():
        if canonical_name(source) in model:
            model[canonical_name(alias)] = model[canonical_name(source)]


def _merge(into: dict[str, object], extra: Mapping[str, object]) -> None:
    for k, v in extra.items():
        if isinstance(v, dict) and isinstance(here := into.get(k), dict):  # here is into[k]
            _merge(here, v)
        else:
            into[k] = v


def rank_states(ck: DeepSpeedCheckpoint, progress: bool = False) -> Iterator[tuple[int, dict[str, object]]]:
    """``(rank, state)`` for each old rank, reading one rank's files at a time."""
    cursor: list[int] = []
    model0: _ModelStates | None = None
    with Progress(ck.world_size, f"importing {ck.folder}", enabled=progress, unit="ranks") as bar:
        for rank in range(ck.world_size):
            if ck.stage == 3:
                model_sd = load_file(ck.model_files[rank])
                state = _zero3_rank(ck, rank, model_sd)
            else:
                if model0 is None:
                    model0 = load_file(ck.model_files[0])
                    cursor = [0] * len(model0["param_shapes"])
                model_sd = model0
                state = _zero12_rank(ck, rank, model_sd, cursor)
            if model_sd.get("mp_world_size", 1) not in (1, None):
                raise UnsupportedCheckpointError(f"{ck.folder}: model-parallel checkpoints (mp_world_size > 1) are not supported")
            yield rank, state
            del state, model_sd
            bar.advance()


def convert(src: str | os.PathLike[str], dst: str | os.PathLike[str], *, tag: str | None = None,
            progress: bool = True, overwrite: bool = False, storage_options: dict[str, Any] | None = None) -> None:
    """Convert the DeepSpeed checkpoint at ``src`` (its ``latest`` tag, or ``tag``)
    into a shardpoint checkpoint at ``dst``, as if the ``N`` ranks that wrote it had
    called :func:`shardpoint.integrations.deepspeed.save`. One process, no process
    group; one DeepSpeed rank's files in memory at a time (memory-mapped). The
    progress bar goes to stderr, and only when it is a terminal."""
    from ..api import save_offline

    ck = inspect(src, tag)
    save_offline(rank_states(ck, progress), dst, world_size=ck.world_size, overwrite=overwrite, storage_options=storage_options)
