"""TrainState: one object that owns every part of a training run's state.

It holds *your* objects and restores each of them in place, so nothing has to be
re-bound after a load: ``state.model is model`` before and after, the optimizer
is the same optimizer, and so on. Its key layout (``docs/format.md``) is the one
every integration writes:

    model/<fqn>                        parameters and buffers, canonical names
    optimizer/state/<fqn>/<name>       per-parameter optimizer state
    optimizer/param_groups/<i>/<hp>    hyperparameters; ``params`` lists fqns
    scheduler/...  grad_scaler/...     their state_dict()
    rng/base_seed, rng/streams/...     RNG streams, per rank
    data/...                           a sampler / data loader (per rank unless global)
    extra/<name>/...                   anything else
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from ._optim import Entries, apply_param_groups, canonical_name
from ._rng import RngStreams, derived_seed
from .adapters import Adapter, KeyMap, adapter_for
from .report import LoadReport
from .tree import PerRank, Stateful, decode_key, is_stateful

__all__ = ["TrainState", "canonical_name", "apply_param_groups"]


class TrainState:
    """Everything a training run needs to resume, restored in place.

    Pass it to :func:`shardpoint.save` / :func:`shardpoint.load` or a
    :class:`CheckpointManager`. Every part is optional.

    Args:
        model: an ``nn.Module`` (plain, DDP, ``torch.compile``d, FSDP2), a DeepSpeed
            engine, or any owner with a registered :mod:`shardpoint.adapters` adapter.
            Saved under canonical parameter names, so a checkpoint made with one
            wrapping loads into another.
        optimizer: a ``torch.optim`` optimizer over the model's parameters (an owner
            such as a DeepSpeed engine brings its own). Loading into one that has
            never stepped creates its state like each parameter (no dummy step).
        scheduler: an LR scheduler (anything with ``state_dict``).
        grad_scaler: a ``torch.amp.GradScaler``.
        data: a sampler or data loader with ``state_dict``. Per rank, unless it sets
            ``shardpoint_global_state = True`` (the elastic sampler does).
        rng: True to save and restore Python, NumPy and torch (CPU, CUDA) RNG
            streams per rank; an int does the same and sets the base seed from
            which ranks that did not exist at save time derive their streams
            (``base_seed + 1000003 * rank``, hashed); False to leave RNG alone.
        key_map: for fine-tuning, a dict or callable mapping a checkpoint's parameter
            name to this model's name, applied to ``model/`` and ``optimizer/`` keys.
        **extra: more values (step counters, best metric) or Stateful objects,
            saved under ``extra/<name>``. Plain values are updated on load: read
            them back from ``state.extra[name]``.

    A TrainState restores the same way at the top of the state and nested in it
    (``shardpoint.save({"run": state, ...})``).
    """

    def __init__(
        self,
        model: object = None,
        optimizer: Stateful | None = None,
        scheduler: Stateful | None = None,
        grad_scaler: Stateful | None = None,
        data: Stateful | None = None,
        rng: bool | int = True,
        key_map: KeyMap | None = None,
        **extra: Any,  # Any: the caller's own values, read back as the caller knows them
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.grad_scaler = grad_scaler
        self.data = data
        self._rng = RngStreams(rng)
        self.key_map = key_map
        self.extra: dict[str, Any] = dict(extra)
        self._adapter: tuple[tuple[object, object, object], Adapter] | None = None
        self._created: list[str] = []  # keys whose state the adapter created, during a load

    @property
    def rng(self) -> bool | int:
        """True, a base seed, or False: see the class docstring."""
        return self._rng.rng

    @rng.setter
    def rng(self, value: bool | int) -> None:
        self._rng.rng = value

    derived_seed = staticmethod(derived_seed)

    def adapter(self) -> Adapter | None:
        """The :class:`~shardpoint.adapters.Adapter` of ``model`` and ``optimizer``
        (None without either), made again when either attribute is replaced."""
        if self.model is None and self.optimizer is None:
            return None
        ident = (self.model, self.optimizer, self.key_map)
        if self._adapter is None or any(a is not b for a, b in zip(self._adapter[0], ident)):
            self._adapter = (ident, adapter_for(self.model, optimizer=self.optimizer, key_map=self.key_map))
        return self._adapter[1]

    def _transient(self) -> tuple[str, ...]:
        """Top-level parts whose created keys go nowhere (see ``Adapter.transient``);
        with ``rng=False`` the saved streams are left unused too."""
        ad = self.adapter()
        return (ad.transient if ad is not None else ()) + (("rng",) if self.rng is False else ())

    # -- Stateful ---------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:  # Any: as Stateful's
        """The nested state :func:`shardpoint.save` writes (live tensors, no copies)."""
        ad = self.adapter()
        out: dict[str, object] = dict(ad.state()) if ad is not None else {}
        if self.scheduler is not None:
            out["scheduler"] = self.scheduler
        if self.grad_scaler is not None:
            out["grad_scaler"] = self.grad_scaler
        if self.data is not None:
            out["data"] = self.data if getattr(self.data, "shardpoint_global_state", False) else PerRank(self.data)
        rng = self._rng.state()
        if rng is not None:
            out["rng"] = rng
        if self.extra:
            out["extra"] = dict(self.extra)
        return out

    def load_state_dict(self, sd: Mapping[str, Any]) -> None:  # Any: the filled state_dict()
        """Apply what :func:`shardpoint.load` filled in. Tensors were filled in place;
        this sets hyperparameters, plain values and RNG streams."""
        ad = self.adapter()
        if ad is not None:
            ad.apply(sd)
        self._rng.apply(sd.get("rng"))
        if "extra" in sd:
            for k, v in sd["extra"].items():
                if not is_stateful(self.extra.get(k)):
                    self.extra[k] = v

    def _shardpoint_health_role(self, key: str) -> str:
        """The role of ``key`` (relative to this object) for health
        (:mod:`shardpoint.health`): ``param`` or ``buffer`` under ``model/``,
        ``optimizer`` under ``optimizer/``, ``extra`` elsewhere."""
        path = decode_key(key)
        if path[:1] == ("optimizer",):
            return "optimizer"
        if path[:1] != ("model",):
            return "extra"
        ad = self.adapter()
        return "buffer" if ad is not None and len(path) == 2 and path[1] in ad.buffers() else "param"

    # -- load hooks (shardpoint.adapters.LoadHooks), keys relative to this object -----
    def _shardpoint_prepare_load(self, entries: Entries, select: Callable[[str], bool]) -> None:
        self._rng.prepare_load(entries)
        ad = self.adapter()
        self._created = ad.prepare_load(entries, select) if ad is not None else []

    def _shardpoint_after_load(self, report: LoadReport, rank: int) -> None:
        report.settle_created(self._created, self._transient())
        self._created = []
        self._rng.after_load(report, rank)

    def _shardpoint_loaded(self) -> None:
        ad = self.adapter()
        if ad is not None:
            ad.finish_load()
