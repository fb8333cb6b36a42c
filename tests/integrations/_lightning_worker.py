"""Ranks of the Lightning tests: real ``Trainer.fit`` runs under
``ShardpointDDPStrategy`` on gloo, stopped and resumed. Each phase returns what a
user would compare: per-step losses, the sample ids each step consumed, and the
training state at the first step after the resume point."""

from __future__ import annotations

import hashlib
import os
import shutil
import warnings
from typing import Any

import torch

GBS, N, K, STEPS = 8, 64, 6, 12  # global batch, dataset size, stop after K steps, STEPS in all


def _digest(t: torch.Tensor) -> str:
    t = t.to_local() if hasattr(t, "to_local") else t  # a DTensor: this rank's shard
    return hashlib.sha256(t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()[:16]


def _module(dropout: float, fsdp2: bool = False) -> Any:
    import lightning.pytorch as pl

    class Net(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Dropout(dropout), torch.nn.Tanh(),
                                           torch.nn.Linear(16, 1))
            self.losses: list[float] = []
            self.ids: list[list[int]] = []
            self.batch_idx: list[int] = []
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
            self.batch_idx.append(batch_idx)
            return loss

        def configure_model(self) -> None:
            if fsdp2:  # FSDP2 over Lightning's data-parallel mesh: DTensor parameters and optimizer state
                from torch.distributed.fsdp import fully_shard

                mesh = self.device_mesh["data_parallel"]
                for m in self.net:
                    if isinstance(m, torch.nn.Linear):
                        fully_shard(m, mesh=mesh)
                fully_shard(self.net, mesh=mesh)

        def configure_optimizers(self) -> Any:
            opt = torch.optim.AdamW(self.parameters(), lr=0.05)
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    return Net()


def _loader(world: int, micro: int | None = None) -> Any:
    from torch.utils.data import DataLoader, TensorDataset

    from shardpoint.elastic import ElasticBatchSampler

    g = torch.Generator().manual_seed(123)
    x = torch.randn(N, 4, generator=g)
    y = x.sum(1).sin()
    ds = TensorDataset(torch.arange(N), x, y)
    return DataLoader(ds, batch_sampler=ElasticBatchSampler(N, GBS, micro or GBS // world, seed=7))


def _keeper() -> Any:
    """A Lightning logger that keeps what it is given (the base run's: the saves' figures)."""
    from lightning.pytorch.loggers.logger import Logger

    class Keep(Logger):
        def __init__(self) -> None:
            super().__init__()
            self.rows: list[tuple[int | None, dict[str, float]]] = []

        @property
        def name(self) -> str:
            return "keep"

        @property
        def version(self) -> int:
            return 0

        def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
            pass

        def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
            self.rows.append((step, dict(metrics)))

    return Keep()


def _fit(world: int, root: str, steps: int, dropout: float, resume: bool, fsdp2: bool = False,
         micro: int | None = None, logger: Any = False, **strategy_kw: Any) -> tuple[Any, Any]:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint

    from shardpoint.integrations.lightning import ShardpointDDPStrategy, ShardpointModelParallelStrategy

    pl.seed_everything(11, verbose=False)
    module = _module(dropout, fsdp2)
    ckpt = ModelCheckpoint(dirpath=root, every_n_train_steps=3, save_top_k=1, save_last=True)
    if fsdp2:
        strategy = ShardpointModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1,
                                                   checkpoint_timeout=120, **strategy_kw)
    else:
        strategy = ShardpointDDPStrategy(process_group_backend="gloo", checkpoint_timeout=120, **strategy_kw)
    trainer = pl.Trainer(
        accelerator="cpu", devices=world, num_nodes=1, max_steps=steps, use_distributed_sampler=False,
        strategy=strategy,
        callbacks=[ckpt], logger=logger, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, default_root_dir=root, accumulate_grad_batches=GBS // world // (micro or GBS // world),
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, _loader(world, micro), ckpt_path="last" if resume else None)
    return trainer, module


def _result(module: Any) -> dict[str, Any]:
    return {"losses": module.losses, "ids": module.ids, "at_k": module.at_k, "batch_idx": module.batch_idx}


def _misuse(trainer: Any, prefix: str) -> dict[str, Any]:
    """A save guarded by ``is_global_zero`` ends in the named error on rank 0, no hang;
    then a save every rank makes works."""
    import shardpoint

    out: dict[str, Any] = {"misuse": None}
    trainer.strategy.checkpoint_timeout = 3.0
    if trainer.is_global_zero:
        try:
            trainer.save_checkpoint(f"{prefix}_misuse.ckpt")
        except shardpoint.CollectiveMismatchError as e:
            out["misuse"] = {"ranks": e.ranks, "msg": str(e)}
    trainer.strategy.checkpoint_timeout = 120.0
    trainer.save_checkpoint(f"{prefix}_after.ckpt")  # every rank: works
    out["after_committed"] = os.path.exists(f"{prefix}_after.ckpt/manifest.json")
    out["misuse_committed"] = os.path.exists(f"{prefix}_misuse.ckpt/manifest.json")
    return out


def same_world(rank: int, world: int, tmp: str) -> dict[str, Any]:
    """On 2 ranks: the uninterrupted run and the stopped-and-resumed one (dropout on),
    the same without dropout (its checkpoint is resumed on another world size), and
    the rank-0-only misuse."""
    out: dict[str, Any] = {}
    keep = _keeper()
    _, m = _fit(world, f"{tmp}/base", STEPS, 0.2, False, logger=keep)
    out["base"] = _result(m)
    out["logged"] = [(step, row) for step, row in keep.rows if any(k.startswith("checkpoint/") for k in row)]
    _, m = _fit(world, f"{tmp}/run", K, 0.2, False)
    out["first"] = _result(m)
    out["listing"] = sorted(os.listdir(f"{tmp}/run"))
    _, m = _fit(world, f"{tmp}/run", STEPS, 0.2, True)
    out["resumed"] = _result(m)
    out["listing_after"] = sorted(os.listdir(f"{tmp}/run"))

    # FSDP2 through ModelParallelStrategy: sharded parameters and optimizer state
    _, m = _fit(world, f"{tmp}/fsdp_run", K, 0.0, False, fsdp2=True)
    out["fsdp_first"] = _result(m)
    out["fsdp_files"] = sorted(os.listdir(f"{tmp}/fsdp_run/last.ckpt"))
    _, m = _fit(world, f"{tmp}/fsdp_run2", STEPS, 0.0, False, fsdp2=True)  # the uninterrupted FSDP2 run
    out["fsdp_base"] = _result(m)
    if rank == 0:  # for the resume on 1 rank
        shutil.copytree(f"{tmp}/fsdp_run", f"{tmp}/fsdp_run_1rank")
    trainer, m = _fit(world, f"{tmp}/fsdp_run", STEPS, 0.0, True, fsdp2=True)
    out["fsdp_resumed"] = _result(m)
    out["fsdp_misuse"] = _misuse(trainer, f"{tmp}/fsdp")

    _, m = _fit(world, f"{tmp}/base0", STEPS, 0.0, False)
    out["base0"] = _result(m)
    trainer, m = _fit(world, f"{tmp}/run0", K, 0.0, False)
    out["first0"] = _result(m)

    out.update(_misuse(trainer, f"{tmp}/ddp"))
    return out


def other_world(rank: int, world: int, tmp: str) -> dict[str, Any]:
    """On ``world`` ranks: resume the 2-rank DDP checkpoint without dropout; the negative
    control (a copy, without the optimizer); the 2-rank FSDP2 checkpoint."""
    _, m = _fit(world, f"{tmp}/run0", STEPS, 0.0, True)
    _, neg = _fit(world, f"{tmp}/run0_neg", STEPS, 0.0, True, exclude=["optimizer"])
    _, fsdp = _fit(world, f"{tmp}/fsdp_run_1rank", STEPS, 0.0, True, fsdp2=True)
    # the per-rank micro-batch kept (4), the global batch kept by accumulating 2 of them
    _, acc = _fit(world, f"{tmp}/run0_acc", STEPS, 0.0, True, micro=GBS // 2)
    return {"one": _result(m), "neg": _result(neg), "fsdp": _result(fsdp), "acc": _result(acc)}
