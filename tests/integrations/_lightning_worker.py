"""Ranks of the Lightning tests: real ``Trainer.fit`` runs under
``ShardpointDDPStrategy`` on gloo, stopped and resumed. Each phase returns what a
user would compare: per-step losses, the sample ids each step consumed, and the
training state at the first step after the resume point."""

from __future__ import annotations

import hashlib
import os
import warnings
from typing import Any

import torch

GBS, N, K, STEPS = 8, 64, 6, 12  # global batch, dataset size, stop after K steps, STEPS in all


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()[:16]


def _module(dropout: float) -> Any:
    import lightning.pytorch as pl

    class Net(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Dropout(dropout), torch.nn.Tanh(),
                                           torch.nn.Linear(16, 1))
            self.losses: list[float] = []
            self.ids: list[list[int]] = []
            self.at_k: dict[str, Any] = {}

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            ids, x, y = batch
            if self.global_step == K:  # the state the step after the resume point starts from
                opt = self.optimizers().optimizer
                self.at_k = {
                    "params": {n: _digest(p) for n, p in self.named_parameters()},
                    "opt": {f"{i}/{k}": _digest(v) if torch.is_tensor(v) else v
                            for i, p in enumerate(opt.param_groups[0]["params"]) for k, v in opt.state[p].items()},
                    "sched": self.lr_schedulers().state_dict(),
                    "lr": opt.param_groups[0]["lr"],
                    "rng": _digest(torch.get_rng_state()),
                    "step": self.global_step,
                }
            loss = torch.nn.functional.mse_loss(self.net(x).squeeze(-1), y)
            self.losses.append(loss.item())
            self.ids.append(ids.tolist())
            return loss

        def configure_optimizers(self) -> Any:
            opt = torch.optim.AdamW(self.parameters(), lr=0.05)
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    return Net()


def _loader(world: int) -> Any:
    from torch.utils.data import DataLoader, TensorDataset

    from shardpoint.elastic import ElasticBatchSampler

    g = torch.Generator().manual_seed(123)
    x = torch.randn(N, 4, generator=g)
    y = x.sum(1).sin()
    ds = TensorDataset(torch.arange(N), x, y)
    return DataLoader(ds, batch_sampler=ElasticBatchSampler(N, GBS, GBS // world, seed=7))


def _fit(world: int, root: str, steps: int, dropout: float, resume: bool, **strategy_kw: Any) -> tuple[Any, Any]:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint

    from shardpoint.integrations.lightning import ShardpointDDPStrategy

    pl.seed_everything(11, verbose=False)
    module = _module(dropout)
    ckpt = ModelCheckpoint(dirpath=root, every_n_train_steps=3, save_top_k=1, save_last=True)
    trainer = pl.Trainer(
        accelerator="cpu", devices=world, num_nodes=1, max_steps=steps, use_distributed_sampler=False,
        strategy=ShardpointDDPStrategy(process_group_backend="gloo", checkpoint_timeout=120, **strategy_kw),
        callbacks=[ckpt], logger=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, default_root_dir=root,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, _loader(world), ckpt_path="last" if resume else None)
    return trainer, module


def _result(module: Any) -> dict[str, Any]:
    return {"losses": module.losses, "ids": module.ids, "at_k": module.at_k}


def same_world(rank: int, world: int, tmp: str) -> dict[str, Any]:
    """On 2 ranks: the uninterrupted run and the stopped-and-resumed one (dropout on),
    the same without dropout (its checkpoint is resumed on another world size), and
    the rank-0-only misuse."""
    out: dict[str, Any] = {}
    _, m = _fit(world, f"{tmp}/base", STEPS, 0.2, False)
    out["base"] = _result(m)
    _, m = _fit(world, f"{tmp}/run", K, 0.2, False)
    out["first"] = _result(m)
    out["listing"] = sorted(os.listdir(f"{tmp}/run"))
    _, m = _fit(world, f"{tmp}/run", STEPS, 0.2, True)
    out["resumed"] = _result(m)
    out["listing_after"] = sorted(os.listdir(f"{tmp}/run"))

    _, m = _fit(world, f"{tmp}/base0", STEPS, 0.0, False)
    out["base0"] = _result(m)
    trainer, m = _fit(world, f"{tmp}/run0", K, 0.0, False)
    out["first0"] = _result(m)

    # misuse: a save guarded by is_global_zero ends in the named error on rank 0, no hang
    import shardpoint

    trainer.strategy.checkpoint_timeout = 3.0
    out["misuse"] = None
    if trainer.is_global_zero:
        try:
            trainer.save_checkpoint(f"{tmp}/misuse.ckpt")
        except shardpoint.CollectiveMismatchError as e:
            out["misuse"] = {"ranks": e.ranks, "msg": str(e)}
    trainer.strategy.checkpoint_timeout = 120.0
    trainer.save_checkpoint(f"{tmp}/after.ckpt")  # every rank: works
    out["after_committed"] = os.path.exists(f"{tmp}/after.ckpt/manifest.json")
    out["misuse_committed"] = os.path.exists(f"{tmp}/misuse.ckpt/manifest.json")
    return out


def other_world(rank: int, world: int, root: str, root_neg: str) -> dict[str, Any]:
    """Resume the 2-rank checkpoint without dropout (under ``root``) on ``world`` ranks;
    then the negative control: the same from a copy (``root_neg``) without the optimizer."""
    _, m = _fit(world, root, STEPS, 0.0, True)
    _, neg = _fit(world, root_neg, STEPS, 0.0, True, exclude=["optimizer"])
    return {"one": _result(m), "neg": _result(neg)}
