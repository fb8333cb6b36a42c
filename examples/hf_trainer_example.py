"""The Hugging Face Trainer with shardpoint checkpoints: stop a run, resume it on
another number of processes (CPU, gloo).

    torchrun --nproc_per_node 2 examples/hf_trainer_example.py --stop-at 6   # saves checkpoint-3, -6
    torchrun --nproc_per_node 1 examples/hf_trainer_example.py               # resumes on 1 rank to step 12

The global batch (8 samples) is kept on any number of processes; the resumed run
skips exactly the samples the first one consumed.
"""

from __future__ import annotations

import argparse
import os
import warnings

import torch
from transformers import TrainerCallback, TrainingArguments

from shardpoint.integrations.transformers import ShardpointTrainer, last_committed_checkpoint

GLOBAL_BATCH = 8


class Regression(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": torch.nn.functional.mse_loss(self.net(x).squeeze(-1), y)}


class Data(torch.utils.data.Dataset):
    def __init__(self) -> None:
        g = torch.Generator().manual_seed(1)
        self.x = torch.randn(256, 4, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "y": self.x[i].sum().sin()}


class StopAt(TrainerCallback):
    def __init__(self, step: int | None) -> None:
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
        if state.global_step == self.step:
            control.should_training_stop = True


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--stop-at", type=int, default=None)
    p.add_argument("--out", default="runs/hf_trainer_example")
    a = p.parse_args()
    world = int(os.environ.get("WORLD_SIZE", 1))
    torch.manual_seed(0)
    args = TrainingArguments(
        output_dir=a.out, per_device_train_batch_size=GLOBAL_BATCH // world, max_steps=12, save_steps=3,
        save_total_limit=2, learning_rate=0.02, logging_steps=1, use_cpu=True,
        ddp_backend="gloo" if world > 1 else None, report_to=[], disable_tqdm=True,
    )
    trainer = ShardpointTrainer(model=Regression(), args=args, train_dataset=Data(), callbacks=[StopAt(a.stop_at)])
    resume = last_committed_checkpoint(a.out) is not None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train(resume_from_checkpoint=True if resume else None)
    if trainer.args.process_index == 0:
        print(f"{world} process(es) stopped at step {trainer.state.global_step}; "
              f"checkpoints: {sorted(os.listdir(a.out))}")


if __name__ == "__main__":
    main()
