"""PyTorch Lightning with shardpoint checkpoints: stop a run, resume it on another
number of processes (CPU, gloo).

    torchrun --nproc_per_node 2 examples/lightning_example.py --steps 6    # saves at steps 3 and 6
    torchrun --nproc_per_node 1 examples/lightning_example.py --steps 12   # resumes from last.ckpt on 1 rank

The global batch (8 samples) is kept on any number of processes, so the second run
sees exactly the samples the uninterrupted run would have. The sampler is built
before ``Trainer.fit`` creates the process group: it reads its rank and the world
size when the loop starts iterating it. ``--log-samples`` writes each rank's sample
ids per step to ``<out>/samples-rank<r>.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import os
import warnings

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from shardpoint.elastic import ElasticBatchSampler
from shardpoint.integrations.lightning import ShardpointDDPStrategy

GLOBAL_BATCH = 8


class Regression(pl.LightningModule):
    def __init__(self, samples_log: str | None = None) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
        self.samples_log = samples_log

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        ids, x, y = batch
        if self.samples_log:
            with open(f"{self.samples_log}-rank{self.global_rank}.jsonl", "a") as f:
                f.write(json.dumps({"step": self.global_step + 1, "ids": ids.tolist()}) + "\n")
        loss = torch.nn.functional.mse_loss(self.net(x).squeeze(-1), y)
        if self.trainer.is_global_zero:
            print(f"step {self.global_step + 1}: loss {loss.item():.6f}", flush=True)
        return loss

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        return torch.optim.AdamW(self.parameters(), lr=0.02)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--out", default="runs/lightning_example")
    p.add_argument("--log-samples", action="store_true", help="write each rank's sample ids per step")
    args = p.parse_args()
    world = int(os.environ.get("WORLD_SIZE", 1))
    pl.seed_everything(0, verbose=False)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(256, 4, generator=g)
    data = TensorDataset(torch.arange(len(x)), x, x.sum(1).sin())
    # built before the process group exists: rank and world size are read when fit starts iterating
    loader = DataLoader(data, batch_sampler=ElasticBatchSampler(len(data), GLOBAL_BATCH, GLOBAL_BATCH // world))
    trainer = pl.Trainer(
        accelerator="cpu", devices=world, max_steps=args.steps, use_distributed_sampler=False,
        strategy=ShardpointDDPStrategy(process_group_backend="gloo"),
        callbacks=[ModelCheckpoint(dirpath=args.out, every_n_train_steps=3, save_last=True,
                                   monitor="step", mode="max", save_top_k=2)],
        logger=False, enable_progress_bar=False, enable_model_summary=False,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if args.log_samples:
            os.makedirs(args.out, exist_ok=True)
        module = Regression(os.path.join(args.out, "samples") if args.log_samples else None)
        trainer.fit(module, loader, ckpt_path="last")  # starts fresh when there is no last.ckpt yet
    if trainer.is_global_zero:
        print(f"{world} process(es) stopped at step {trainer.global_step}; checkpoints: {sorted(os.listdir(args.out))}")


if __name__ == "__main__":
    main()
