"""Owners of training state: the protocol they implement and how shardpoint finds them.

An *owner* holds a model and what trains it: a plain ``nn.Module`` with a torch
optimizer, a DeepSpeed engine, and (later) a Lightning module, an Accelerate
accelerator or a Hugging Face Trainer. Each is seen through one :class:`Adapter`,
which does four things::

    state()          its parts as nested state (live tensors, views, FlatShards; no copies)
    prepare_load()   before a load: create what the checkpoint has and it lacks
                     (a never-stepped optimizer's state), so the load fills it in place
    apply()          after the tensors were filled in place: set what is not a tensor
                     (hyperparameters, counters)
    finish_load()    once every rank loaded: a collective refresh (DeepSpeed copies its
                     fp32 masters into the module's low-precision weights)

Adapters are registered by *dotted class name* and found by the owner's class
hierarchy (its MRO), so this module never imports a framework and subclasses match:
a ``PipelineEngine`` uses the ``DeepSpeedEngine`` adapter. An integration registers
its own (``register("lightning.pytorch.core.module.LightningModule",
"shardpoint.integrations.lightning:ModuleAdapter")``); anything unregistered uses
:class:`PlainAdapter`. :class:`~shardpoint.TrainState` puts its ``model`` (and
``optimizer``) through :func:`adapter_for`.

The load hooks of any Stateful object in a state tree (``TrainState`` implements
them) are run by :class:`LoadHooks` wherever the object sits in the tree, with the
manifest's entries and the report keyed relative to it::

    _shardpoint_prepare_load(entries, select)   before the state is walked for the load
    _shardpoint_after_load(report, rank)        after every value was placed (not collective)
    _shardpoint_loaded()                        after every rank succeeded (collective)
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any, cast

import torch

from ._optim import (
    Entries,
    OptimizerEntries,
    apply_param_groups,
    canonical_name,
    hyperparameters,
    param_names,
    state_value,
    zeros_like_entry,
)
from .errors import MissingDependencyError, UnsupportedTypeError, UsageError
from .report import LoadReport
from .runtime import PROCESS
from .tree import Walk, decode_key, walk

__all__ = ["Adapter", "PlainAdapter", "register", "adapter_class", "adapter_for", "LoadHooks"]

Select = Callable[[str], bool]
#: ``key_map``: checkpoint parameter name -> this model's name (None: leave the parameter out).
KeyMap = Mapping[str, str] | Callable[[str], str | None]


class Adapter:
    """The protocol of an owner of training state (subclass it). One instance serves
    one owner; it may keep what a load needs between its steps.

    Args:
        owner: the object that owns the state (a module, an engine, ...).
        optimizer: a separate optimizer, for owners that do not hold one.
        key_map: for fine-tuning, checkpoint parameter name -> this model's name
            (a dict or a callable); an adapter that cannot honour it raises.
    """

    #: Top-level parts of :meth:`state` that are built afresh on every call and never
    #: read back: a key the load creates under them went nowhere (reported unexpected).
    transient: tuple[str, ...] = ()

    # Any: a framework's owner (a module, an untyped engine, a trainer's module) and
    # optimizer (torch's, or a framework's wrapper): each adapter knows its own
    def __init__(self, owner: Any, *, optimizer: Any = None, key_map: KeyMap | None = None) -> None:
        self.owner = owner
        self.optimizer = optimizer
        self.key_map = key_map

    def state(self) -> dict[str, object]:
        """The owner's parts (``model``, ``optimizer``, ...) as nested state."""
        raise NotImplementedError

    def prepare_load(self, entries: Entries, select: Select) -> list[str]:
        """Before a load: create the state the checkpoint has and the owner lacks.
        ``entries`` are the manifest's entries (typed records:
        :class:`~shardpoint.format.model.TensorEntry` and the others) keyed as
        :meth:`state` keys them; returns the keys whose state was created."""
        return []

    def apply(self, sd: Mapping[str, object]) -> None:
        """After the tensors of :meth:`state` were filled in place: set the rest from
        ``sd`` (the filled state). Not collective."""

    def finish_load(self) -> None:
        """After every rank loaded: collective follow-up, called on every rank."""

    def buffers(self) -> frozenset[str]:
        """The names under ``model/`` that are buffers (running statistics, attention
        masks), not parameters: a checkpoint records an infinity in them without being
        unfit to resume from (:mod:`shardpoint.health`). Here: the named buffers of the
        owner, or of its ``module`` (an engine's)."""
        module = self.owner if isinstance(self.owner, torch.nn.Module) else getattr(self.owner, "module", None)
        if not isinstance(module, torch.nn.Module):
            return frozenset()
        return frozenset(canonical_name(n) for n, _ in module.named_buffers())


