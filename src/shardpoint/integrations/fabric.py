"""Lightning Fabric: ``fabric.save(path, state)`` and ``fabric.load(path, state)``
through shardpoint, on every rank, resuming on any number of processes.

Fabric's base ``Strategy.save_checkpoint`` calls its ``CheckpointIO`` on global rank 0
only, so a collective ``CheckpointIO`` would hang under DDP; the hook is the strategy,
as for the Trainer (:mod:`shardpoint.integrations.lightning`)::

    from shardpoint.integrations.fabric import ShardpointFabricDDPStrategy

    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=ShardpointFabricDDPStrategy())
    fabric.launch()
    model, optimizer = fabric.setup(model, optimizer)
    state = {"model": model, "optimizer": optimizer, "step": 0}
    fabric.save("ckpt/step-100", state)         # every rank; a directory
    remainder = fabric.load("ckpt/step-100", state)  # in place, on any number of ranks

How Fabric's state dict is saved: its first module and the optimizer that trains it
take the :class:`~shardpoint.TrainState` layout (``model/<fqn>``, optimizer state by
parameter name, so the checkpoint loads into another wrapping or world size and with
``shardpoint.load_full``); every other entry goes under ``extra/<name>``: plain values
(a step counter) are written back into the dict by ``fabric.load``, other modules,
optimizers and schedulers as their ``state_dict()``, and a data loader or sampler with
``state_dict()`` per rank. ``fabric.load(path)`` without a state returns the checkpoint
under the names it was saved with (the optimizer's state keyed by parameter name).
A path that is a file (a checkpoint Fabric's own ``torch.save`` wrote, or a raw state
dict for ``fabric.load_raw``) is read by Fabric's own code, so old checkpoints still load.

Lightning is imported when this module is: ``import shardpoint`` never needs it.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any

import torch

from ..errors import MissingDependencyError, UsageError

try:
    from lightning.fabric.strategies import DDPStrategy
except ImportError as e:  # pragma: no cover - depends on the environment
    raise MissingDependencyError(
        "shardpoint.integrations.fabric needs Lightning Fabric (the `lightning` package): "
        "pip install 'shardpoint[lightning]'"
    ) from e

from .. import api
from ..state import TrainState
from ..tree import PerRank, is_stateful

__all__ = ["ShardpointFabricMixin", "ShardpointFabricDDPStrategy"]

#: Under ``extra/``: which of Fabric's names the TrainState's model and optimizer had.
_NAMES = "fabric_names"


def _base(obj: object) -> Any:
    """Fabric's own strategy methods behind the mixin (``super()`` the type checker follows)."""
    return super(ShardpointFabricMixin, obj)


def _per_rank(obj: object) -> bool:
    """A data loader or sampler: its position is this rank's own (unless it says otherwise)."""
    data = (torch.utils.data.DataLoader, torch.utils.data.Sampler)
    return isinstance(obj, data) and not getattr(obj, "shardpoint_global_state", False)


class _Plan:
    """Fabric's state dict as a :class:`TrainState`: which entry is the model, which the
    optimizer, and the rest as extras."""

    def __init__(self, state: Mapping[str, Any], rng: bool | int) -> None:
        modules = [k for k, v in state.items() if isinstance(v, torch.nn.Module)]
        self.model_name = modules[0] if modules else None
        self.opt_name: str | None = None
        if self.model_name is not None:
            params = {id(p) for p in state[self.model_name].parameters()}
            self.opt_name = next((k for k, v in state.items() if isinstance(v, torch.optim.Optimizer) and all(
                id(p) in params for g in v.param_groups for p in g["params"])), None)
        taken = {self.model_name, self.opt_name}
        extra = {k: (PerRank(v) if _per_rank(v) else v) for k, v in state.items() if k not in taken}
        if _NAMES in extra:
            raise UsageError(f"fabric.save/load: the state's key {_NAMES!r} is where shardpoint records which entries "
                             "are the model and the optimizer; rename that entry")
        extra[_NAMES] = {"model": self.model_name, "optimizer": self.opt_name}
        self.train_state = TrainState(
            model=state[self.model_name] if self.model_name is not None else None,
            optimizer=state[self.opt_name] if self.opt_name is not None else None, rng=rng)
        self.train_state.extra.update(extra)  # not as keywords: an entry may be named "scheduler" or "rng"


