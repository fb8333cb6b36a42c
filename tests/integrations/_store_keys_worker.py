"""Ranks of test_store_keys: many saves through each trainer integration and through
``CheckpointManager``, counting the keys of the process group's store around them."""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from typing import Any

import torch

SAVES = 50


def _count(save: Callable[[int], None]) -> dict[str, int]:
    """Keys of the default store and the channel's call number before and after
    ``SAVES`` saves (after one warm-up save, which makes the channel's lanes: torch's
    own keys)."""
    import torch.distributed as dist

    from shardpoint import collective

    save(-1)
    dist.barrier()
    store = dist.distributed_c10d._get_default_store()
    channel = collective.Comm().channel
    assert channel is not None
    before, seq_before = store.num_keys(), channel.seq
    dist.barrier()
    for i in range(SAVES):
        save(i)
    dist.barrier()
    after, seq_after = store.num_keys(), channel.seq
    dist.barrier()
    return {"before": before, "after": after, "arrivals": seq_after - seq_before}


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def lightning_case(rank: int, world: int, tmp: str) -> dict[str, int]:
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset

    from shardpoint.integrations.lightning import ShardpointDDPStrategy

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = _net()

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x).squeeze(-1), y)

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=0.01)

    x = torch.randn(16, 4)
    trainer = pl.Trainer(accelerator="cpu", devices=world, max_steps=1, use_distributed_sampler=False,
                         strategy=ShardpointDDPStrategy(process_group_backend="gloo", checkpoint_timeout=120),
                         logger=False, enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=False, default_root_dir=tmp)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(Module(), DataLoader(TensorDataset(x, x.sum(1)), batch_size=4))
    return _count(lambda i: trainer.save_checkpoint(f"{tmp}/lightning/{i if i % 2 else 'again'}.ckpt"))


def accelerate_case(rank: int, world: int, tmp: str) -> dict[str, int]:
    from accelerate import Accelerator

    from shardpoint.integrations.accelerate import save_state

    acc = Accelerator(cpu=True)
    model = _net()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    model, opt = acc.prepare(model, opt)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    return _count(lambda i: save_state(acc, f"{tmp}/accelerate/{i if i % 2 else 'again'}", timeout=120))


def hf_case(rank: int, world: int, tmp: str) -> dict[str, int]:
    from transformers import TrainingArguments

    from shardpoint.integrations.transformers import ShardpointTrainer
    from tests.integrations._hf_worker import Data, Net

    torch.manual_seed(0)
    args = TrainingArguments(
        output_dir=f"{tmp}/hf", per_device_train_batch_size=4, max_steps=1, save_strategy="no",
        save_total_limit=2, use_cpu=True, ddp_backend="gloo", report_to=[], disable_tqdm=True,
        logging_strategy="no", dataloader_num_workers=0,
    )
    trainer = ShardpointTrainer(model=Net(0.0), args=args, train_dataset=Data(), checkpoint_timeout=120)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()

    def save(i: int) -> None:
        trainer.state.global_step = 100 + i
        trainer.save_checkpoint()

    return _count(save)


def manager_case(rank: int, world: int, tmp: str) -> dict[str, int]:
    import shardpoint

    model = _net()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    mgr = shardpoint.CheckpointManager(os.path.join(tmp, "manager"), keep_last=2, timeout=120)
    state = shardpoint.TrainState(model=model, optimizer=opt)
    return _count(lambda i: mgr.save(state, i + 1))