class PlainAdapter(Adapter):
    """A PyTorch ``nn.Module`` (plain, DDP, ``torch.compile``d, FSDP2) and a torch
    optimizer over its parameters: ``model/<fqn>`` under canonical names,
    ``optimizer/state/<fqn>/<name>`` and ``optimizer/param_groups``."""

    transient = ("model", "optimizer")
    owner: torch.nn.Module | None
    optimizer: torch.optim.Optimizer | None

    def __init__(self, owner: torch.nn.Module | None, *, optimizer: torch.optim.Optimizer | None = None,
                 key_map: KeyMap | None = None) -> None:
        if owner is not None and not isinstance(owner, torch.nn.Module):
            raise UnsupportedTypeError(
                f"TrainState(model=...) takes a torch.nn.Module (plain, DDP, torch.compile'd, FSDP2) or an owner "
                f"with a registered adapter (a DeepSpeed engine), not {type(owner).__name__}. Save other state as an "
                "extra (TrainState(..., weights=my_dict)) or with shardpoint.save directly")
        super().__init__(owner, optimizer=optimizer, key_map=key_map)
        self._load_names: dict[str, str] | None = None  # local fqn -> checkpoint fqn, during a load

    def _ckpt(self, fqn: str) -> str:
        return self._load_names.get(fqn, fqn) if self._load_names is not None else fqn

    def _rows(self) -> list[list[tuple[str, torch.Tensor]]]:
        """Each param group's parameters with their names."""
        names = param_names(self.owner) if self.owner is not None else {}
        assert self.optimizer is not None  # only called with an optimizer
        rows = []
        for gi, g in enumerate(self.optimizer.param_groups):
            row: list[tuple[str, torch.Tensor]] = []
            for pi, p in enumerate(g["params"]):
                fqn = names.get(id(p))
                if fqn is None:
                    raise UsageError(
                        f"optimizer param_groups[{gi}] parameter {pi} (shape {tuple(p.shape)}) is not a parameter of "
                        "the model; TrainState names optimizer state by the model's parameter names, so pass the "
                        "model the optimizer trains"
                    )
                row.append((fqn, p))
            rows.append(row)
        return rows

    def state(self) -> dict[str, object]:
        out: dict[str, object] = {}
        if self.owner is not None:
            model: dict[str, object] = {}
            for k, v in self.owner.state_dict().items():
                name = self._ckpt(canonical_name(k))
                if name in model:
                    raise UsageError(
                        f"model keys {k!r} and another both map to {name!r}; cannot name them uniquely: "
                        "rename one, or save the module's state_dict() as a plain dict"
                    )
                model[name] = v
            out["model"] = model
        if self.optimizer is not None:
            opt = self.optimizer
            state: dict[str, object] = {}
            groups: list[dict[str, object]] = []
            for g, row in zip(opt.param_groups, self._rows()):
                groups.append(hyperparameters(g, (self._ckpt(f) for f, _ in row)))
                for fqn, p in row:
                    if opt.state.get(p):
                        state[self._ckpt(fqn)] = opt.state[p]
            out["optimizer"] = {"state": state, "param_groups": groups}
        return out

    def prepare_load(self, entries: Entries, select: Select) -> list[str]:
        self._load_names = self._map_names(entries) if self.key_map is not None else None
        if self.optimizer is None:
            return []
        opt, saved = self.optimizer, OptimizerEntries(entries, select)
        created: list[str] = []
        for group, row in zip(opt.param_groups, self._rows()):
            for fqn, p in row:
                st = opt.state.get(p, {})
                for name, (key, e) in saved.of(self._ckpt(fqn)).items():
                    if name not in st:
                        st = opt.state[p]  # only now: opt.state is a defaultdict
                        # on the parameter's device and dtype (the optimizer's own rules), filled in place there
                        st[name] = state_value(group, p, name, zeros_like_entry(key, e, p))
                        created.append(key)
        return created

    def _map_names(self, entries: Entries) -> dict[str, str]:
        """local fqn -> checkpoint fqn, from ``key_map`` (checkpoint name -> local name)."""
        km = self.key_map
        assert km is not None  # only called with a key_map
        out: dict[str, str] = {}
        for k in entries:
            if not k.startswith("model/"):
                continue
            path = decode_key(k)
            if len(path) == 2 and isinstance(path[1], str):
                old = path[1]
                new = km.get(old, old) if isinstance(km, Mapping) else km(old)
                if new is not None:
                    out[new] = old
        return out

    def apply(self, sd: Mapping[str, object]) -> None:
        opt, osd = self.optimizer, sd.get("optimizer")
        if opt is not None and isinstance(osd, Mapping):
            rows = self._rows()
            if osd.get("param_groups") is not None:
                apply_param_groups(opt.param_groups, osd["param_groups"], [[self._ckpt(f) for f, _ in r] for r in rows])
            saved_state = osd.get("state") or {}
            for group, row in zip(opt.param_groups, rows):
                for fqn, p in row:
                    for name, v in (saved_state.get(self._ckpt(fqn)) or {}).items():
                        # what load_state_dict would do: device (and dtype) by the optimizer's rules
                        opt.state[p][name] = state_value(group, p, name, v)
        self._load_names = None

    def finish_load(self) -> None:
        self._load_names = None


