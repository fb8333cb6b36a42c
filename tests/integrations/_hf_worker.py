"""Ranks of the Hugging Face Trainer tests: real ``Trainer.train`` runs of
``ShardpointTrainer`` on gloo (``use_cpu``, ``ddp_backend="gloo"``), stopped after
K steps by a callback and resumed with ``resume_from_checkpoint=True``."""

from __future__ import annotations

import hashlib
import os
import warnings
from typing import Any

import torch

GBS, N, K, STEPS = 8, 64, 6, 12


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()[:16]


class Net(torch.nn.Module):
    def __init__(self, dropout: float) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Dropout(dropout), torch.nn.Tanh(),
                                       torch.nn.Linear(16, 1))
        self.losses: list[float] = []
        self.ids: list[list[int]] = []
        self.rng: list[str] = []

    def forward(self, x: torch.Tensor, y: torch.Tensor, idx: torch.Tensor) -> dict[str, torch.Tensor]:
        self.rng.append(_digest(torch.get_rng_state()))
        loss = torch.nn.functional.mse_loss(self.net(x).squeeze(-1), y)
        self.losses.append(loss.item())
        self.ids.append(idx.tolist())
        return {"loss": loss}


class Data(torch.utils.data.Dataset):
    def __init__(self) -> None:
        g = torch.Generator().manual_seed(123)
        self.x = torch.randn(N, 4, generator=g)
        self.y = self.x.sum(1).sin()

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"x": self.x[i], "y": self.y[i], "idx": torch.tensor(i)}


def _train(world: int, out: str, dropout: float, stop_at: int | None, resume: bool, misuse: bool = False,
           **kw: Any) -> dict[str, Any]:
    from transformers import TrainerCallback, TrainingArguments

    import shardpoint
    from shardpoint.integrations.transformers import ShardpointTrainer

    torch.manual_seed(0)
    model = Net(dropout)
    args = TrainingArguments(
        output_dir=out, per_device_train_batch_size=GBS // world, max_steps=STEPS, save_steps=3,
        save_total_limit=2, learning_rate=0.05, lr_scheduler_type="linear", warmup_steps=2, seed=11,
        use_cpu=True, ddp_backend="gloo" if world > 1 else None, report_to=[], disable_tqdm=True,
        logging_strategy="no", dataloader_num_workers=0,
    )
    state: dict[str, Any] = {"misuse": None}

    class Probe(TrainerCallback):
        def on_step_begin(self, args: Any, st: Any, control: Any, **k: Any) -> None:
            if st.global_step == K:
                opt = trainer.optimizer.optimizer
                state["at_k"] = {
                    "params": {n: _digest(p) for n, p in model.named_parameters()},
                    "opt": {f"{i}/{n}": _digest(v) for i, p in enumerate(opt.param_groups[0]["params"])
                            for n, v in opt.state[p].items()},
                    "sched": {k: v for k, v in trainer.lr_scheduler.state_dict().items() if k != "lr_lambdas"},
                    "lr": opt.param_groups[0]["lr"], "step": st.global_step,
                }

        def on_step_end(self, args: Any, st: Any, control: Any, **k: Any) -> None:
            if misuse and st.global_step == 2:  # a save only rank 0 makes
                trainer.checkpoint_timeout = 3.0
                if args.process_index == 0:
                    try:
                        trainer.save_checkpoint()
                    except shardpoint.CollectiveMismatchError as e:
                        state["misuse"] = {"ranks": e.ranks, "msg": str(e)}
                trainer.checkpoint_timeout = 120.0
            if stop_at is not None and st.global_step == stop_at:
                control.should_training_stop = True

    trainer = ShardpointTrainer(model=model, args=args, train_dataset=Data(), callbacks=[Probe()],
                                checkpoint_timeout=120, **kw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train(resume_from_checkpoint=True if resume else None)
    listing = sorted(os.listdir(out)) if trainer.args.process_index == 0 else None
    return {"losses": model.losses, "ids": model.ids, "rng": model.rng, "at_k": state.get("at_k"),
            "misuse": state["misuse"], "listing": listing, "step": trainer.state.global_step,
            "ckpt_logs": [h for h in trainer.state.log_history if "checkpoint_save_seconds" in h]}


def same_world(rank: int, world: int, tmp: str) -> dict[str, Any]:
    out = {"base": _train(world, f"{tmp}/base", 0.2, None, False)}
    out["first"] = _train(world, f"{tmp}/run", 0.2, K, False, misuse=True)
    # a save that never committed, newer than every committed one: never resumed from
    if rank == 0:
        os.makedirs(f"{tmp}/run/checkpoint-9", exist_ok=True)
        open(f"{tmp}/run/checkpoint-9/trainer_state.json", "w").write("{}")
    torch.distributed.barrier()
    out["resumed"] = _train(world, f"{tmp}/run", 0.2, None, True)
    out["base0"] = _train(world, f"{tmp}/base0", 0.0, None, False)
    out["first0"] = _train(world, f"{tmp}/run0", 0.0, K, False)
    return out


def other_world(rank: int, world: int, root: str, root_neg: str) -> dict[str, Any]:
    """Resume on ``world`` ranks; then the negative control (a copy, without the optimizer)."""
    return {"one": _train(world, root, 0.0, None, True),
            "neg": _train(world, root_neg, 0.0, None, True, checkpoint_exclude=["optimizer"])}