class ShardpointFabricMixin:
    """Makes a Fabric strategy save and load through shardpoint on every rank (put it
    first in the bases: ``class S(ShardpointFabricMixin, DDPStrategy)``).

    Args:
        checkpoint_timeout: how long ranks wait for each other at a save or load before
            the call is abandoned with a :class:`~shardpoint.CollectiveMismatchError`
            naming the absent ranks.
        rng: save and restore Python, NumPy and torch RNG streams per rank (an int also
            sets the base seed new ranks derive theirs from; see
            :class:`~shardpoint.TrainState`). Off by default: Fabric code seeds itself.
        **kwargs: the strategy's own arguments.
    """

    def __init__(self, *args: Any, checkpoint_timeout: timedelta | float = api.DEFAULT_TIMEOUT,
                 rng: bool | int = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.checkpoint_timeout = checkpoint_timeout
        self.rng = rng

    def save_checkpoint(self, path: str | os.PathLike[str], state: dict[str, Any], storage_options: Any = None,
                        filter: dict[str, Callable[[str, Any], bool]] | None = None) -> None:
        """Save ``state`` (Fabric's dict of modules, optimizers and values) to the
        directory ``path``, replacing a checkpoint there. Collective: every rank calls
        it, as ``fabric.save`` does; one that does not is named in a
        :class:`~shardpoint.CollectiveMismatchError` on the others."""
        if filter:
            raise UsageError(f"fabric.save(filter=...) is not supported by {type(self).__name__}: it saves whole "
                             "modules (under their parameter names); leave filter out, or load with "
                             "shardpoint.load(..., only=[...]) / exclude=[...] to pick keys instead")
        api.save(_Plan(state, self.rng).train_state, os.fspath(path), overwrite=True, timeout=self.checkpoint_timeout,
                 storage_options=storage_options)

    def load_checkpoint(self, path: str | os.PathLike[str], state: Any = None, strict: bool = True,
                        weights_only: bool | None = None) -> dict[str, Any]:
        """Load the checkpoint at ``path`` into ``state`` in place, from a checkpoint
        saved on any number of ranks (collective); returns what the checkpoint holds
        that ``state`` does not name, as ``fabric.load`` documents. Without ``state``,
        the whole checkpoint (one process may do this alone). A file is left to Fabric's
        own loader. ``weights_only`` changes nothing here: a shardpoint checkpoint
        executes no pickled code."""
        where = os.fspath(path)
        if os.path.isfile(where):
            return dict(_base(self).load_checkpoint(path, state, strict=strict, weights_only=weights_only))
        if not state:
            return _full(where)
        if isinstance(state, torch.optim.Optimizer):
            raise UsageError(f"fabric.load_raw({where!r}, optimizer): a shardpoint checkpoint names optimizer state by "
                             "the model's parameter names; load it with fabric.load(path, {'model': model, "
                             "'optimizer': optimizer})")
        if isinstance(state, torch.nn.Module):  # fabric.load_raw(path, module): the weights only
            api.load(TrainState(model=state, rng=False), where, strict=strict, only=["model"],
                     timeout=self.checkpoint_timeout)
            return {}
        plan = _Plan(state, self.rng)
        ts = plan.train_state
        api.load(ts, where, strict=strict, timeout=self.checkpoint_timeout)
        remainder: dict[str, Any] = {}
        for k, v in ts.extra.items():
            if k == _NAMES:
                continue
            if k not in state:
                remainder[k] = v
            elif not is_stateful(state[k]) and not isinstance(state[k], PerRank):
                state[k] = v  # a plain value: Fabric copies it back into the caller's dict
        return remainder


def _full(path: str) -> dict[str, Any]:
    """The whole checkpoint, under the names it was saved with."""
    saved = api.load_full(path)
    out: dict[str, Any] = dict(saved.get("extra") or {})
    names = out.pop(_NAMES, None) or {}
    for part in ("model", "optimizer"):
        if names.get(part) is not None and part in saved:
            out[names[part]] = saved[part]
    return out


class ShardpointFabricDDPStrategy(ShardpointFabricMixin, DDPStrategy):
    """Fabric's ``DDPStrategy`` whose ``fabric.save`` / ``fabric.load`` go through
    shardpoint on every rank. Takes DDPStrategy's arguments (``process_group_backend``,
    ``timeout``, ...) and :class:`ShardpointFabricMixin`'s."""

    strategy_name = "shardpoint_ddp"
