"""Hugging Face ``Trainer``: checkpoints through shardpoint in its ``checkpoint-N``
folders, saved and loaded by every rank, resumable on any number of processes.

:class:`ShardpointTrainer` is a ``Trainer`` whose checkpoint methods are replaced
(a callback cannot do this: the Trainer has no load hook)::

    from shardpoint.integrations.transformers import ShardpointTrainer

    trainer = ShardpointTrainer(model=model, args=args, train_dataset=ds)
    trainer.train(resume_from_checkpoint=True)

What changes against the stock ``Trainer``:

* ``output_dir/checkpoint-N`` is a shardpoint checkpoint (``manifest.json`` last)
  holding the model, optimizer (by parameter name), scheduler, grad scaler, every
  rank's RNG streams, the ``TrainerState`` (its JSON) and the data position. Rank 0
  also writes ``trainer_state.json`` beside it, as the ``Trainer`` does. Export
  weights for ``from_pretrained`` with ``trainer.save_model()`` as usual.
* ``resume_from_checkpoint=True`` takes the newest *committed* checkpoint; a folder
  whose save never finished is never chosen.
* Rotation (``save_total_limit``) runs after every rank's save committed, removes a
  checkpoint's manifest before its files, and never removes the checkpoint the run
  resumed from, the newest one, or the best one.
* On another number of processes, the batches to skip are computed from the
  samples the job consumed in the current epoch, not from per-rank batches: keep
  ``per_device_train_batch_size x gradient_accumulation_steps x world size`` (the
  global batch) and the resumed run sees exactly the samples the uninterrupted one
  would have. RNG streams of ranks that did not exist are derived from ``args.seed``.
* Every rank must save: :meth:`ShardpointTrainer.save_checkpoint` guarded by
  ``if trainer.args.process_index == 0:`` raises
  :class:`~shardpoint.CollectiveMismatchError` naming the absent ranks after
  ``checkpoint_timeout`` instead of hanging.

Supported: single process and DDP (``MULTI_CPU``/``MULTI_GPU``) training. DeepSpeed
and FSDP modes of the Trainer keep their own checkpoints (use
:mod:`shardpoint.integrations.deepspeed` for DeepSpeed engines).

transformers is imported when this module is (it needs Python >= 3.11): ``import
shardpoint`` never needs it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
from datetime import timedelta
from typing import Any, cast

import torch
from torch.utils.data import DataLoader

from ..errors import MissingDependencyError, ShardpointError, UnsupportedConfigError, UsageError

try:
    from transformers import Trainer, TrainingArguments
    from transformers.trainer_callback import ExportableState, TrainerState
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, TrainOutput
except ImportError as e:  # pragma: no cover - depends on the environment
    raise MissingDependencyError(
        "shardpoint.integrations.transformers needs transformers (Python >= 3.11): pip install 'shardpoint[hf]'"
    ) from e

from .. import api
from ..collective import Comm
from ..report import SaveStats
from ..state import TrainState
from ..storage import storage_for
from ..tree import Stateful
from ._trainer import Unsaveable, apply_rng, capture_rng, step_tag

__all__ = ["ShardpointTrainer", "last_committed_checkpoint"]

_STEP = re.compile(rf"^{PREFIX_CHECKPOINT_DIR}-(\d+)$")
TRAINER_STATE_NAME = "trainer_state.json"


def _committed(path: str) -> bool:
    try:
        api.metadata(path)
    except (ShardpointError, OSError, ValueError):
        return False
    return True


def _checkpoints(folder: str) -> list[tuple[int, str]]:
    """``(step, path)`` of the ``checkpoint-N`` folders under ``folder``, by step."""
    if not os.path.isdir(folder):
        return []
    out = []
    for name in os.listdir(folder):
        m = _STEP.match(name)
        if m and os.path.isdir(os.path.join(folder, name)):
            out.append((int(m.group(1)), os.path.join(folder, name)))
    return sorted(out)


def last_committed_checkpoint(folder: str) -> str | None:
    """The ``checkpoint-N`` folder with the largest N whose save committed, or None.
    (``transformers.trainer_utils.get_last_checkpoint`` takes the largest N, finished
    or not.)"""
    for _, path in reversed(_checkpoints(folder)):
        if _committed(path):
            return path
    return None


class ShardpointTrainer(Trainer):
    """A ``transformers.Trainer`` that checkpoints through shardpoint (see the module
    docstring for what changes).

    Args:
        checkpoint_timeout: how long ranks wait for each other at a save or load
            before it is abandoned with a :class:`~shardpoint.CollectiveMismatchError`.
        checkpoint_exclude: key prefixes not to restore on resume, e.g.
            ``["optimizer"]`` (``model``, ``optimizer``, ``scheduler``,
            ``grad_scaler``, ``rng``).
        *args, **kwargs: the ``Trainer``'s.
    """

    def __init__(
        self,
        *args: Any,
        checkpoint_timeout: timedelta | float = api.DEFAULT_TIMEOUT,
        checkpoint_exclude: list[str] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.checkpoint_timeout = checkpoint_timeout
        self.checkpoint_exclude = list(checkpoint_exclude or [])
        self._sp_resumed_from: str | None = None
        self._sp_loaded: dict[str, Any] = {}
        self._sp_rng: dict[str, object] | None = None
        self._sp_steps_per_epoch: int | None = None

    # -- pieces ------------------------------------------------------------------------
    def _sp_optimizer(self) -> torch.optim.Optimizer | None:
        return getattr(self.optimizer, "optimizer", self.optimizer)

    def _sp_scaler(self) -> Stateful | None:
        return getattr(self.accelerator, "scaler", None)

    def _sp_global_batch(self) -> int:
        a = self.args
        return self._train_batch_size * a.gradient_accumulation_steps * max(a.world_size, 1)

    def _sp_state(self, **extra: Any) -> TrainState:
        return TrainState(
            model=self.model, optimizer=self._sp_optimizer(), scheduler=self.lr_scheduler,
            grad_scaler=self._sp_scaler(), rng=int(self.args.seed), **extra,
        )

    def set_initial_training_values(
        self, args: TrainingArguments, dataloader: DataLoader
    ) -> tuple[int, int, int, int, int, int | None, int]:
        values = super().set_initial_training_values(args, dataloader)
        self._sp_steps_per_epoch = int(values[1])  # num_update_steps_per_epoch
        return values

    # -- save --------------------------------------------------------------------------
    def save_checkpoint(self, trial: Any = None) -> str:
        """Save ``checkpoint-<global_step>`` now. Collective: every rank calls it.
        Returns the folder."""
        self._save_checkpoint(self.model_wrapped, trial)
        return os.path.join(self._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")

    def _save_checkpoint(self, model: torch.nn.Module, trial: Any) -> None:
        run_dir = self._get_output_dir(trial=trial)
        step = self.state.global_step
        output_dir = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{step}")
        # the save's one arrival, before anything collective (store_flos all-gathers): a rank-0-only
        # call ends here; api.save below takes this arrival instead of making its own
        tag = step_tag(step)
        Comm(None, self.checkpoint_timeout, arrival_tag=tag).arrive("save", storage_for(output_dir).url, hold=True)
        state: TrainState | Unsaveable
        try:
            state = self._sp_prepare_save(trial, step, output_dir, run_dir)
        except Exception as e:  # noqa: BLE001 - fanned out by the save: the other ranks are waiting in it
            state = Unsaveable(e)
        api.save(state, output_dir, overwrite=True, timeout=self.checkpoint_timeout, tag=tag, on_stats=self._sp_log_stats)
        if self.args.should_save:
            self._sp_rotate(run_dir, newest=output_dir)

    def _sp_log_stats(self, stats: SaveStats) -> None:
        """What the save cost, into the Trainer's own log (its reporters: TensorBoard,
        W&B, ...): seconds, the seconds training waited, and (rank 0) the checkpoint's GB."""
        logs = {"checkpoint_save_seconds": stats.wall_s, "checkpoint_stall_seconds": stats.stall_s}
        if stats.checkpoint_bytes is not None:
            logs["checkpoint_gb"] = stats.checkpoint_bytes / 1e9
        self.log(logs)

    def _sp_prepare_save(self, trial: object, step: int, output_dir: str, run_dir: str) -> TrainState:
        """What a save does once every rank arrived, before the core's save: the
        Trainer's own bookkeeping (collective: the flos), HF's ``trainer_state.json``
        (rank 0), and the state to save."""
        if self.hp_search_backend is None and trial is None:
            self.store_flos()
        if self.state.best_global_step:
            best = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.state.best_global_step}")
            if os.path.exists(best):
                self.state.best_model_checkpoint = best
        # HF annotates stateful_callbacks as a list; TrainerState.__post_init__ makes it a dict by name
        states = cast("dict[str, Any]", self.state.stateful_callbacks)
        for cb in [c for c in self.callback_handler.callbacks + [self.control] if isinstance(c, ExportableState)]:
            name = type(cb).__name__
            if isinstance(states[name], list):
                states[name].append(cb.state())
            else:
                states[name] = cb.state()
        state_json = json.dumps(dataclasses.asdict(self.state), indent=2, sort_keys=True) + "\n"
        per_epoch = self._sp_steps_per_epoch or 0
        position = {
            "global_batch_size": self._sp_global_batch(),
            "epoch": step // per_epoch if per_epoch else 0,
            "samples_in_epoch": (step % per_epoch if per_epoch else step) * self._sp_global_batch(),
        }
        if self.args.should_save:  # HF's own file, beside (the checkpoint commits after it)
            os.makedirs(output_dir, exist_ok=True)
            with open(os.path.join(output_dir, TRAINER_STATE_NAME), "w", encoding="utf-8") as f:
                f.write(state_json)
        # the TrainerState as rank 0 has it (its process flags differ per rank), as the Trainer keeps it
        extra: dict[str, Any] = {"data_position": position}
        if self.args.process_index == 0:
            extra["trainer_state"] = state_json
        return TrainState(model=self.model, rng=False, **extra) if self.args.save_only_model else \
            self._sp_state(**extra)

    def _sp_rotate(self, run_dir: str, newest: str) -> None:
        limit = self.args.save_total_limit
        found = _checkpoints(run_dir)
        keep = {os.path.abspath(newest)}
        if self._sp_resumed_from:
            keep.add(os.path.abspath(self._sp_resumed_from))
        if self.state.best_model_checkpoint:
            keep.add(os.path.abspath(self.state.best_model_checkpoint))
        committed = [p for _, p in found if _committed(p)]
        m = _STEP.match(os.path.basename(newest))
        if m is None:  # pragma: no cover - the caller names a checkpoint-N folder
            return
        newest_step = int(m.group(1))
        doomed = [p for s, p in found if s < newest_step and p not in committed]  # saves that never committed
        if limit is not None and limit > 0:
            keep.update(os.path.abspath(p) for p in committed[-limit:])
            doomed += [p for p in committed if os.path.abspath(p) not in keep]
        for path in doomed:
            if os.path.abspath(path) in keep:
                continue
            try:
                os.remove(os.path.join(path, "manifest.json"))  # uncommit first
            except FileNotFoundError:
                pass
            shutil.rmtree(path, ignore_errors=True)

    # -- load --------------------------------------------------------------------------
    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any) -> TrainOutput:
        """``Trainer.train``; ``resume_from_checkpoint=True`` takes the newest committed
        checkpoint of ``args.output_dir``."""
        if resume_from_checkpoint is True:
            out = self.args.output_dir
            resume_from_checkpoint = last_committed_checkpoint(out) if out is not None else None
            if resume_from_checkpoint is None:
                raise UsageError(f"No committed checkpoint found in output directory ({out}); train without "
                                 "resume_from_checkpoint, or pass the checkpoint's path")
        self._sp_resumed_from = resume_from_checkpoint or None
        return super().train(resume_from_checkpoint, *args, **kwargs)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: torch.nn.Module | None = None) -> None:
        if self.is_deepspeed_enabled or self.is_fsdp_enabled:
            raise UnsupportedConfigError(
                "ShardpointTrainer checkpoints DDP and single-process training; with DeepSpeed or FSDP use the "
                "stock Trainer, or shardpoint.integrations.deepspeed"
            )
        path = os.fspath(resume_from_checkpoint)
        target = TrainState(model=model if model is not None else self.model, rng=False, trainer_state="",
                            data_position={})
        api.load(target, path, only=["model", "extra"], exclude=self.checkpoint_exclude or None,
                 timeout=self.checkpoint_timeout)
        self._sp_loaded = dict(target.extra)

    def _init_training_state(self, max_steps: int, num_update_steps_per_epoch: int, num_train_epochs: int,
                             resume_from_checkpoint: object, trial: object) -> tuple[int, int]:
        epochs, steps = super()._init_training_state(
            max_steps, num_update_steps_per_epoch, num_train_epochs, resume_from_checkpoint, trial
        )
        if resume_from_checkpoint is None or not self._sp_loaded.get("trainer_state"):
            return epochs, steps
        # the checksummed copy of the TrainerState is the one that counts
        self.state = TrainerState(**json.loads(self._sp_loaded["trainer_state"]))
        self.state.init_training_references(self, max_steps, num_train_epochs, trial)
        pos = self._sp_loaded.get("data_position") or {}
        if not pos or self.args.ignore_data_skip:
            return epochs, steps
        samples = int(pos["samples_in_epoch"])
        per_batch = self._train_batch_size * max(self.args.world_size, 1)  # one per-rank batch on every rank
        if samples % per_batch:
            raise UnsupportedConfigError(
                f"the checkpoint consumed {samples} samples of epoch {pos['epoch']}, not a whole number of batches "
                f"of {self._train_batch_size} on each of {self.args.world_size} ranks; choose a per-device batch size "
                f"that divides it (the global batch was {pos['global_batch_size']})"
            )
        return int(pos["epoch"]), samples // per_batch

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        if self.args.save_only_model:
            return
        state = self._sp_state()
        report = api.load(state, os.fspath(checkpoint), only=["optimizer", "scheduler", "grad_scaler", "rng"],
                          exclude=self.checkpoint_exclude or None, timeout=self.checkpoint_timeout)
        # applied where the Trainer restores RNG: after skipping the batches already seen
        self._sp_rng = capture_rng() if report.per_rank.get("rng/streams") in ("restored", "derived") else None

    def _load_scaler(self, checkpoint: str | None) -> None:
        """Loaded with the optimizer (``grad_scaler/``)."""

    def _load_rng_state(self, checkpoint: str | None) -> None:
        if checkpoint is not None and self._sp_rng is not None:
            apply_rng(self._sp_rng)
