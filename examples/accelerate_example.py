"""Hugging Face Accelerate with shardpoint checkpoints: stop a training loop, resume
it on another number of processes (CPU, gloo).

    torchrun --nproc_per_node 2 examples/accelerate_example.py --stop-at 6   # saves step_3, step_6
    torchrun --nproc_per_node 1 examples/accelerate_example.py               # resumes on 1 rank to step 12

The global batch (8 samples) is kept on any number of processes; the resumed loop
skips exactly the samples the first one consumed.
"""

from __future__ import annotations

import argparse
import os

import torch
from accelerate import Accelerator, DataLoaderConfiguration
from torch.utils.data import DataLoader, TensorDataset

from shardpoint.integrations.accelerate import ResumableLoader, load_state, save_state

GLOBAL_BATCH, STEPS = 8, 12


class Step:
    """Registered for checkpointing: the loop's step."""

    def __init__(self) -> None:
        self.value = 0

    def state_dict(self) -> dict[str, int]:
        return {"value": self.value}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        self.value = int(sd["value"])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--stop-at", type=int, default=STEPS)
    p.add_argument("--out", default="runs/accelerate_example")
    a = p.parse_args()
    torch.manual_seed(0)
    accelerator = Accelerator(cpu=True, step_scheduler_with_optimizer=False,
                              dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True))
    g = torch.Generator().manual_seed(1)
    x = torch.randn(256, 4, generator=g)
    loader = DataLoader(TensorDataset(x, x.sum(1).sin()), batch_size=GLOBAL_BATCH // accelerator.num_processes,
                        shuffle=True)
    model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.02)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=4, gamma=0.5)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    data, step = ResumableLoader(loader), Step()
    accelerator.register_for_checkpointing(data)
    accelerator.register_for_checkpointing(step)
    saved = sorted((int(n.split("_")[1]), n) for n in os.listdir(a.out)) if os.path.isdir(a.out) else []
    if saved:
        load_state(accelerator, os.path.join(a.out, saved[-1][1]))  # every rank
        accelerator.print(f"resumed from {saved[-1][1]} on {accelerator.num_processes} process(es)")
    while step.value < a.stop_at:
        for x, y in data:
            loss = torch.nn.functional.mse_loss(model(x).squeeze(-1), y)
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            step.value += 1
            accelerator.print(f"step {step.value}: loss {loss.item():.6f}")
            if step.value % 3 == 0:
                save_state(accelerator, os.path.join(a.out, f"step_{step.value}"))  # every rank
            if step.value >= a.stop_at:
                break


if __name__ == "__main__":
    main()