# -- the registry ------------------------------------------------------------------------------
#: dotted class name -> adapter ("module:Class", imported on first use) or adapter class.
#: The adapters shardpoint knows without being told (by dotted class name); what
#: :func:`register` adds, and the classes imported for these names, live in
#: ``runtime.PROCESS.adapters``.
BUILT_IN: Mapping[str, str] = MappingProxyType({
    "deepspeed.runtime.engine.DeepSpeedEngine": "shardpoint.integrations.deepspeed:EngineAdapter",
})


def register(class_name: str, adapter: str | type[Adapter]) -> None:
    """Use ``adapter`` for objects of the class ``class_name`` and its subclasses.

    Args:
        class_name: the owner's class as ``module.QualifiedName``, the module being
            where the class is defined (``type(obj).__module__``), e.g.
            ``"deepspeed.runtime.engine.DeepSpeedEngine"``.
        adapter: an :class:`Adapter` subclass, or ``"package.module:ClassName"`` to
            import only when such an owner is first seen (keeps frameworks lazy).
    """
    PROCESS.adapters[class_name] = adapter


def adapter_class(owner: object) -> type[Adapter] | None:
    """The adapter registered for the nearest class in ``type(owner).__mro__``, or None."""
    for cls in type(owner).__mro__:
        name = f"{cls.__module__}.{cls.__qualname__}"
        found = PROCESS.adapters.get(name, BUILT_IN.get(name))
        if found is None:
            continue
        if isinstance(found, str):
            module, _, attr = found.partition(":")
            try:
                found = getattr(importlib.import_module(module), attr)
            except (ImportError, AttributeError) as e:
                raise MissingDependencyError(
                    f"the adapter {found!r} registered for {cls.__module__}.{cls.__qualname__} cannot be imported "
                    f"({type(e).__name__}: {e}); install the integration's extra, or register another adapter"
                ) from e
            assert isinstance(found, type)
            PROCESS.adapters[name] = found
        if not isinstance(found, type):
            raise UsageError(f"the adapter registered for {name} is {found!r}, not a class; "
                             "register an Adapter subclass or a 'package.module:ClassName' string")
        return cast("type[Adapter]", found)
    return None


def adapter_for(owner: object, *, optimizer: object = None, key_map: KeyMap | None = None) -> Adapter:
    """The adapter of ``owner``: the registered one for its class hierarchy, else
    :class:`PlainAdapter` (``owner`` an ``nn.Module`` or None)."""
    cls = adapter_class(owner) if owner is not None else None
    return (cls or PlainAdapter)(owner, optimizer=optimizer, key_map=key_map)


# -- load hooks anywhere in the tree -------------------------------------------------------------
_HOOKS = ("_shardpoint_prepare_load", "_shardpoint_after_load", "_shardpoint_loaded")


def _has_hooks(obj: object) -> bool:
    return any(callable(getattr(obj, h, None)) for h in _HOOKS)


def _under(entries: Entries, key: str) -> Entries:
    """``entries`` below ``key``, keyed relative to it."""
    if key == "":
        return entries
    head = key + "/"
    return {k[len(head) :]: e for k, e in entries.items() if k.startswith(head)}


class LoadHooks:
    """The Stateful objects with load hooks in one state tree, and their hooks run in
    load order. Objects inside a :class:`~shardpoint.PerRank` value are not searched."""

    def __init__(self) -> None:
        self.owners: list[tuple[str, object]] = []  # (key, object), outermost first

    def prepare(self, state: object, entries: Entries, select: Select) -> Walk:
        """Run every object's ``_shardpoint_prepare_load`` and return the walk of
        ``state`` that the load uses (taken after the objects created their state).
        The root's hook runs before any walk; nested objects are found by one walk,
        and the state is walked again only if one of them has a prepare hook."""
        if _has_hooks(state):
            self._prepare("", state, entries, select)
        w = walk(state)
        nested = [(k, o) for k, o in w.stateful if o is not state and _has_hooks(o)]
        if not nested:
            return w
        again = False
        for key, obj in nested:
            again |= self._prepare(key, obj, entries, select)
        return walk(state) if again else w

    def _prepare(self, key: str, obj: object, entries: Entries, select: Select) -> bool:
        self.owners.append((key, obj))
        hook = getattr(obj, "_shardpoint_prepare_load", None)
        if not callable(hook):
            return False
        head = key + "/" if key else ""
        hook(_under(entries, key), (lambda k: select(head + k)) if head else select)
        return True

    def after_load(self, report: LoadReport, rank: int) -> None:
        """Each object's ``_shardpoint_after_load``, innermost first, on the part of the
        report under its key (keyed relative to it)."""
        for key, obj in reversed(self.owners):
            hook = getattr(obj, "_shardpoint_after_load", None)
            if callable(hook):
                sub = report.take(key)
                try:
                    hook(sub, rank)
                finally:
                    report.put(key, sub)

    def loaded(self) -> None:
        """Each object's ``_shardpoint_loaded`` (collective), outermost first; only
        after every rank's load succeeded."""
        for _, obj in self.owners:
            hook = getattr(obj, "_shardpoint_loaded", None)
            if callable(hook):
                hook()
