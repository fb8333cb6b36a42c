"""What every owner of a model and an optimizer needs, whatever wraps them: parameter
names, param-group hyperparameters, and optimizer state created like its parameter.

Neutral ground: :mod:`shardpoint.adapters` (plain PyTorch) and every integration
(DeepSpeed, the trainers) use these, so optimizer state is named, grouped and created
the same way by all of them (``docs/format.md``: ``optimizer/state/<fqn>/<name>``,
``optimizer/param_groups/<i>/<hyperparameter>``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, cast

import torch

from .errors import KeyMismatchError
from .format.datafile import dtype_from_name
from .format.model import Entry, TensorEntry
from .tree import decode_key, join

__all__ = [
    "Entry", "Entries", "canonical_name", "param_names", "hyperparameters", "apply_param_groups", "OptimizerEntries", "zeros_like_entry",
    "state_value",
]

#: The manifest's entries by key (relative to the owner's root).
Entries = Mapping[str, Entry]

_WRAPPER_SEGMENTS = ("module", "_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module")
_STATE = "optimizer/state/"


def canonical_name(name: str) -> str:
    """Drop the segments that wrappers insert (DDP's ``module.``, torch.compile's
    ``_orig_mod.``, activation checkpointing's wrapper) from a parameter name."""
    return ".".join(p for p in name.split(".") if p not in _WRAPPER_SEGMENTS)


def param_names(module: torch.nn.Module) -> dict[int, str]:
    """``id(param) -> canonical name`` for every parameter of ``module`` (a tied
    parameter gets the last of its names, as ``named_parameters`` lists them)."""
    return {id(p): canonical_name(n) for n, p in module.named_parameters(remove_duplicate=False)}


def hyperparameters(group: Mapping[str, object], fqns: Iterable[str]) -> dict[str, object]:
    """One param group as saved: its hyperparameters, and ``params`` as the names of
    its parameters (in the group's order) instead of the tensors."""
    hp = {k: v for k, v in group.items() if k != "params"}
    hp["params"] = list(fqns)
    return hp


def apply_param_groups(groups: list[dict[str, Any]], saved: Sequence[Mapping[str, object]], fqns: list[list[str]]) -> None:
    """Set the saved hyperparameters of each param group, after checking that the
    groups hold the same parameters (by name, in order); raises KeyMismatchError
    naming the first group that differs."""
    if len(saved) != len(groups):
        raise KeyMismatchError(
            f"optimizer: the checkpoint has {len(saved)} param_groups, this optimizer has {len(groups)}; "
            "build the optimizer with the same groups, or exclude=['optimizer']"
        )
    for i, (sg, want) in enumerate(zip(saved, fqns)):
        got = list(cast("Iterable[str]", sg.get("params", want)))  # saved: a list of fqns
        if got != want:
            raise KeyMismatchError(
                f"optimizer param_groups[{i}] holds {want[:5]}... here but {got[:5]}... in the checkpoint; "
                "the groups must hold the same parameters in the same order"
            )
    for g, sg in zip(groups, saved):
        g.update({k: v for k, v in sg.items() if k != "params"})


class OptimizerEntries:
    """The checkpoint's ``optimizer/state/<fqn>/<name>`` entries, indexed by
    parameter once: looking up one parameter's saved state costs a dict lookup, not a
    scan of the manifest (which holds a few entries per parameter of the model).

    Args:
        entries: the manifest's entries, keyed relative to the owner's root.
        select: the load's ``only``/``exclude`` filter on those keys; entries it
            rejects are left out.
    """

    def __init__(self, entries: Entries, select: Callable[[str], bool]) -> None:
        self._by_fqn: dict[str, dict[str, tuple[str, Entry]]] = {}
        for key, e in entries.items():
            if not key.startswith(_STATE):
                continue
            rest = key[len(_STATE) :].split("/")
            if len(rest) != 2 or not select(key):
                continue  # deeper keys (a value that is itself a dict) are filled by the generic load
            name = decode_key(rest[1])[0]
            self._by_fqn.setdefault(rest[0], {})[str(name)] = (key, e)

    def of(self, fqn: str) -> dict[str, tuple[str, Entry]]:
        """``state name -> (checkpoint key, manifest entry)`` saved for parameter ``fqn``."""
        return self._by_fqn.get(join("", fqn), {})


def zeros_like_entry(key: str, e: Entry, like: torch.Tensor | None) -> torch.Tensor | None:
    """A new, zero optimizer state value for the saved entry ``e`` at ``key``: laid
    out like ``like`` (its parameter, or the flat partition it lives in) when the
    shapes agree, else a CPU tensor of the saved shape (Adam's scalar ``step``); the
    saved dtype either way. A plain value becomes ``None``, set when the load fills it."""
    if not isinstance(e, TensorEntry):
        return None
    dtype = dtype_from_name(e.dtype, key=key)
    shape = tuple(e.shape)
    if like is not None and shape == tuple(like.shape):
        return torch.zeros_like(like, dtype=dtype, memory_format=torch.preserve_format).detach()
    return torch.zeros(shape, dtype=dtype)



def state_value(group: Mapping[str, object], param: torch.Tensor, name: str, value: object) -> object:
    """``value`` as ``Optimizer.load_state_dict`` would place it for ``param`` of
    ``group`` (its ``_process_value_according_to_param_policy``): ``step`` stays as it
    is, except for fused or capturable optimizers, which keep it as float32 on the
    parameter's device; any other tensor goes to the parameter's device, and to its
    dtype when the parameter is floating point. A fused or capturable Adam resumed
    into a never-stepped optimizer then steps with its state where it expects it."""
    if not isinstance(value, torch.Tensor):
        return value
    if name == "step":
        if group.get("fused") or group.get("capturable"):
            return value.to(dtype=torch.float32, device=param.device)
        return value
    if param.is_floating_point():
        return value.to(dtype=param.dtype, device=param.device)
    return value.to(device=param.device)
