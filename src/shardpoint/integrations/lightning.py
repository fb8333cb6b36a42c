"""PyTorch Lightning: checkpoints that every rank saves and loads through shardpoint,
and that resume on any number of processes.

Lightning's base ``Strategy.save_checkpoint`` and ``remove_checkpoint`` call the
``CheckpointIO`` on global rank 0 only, so a collective ``CheckpointIO`` alone would
hang under DDP. The smallest sound hook is the strategy: :class:`ShardpointDDPStrategy`
(a :class:`ShardpointStrategyMixin` over ``DDPStrategy``) saves on every rank and
returns Lightning's full checkpoint dict from ``load_checkpoint``;
:class:`ShardpointModelParallelStrategy` does the same over ``ModelParallelStrategy``
(FSDP2), each rank writing its own shards::

    from shardpoint.integrations.lightning import ShardpointDDPStrategy

    trainer = L.Trainer(strategy=ShardpointDDPStrategy(), use_distributed_sampler=False,
                        callbacks=[ModelCheckpoint(save_last=True, every_n_train_steps=100)])
    trainer.fit(model, loader, ckpt_path="last")

A checkpoint is a shardpoint directory with Lightning's file name (``last.ckpt``,
``epoch=0-step=100.ckpt``), so ``ckpt_path="last"``, ``save_top_k`` and removal work
as before. Its keys are the :class:`~shardpoint.TrainState` layout: ``model/<fqn>``,
``optimizer/...`` (by parameter name), ``scheduler/...``, ``rng/...`` (per rank:
Lightning itself does not save RNG streams) and ``extra/lightning/...``: the rest of
Lightning's dict (loops, callbacks, hyperparameters, precision plugin), as rank 0
has it, which is what Lightning's own checkpoint holds.

Data position: a ``DataLoader(batch_sampler=ElasticBatchSampler(...))`` is made
resumable (Lightning saves and restores it as a stateful loader) and its position
moves after each optimizer step, so a resumed run, on any number of ranks, sees
exactly the samples the uninterrupted run would have seen. On another world size,
keep the global batch: change ``micro_batch_size`` or set
``Trainer(accumulate_grad_batches=sampler.accumulation_steps)``; Lightning's batch
counters count micro-batches per rank, so they are rescaled on load to this run's
accumulation (the checkpoint must sit at an optimizer-step boundary, as
``ModelCheckpoint(every_n_train_steps=...)`` saves).
A ``DistributedSampler`` has no position: Lightning restarts its epoch.

Lightning is imported when this module is: ``import shardpoint`` never needs it.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterator, Mapping
from datetime import timedelta
from typing import Any, Protocol

import torch

from ..errors import MissingDependencyError, UnsupportedCheckpointError, UnsupportedConfigError

try:
    import lightning.pytorch as pl
    from lightning.pytorch import LightningModule
    from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy
    from lightning.pytorch.utilities.types import LRSchedulerConfig
except ImportError as e:  # pragma: no cover - depends on the environment
    raise MissingDependencyError(
        "shardpoint.integrations.lightning needs PyTorch Lightning (the `lightning` package): "
        "pip install 'shardpoint[lightning]'"
    ) from e

from .. import api
from ..elastic import ElasticBatchSampler
from ..report import SaveStats
from ..state import TrainState
from ._trainer import apply_rng, capture_rng, step_tag

__all__ = ["ShardpointStrategyMixin", "ShardpointDDPStrategy", "ShardpointModelParallelStrategy", "load_from_checkpoint"]

_MODEL_PARTS = ("state_dict", "optimizer_states", "lr_schedulers")


def _base(obj: object, mixin: type) -> Any:
    """The Lightning strategy's own methods behind ``mixin`` (``super()`` from the mixin,
    which the type checker cannot see through)."""
    return super(mixin, obj)


class ShardpointStrategyMixin:
    """Makes a Lightning strategy save and load its checkpoints through shardpoint,
    on every rank. Put it first in the bases: ``class S(ShardpointStrategyMixin,
    DDPStrategy)``.

    Args:
        checkpoint_timeout: how long ranks wait for each other at a save or load
            before the call is abandoned with a
            :class:`~shardpoint.CollectiveMismatchError` naming the absent ranks.
        exclude: key prefixes not to restore, e.g. ``["optimizer"]`` to start with
            a fresh optimizer (``model``, ``optimizer``, ``scheduler``, ``rng``,
            ``extra/lightning/loops``...).
        rng: save and restore Python, NumPy and torch RNG streams per rank (an int
            also sets the base seed new ranks derive theirs from, see
            :class:`~shardpoint.TrainState`). Restored streams are applied right
            before the first training batch after the load, so nothing Lightning
            draws while it sets up shifts them.
        **kwargs: the strategy's own arguments.
    """

    # provided by the Lightning strategy this is mixed into (annotations only: no attribute here)
    lightning_module: LightningModule
    is_global_zero: bool
    lr_scheduler_configs: list[LRSchedulerConfig]

    def __init__(
        self,
        *args: object,
        checkpoint_timeout: timedelta | float = api.DEFAULT_TIMEOUT,
        exclude: list[str] | None = None,
        rng: bool | int = True,
        **kwargs: object,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.checkpoint_timeout = checkpoint_timeout
        self.exclude = list(exclude or [])
        self.rng = rng
        self._pending_rng: dict[str, object] | None = None

    # -- what is saved -----------------------------------------------------------------
    @property
    def restore_checkpoint_after_setup(self) -> bool:
        """Load after ``setup``: the optimizers exist, so their state loads in place."""
        return True

    def _sp_optimizers(self) -> list[torch.optim.Optimizer]:
        out: list[torch.optim.Optimizer] = []
        for o in getattr(self, "optimizers", []) or []:
            out.append(getattr(o, "_optimizer", o))  # LightningOptimizer wraps the torch one
        if len(out) > 1:
            raise UnsupportedConfigError(
                f"{type(self).__name__} checkpoints one optimizer per LightningModule; this one has {len(out)}. "
                "Use one optimizer over parameter groups, or Lightning's own strategy for this module"
            )
        return out

    def _train_state(self, with_optimizer: bool, rest: Mapping[str, object]) -> TrainState:
        module = self.lightning_module
        opts = self._sp_optimizers() if with_optimizer else []
        scheds = [c.scheduler for c in getattr(self, "lr_scheduler_configs", [])] if with_optimizer else []
        extra = {f"lr_scheduler_{i}": s for i, s in enumerate(scheds) if i > 0}
        return TrainState(
            model=module, optimizer=opts[0] if opts else None, scheduler=scheds[0] if scheds else None,
            rng=self.rng, lightning=rest, **extra,
        )

    def save_checkpoint(
        self, checkpoint: Mapping[str, object], filepath: str | os.PathLike[str], storage_options: Any = None
    ) -> None:
        """Save on every rank (collective). Every rank must call it, as
        ``Trainer.save_checkpoint`` does; one that does not is named in a
        :class:`~shardpoint.CollectiveMismatchError` on the others."""
        path = os.fspath(filepath)
        rest: dict[str, object] = {k: v for k, v in checkpoint.items() if k not in _MODEL_PARTS}
        trainer = getattr(self.lightning_module, "_trainer", None)
        if trainer is not None:  # Lightning's batch counters count micro-batches: record how many make a step
            rest["shardpoint"] = {"accumulate_grad_batches": int(trainer.accumulate_grad_batches)}
        state = self._train_state("optimizer_states" in checkpoint, rest if self.is_global_zero else {})
        # the save's one arrival, keyed by the step: a save only rank 0 makes never meets the next one
        api.save(state, path, overwrite=True, timeout=self.checkpoint_timeout, storage_options=storage_options,
                 tag=step_tag(checkpoint.get("global_step", "")), on_stats=self._sp_log_stats)

    def _sp_log_stats(self, stats: SaveStats) -> None:
        """What the save cost (rank 0's figures), into the Trainer's own loggers
        (TensorBoard, CSV, W&B, ...), at the step it was made."""
        trainer = getattr(self.lightning_module, "_trainer", None)
        if trainer is None or stats.rank != 0:
            return
        logs = {"checkpoint/save_seconds": stats.wall_s, "checkpoint/stall_seconds": stats.stall_s,
                "checkpoint/gb": (stats.checkpoint_bytes or 0) / 1e9}
        for logger in trainer.loggers:
            logger.log_metrics(logs, step=trainer.global_step)

    def load_checkpoint(self, checkpoint_path: str | os.PathLike[str], weights_only: bool | None = None) -> dict[str, Any]:
        """Load on every rank (collective), in place, from a checkpoint saved on any
        number of ranks; returns Lightning's full checkpoint dict."""
        path = os.fspath(checkpoint_path)
        if os.path.isfile(path):
            raise UnsupportedCheckpointError(
                f"{path} is a file, not a shardpoint checkpoint (a directory with a manifest.json): it was written by "
                f"Lightning's own CheckpointIO. Resume it once with the stock strategy, then save with "
                f"{type(self).__name__}"
            )
        meta = api.metadata(path)
        with_optimizer = any(k.startswith("optimizer/") for k in meta.tensors) or any(
            k.startswith("optimizer/") for k in meta.values
        )
        state = self._train_state(with_optimizer and not weights_only, {})
        exclude = list(self.exclude)
        if weights_only:
            exclude += ["optimizer", "scheduler"]
        report = api.load(state, path, exclude=exclude or None, timeout=self.checkpoint_timeout)
        if state.rng is not False and report.per_rank.get("rng/streams") in ("restored", "derived"):
            self._pending_rng = capture_rng()
        out = dict(state.extra.get("lightning") or {})
        self._rescale_batch_counters(out, path)
        out["state_dict"] = self.lightning_module.state_dict()
        if state.optimizer is not None:
            out["optimizer_states"] = [state.optimizer.state_dict()]
            out["lr_schedulers"] = [c.scheduler.state_dict() for c in self.lr_scheduler_configs]
        return out

    def _rescale_batch_counters(self, ckpt: dict[str, Any], path: str) -> None:
        """Lightning counts micro-batches per rank; when this run makes an optimizer
        step of another number of them (the global batch kept on another world size),
        express the saved counts in this run's micro-batches."""
        trainer = getattr(self.lightning_module, "_trainer", None)
        saved = (ckpt.get("shardpoint") or {}).get("accumulate_grad_batches")
        if trainer is None or not saved or saved == trainer.accumulate_grad_batches:
            return
        now = int(trainer.accumulate_grad_batches)
        try:
            progress = ckpt["loops"]["fit_loop"]["epoch_loop.batch_progress"]
        except (KeyError, TypeError):
            return
        for part in ("total", "current"):
            c = progress[part]
            if c["ready"] % saved:
                raise UnsupportedConfigError(
                    f"{path} was saved after {c['ready']} micro-batches, inside an optimizer step of {saved}; with "
                    f"accumulate_grad_batches={now} it can only resume at a step boundary (save with "
                    "ModelCheckpoint(every_n_train_steps=...))"
                )
            done = c["completed"] - c["ready"]  # -1 when saved from on_train_batch_end
            for k in ("ready", "started", "processed"):
                c[k] = c[k] // saved * now
            c["completed"] = c["ready"] + done

    def remove_checkpoint(self, filepath: str | os.PathLike[str]) -> None:
        """Rank 0 removes a checkpoint directory: its manifest first, so a removal cut
        short never leaves something that looks like a checkpoint."""
        if not self.is_global_zero:
            return
        from lightning.fabric.utilities.cloud_io import get_filesystem

        path = os.fspath(filepath)
        fs = get_filesystem(path)
        if fs.isdir(path):
            manifest = f"{path.rstrip('/')}/manifest.json"
            if fs.exists(manifest):
                fs.rm(manifest)
            fs.rm(path, recursive=True)
        elif fs.exists(path):
            fs.rm(path)

    # -- RNG and data position -------------------------------------------------------
    def on_train_batch_start(self, batch: object, batch_idx: int) -> None:
        if self._pending_rng is not None:
            apply_rng(self._pending_rng)
            self._pending_rng = None
        _base(self, ShardpointStrategyMixin).on_train_batch_start(batch, batch_idx)

    def process_dataloader(self, dataloader: object) -> object:
        dataloader = _base(self, ShardpointStrategyMixin).process_dataloader(dataloader)
        if isinstance(getattr(dataloader, "batch_sampler", None), ElasticBatchSampler) and not hasattr(
            dataloader, "load_state_dict"
        ):
            cls: type = type(dataloader)
            dataloader.__class__ = _resumable(cls)
        return dataloader

    def optimizer_step(
        self,
        optimizer: torch.optim.Optimizer,
        closure: Callable[[], object],
        model: torch.nn.Module | None = None,
        **kwargs: object,
    ) -> object:
        out = _base(self, ShardpointStrategyMixin).optimizer_step(optimizer, closure, model, **kwargs)
        trainer = getattr(self.lightning_module, "_trainer", None)
        if trainer is not None:
            for sampler in _elastic_samplers(trainer.train_dataloader):
                sampler.step()
        return out


class ShardpointDDPStrategy(ShardpointStrategyMixin, DDPStrategy):
    """``DDPStrategy`` whose checkpoints go through shardpoint on every rank. Takes
    DDPStrategy's arguments and :class:`ShardpointStrategyMixin`'s."""

    strategy_name = "shardpoint_ddp"


class ShardpointModelParallelStrategy(ShardpointStrategyMixin, ModelParallelStrategy):
    """``ModelParallelStrategy`` (FSDP2 / tensor parallel over a device mesh) whose
    checkpoints go through shardpoint on every rank: each rank writes only its shards
    (DTensor parameters and optimizer state), and a checkpoint loads on any mesh size.
    Takes ModelParallelStrategy's arguments and :class:`ShardpointStrategyMixin`'s.

    Lightning's dict carries no model or optimizer state here (the save reads the live,
    sharded objects), so building it gathers nothing and a save only rank 0 makes
    reaches the arrival check instead of hanging in a collective."""

    strategy_name = "shardpoint_model_parallel"

    def lightning_module_state_dict(self) -> dict[str, torch.Tensor]:
        return {}

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
        return {}


def load_from_checkpoint(module_cls: type[Any], checkpoint_path: str | os.PathLike[str], *, strict: bool = True,
                         **kwargs: Any) -> Any:
    """What ``LightningModule.load_from_checkpoint`` does, for a checkpoint a shardpoint
    strategy saved (Lightning's own reads one file, and raises ``IsADirectoryError`` on a
    shardpoint checkpoint, which is a folder): a new ``module_cls`` built from the saved
    hyperparameters (``kwargs`` override them), with the saved weights loaded (full
    tensors, whatever number of ranks saved them). One process, no process group; for
    a resume, use ``Trainer.fit(ckpt_path=...)`` with the strategy instead."""
    path = os.fspath(checkpoint_path)
    saved = api.load_full(path, keys=["model", "extra/lightning/hyper_parameters"])
    hparams = dict(((saved.get("extra") or {}).get("lightning") or {}).get("hyper_parameters") or {})
    module = module_cls(**{**hparams, **kwargs})
    module.load_state_dict(saved.get("model") or {}, strict=strict)
    return module


class _ElasticLoader(Protocol):
    """A DataLoader whose ``batch_sampler`` is an ElasticBatchSampler."""

    batch_sampler: ElasticBatchSampler


@functools.cache  # one subclass per DataLoader class, made once
def _resumable(cls: type) -> type:
    """A subclass of a DataLoader class whose state is its ElasticBatchSampler's
    position, so Lightning saves it with its loops and restores it before making the
    iterator, and whose length is a whole epoch's (Lightning counts the batches of a
    resumed epoch from its own progress, as for any stateful loader)."""

    def state_dict(self: _ElasticLoader) -> dict[str, object]:
        return {"elastic_batch_sampler": self.batch_sampler.state_dict()}

    def load_state_dict(self: _ElasticLoader, state: Mapping[str, Any]) -> None:  # Any: Lightning's saved loop state
        self.batch_sampler.load_state_dict(state["elastic_batch_sampler"])

    def __len__(self: _ElasticLoader) -> int:  # a whole epoch, wherever the position is (Lightning counts the rest)
        s = self.batch_sampler
        steps = s.dataset_len // s.global_batch_size if s.drop_last else -(-s.dataset_len // s.global_batch_size)
        return steps * s.accumulation_steps

    return type(
        f"Resumable{cls.__name__}", (cls,),
        {"state_dict": state_dict, "load_state_dict": load_state_dict, "__len__": __len__},
    )


def _elastic_samplers(loaders: object) -> Iterator[ElasticBatchSampler]:
    if loaders is None:
        return
    if isinstance(loaders, dict):
        for v in loaders.values():
            yield from _elastic_samplers(v)
    elif isinstance(loaders, (list, tuple)):
        for v in loaders:
            yield from _elastic_samplers(v)
    else:
        s = getattr(loaders, "batch_sampler", None)
        if isinstance(s, ElasticBatchSampler):
            yield s


del pl
