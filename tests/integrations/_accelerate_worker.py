"""Ranks of the Accelerate tests: a plain Accelerate training loop (``prepare``,
``backward``, ``step``) on gloo, saving with ``save_state`` every 3 steps, stopped
after K steps and resumed with ``load_state``."""

from __future__ import annotations

import os
from typing import Any

import torch

from tests.integrations._hf_worker import GBS, STEPS, Data, K, Net, _digest


class Counter:
    """A registered object: the loop's step."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        self.step = int(sd["step"])


def _keeper() -> Any:
    """An Accelerate tracker that keeps what it is given (the base run's: the saves' figures)."""
    from accelerate.tracking import GeneralTracker

    class Keep(GeneralTracker):
        name = "keep"
        requires_logging_directory = False

        def __init__(self) -> None:
            super().__init__()
            self.rows: list[dict[str, float]] = []

        @property
        def tracker(self) -> Any:
            return self.rows

        def store_init_configuration(self, values: dict[str, Any]) -> None:
            pass

        def log(self, values: dict[str, float], step: int | None = None, **kwargs: Any) -> None:
            self.rows.append(dict(values))

    return Keep()


def _run(world: int, root: str, dropout: float, stop_at: int, resume: str | None, misuse: bool = False,
         exclude: list[str] | None = None, tracker: Any = None) -> dict[str, Any]:
    from accelerate import Accelerator, DataLoaderConfiguration

    import shardpoint
    from shardpoint.integrations.accelerate import ResumableLoader, load_state, save_state

    torch.manual_seed(0)
    # the scheduler counts optimizer steps (by default Accelerate steps it once per process per step,
    # so its position would depend on the number of processes)
    acc = Accelerator(cpu=True, step_scheduler_with_optimizer=False,
                      dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=7),
                      log_with=[tracker] if tracker is not None else None)
    if tracker is not None:
        acc.init_trackers("shardpoint-test")
    model = Net(dropout)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)
    loader = torch.utils.data.DataLoader(Data(), batch_size=GBS // world, shuffle=True)
    model, opt, loader, sched = acc.prepare(model, opt, loader, sched)
    data, counter = ResumableLoader(loader), Counter()
    acc.register_for_checkpointing(data)
    acc.register_for_checkpointing(counter)
    out: dict[str, Any] = {"misuse": None}
    if resume:
        load_state(acc, resume, exclude=exclude, timeout=120)
    net = acc.unwrap_model(model)
    done = False
    while not done:
        for batch in data:
            if counter.step == K:
                inner = opt.optimizer
                out["at_k"] = {
                    "params": {n: _digest(p) for n, p in net.named_parameters()},
                    "opt": {f"{i}/{n}": _digest(v) for i, p in enumerate(inner.param_groups[0]["params"])
                            for n, v in inner.state[p].items()},
                    "sched": sched.scheduler.state_dict(), "lr": inner.param_groups[0]["lr"],
                }
            loss = model(**batch)["loss"]
            acc.backward(loss)
            opt.step()
            sched.step()
            opt.zero_grad()
            counter.step += 1
            if misuse and counter.step == 2:  # a save only the main process makes
                if acc.is_main_process:
                    try:
                        save_state(acc, f"{root}/misuse", timeout=3)
                    except shardpoint.CollectiveMismatchError as e:
                        out["misuse"] = {"ranks": e.ranks, "msg": str(e)}
            if counter.step % 3 == 0:
                save_state(acc, f"{root}/step_{counter.step}", timeout=120)
            if counter.step == stop_at:
                done = True
                break
    out.update(losses=net.losses, ids=net.ids, rng=net.rng, step=counter.step,
               listing=sorted(os.listdir(root)) if os.path.isdir(root) else [])
    return out


def same_world(rank: int, world: int, tmp: str) -> dict[str, Any]:
    keep = _keeper()
    out = {"base": _run(world, f"{tmp}/base", 0.2, STEPS, None, tracker=keep)}
    out["logged"] = [row for row in keep.rows if any(k.startswith("checkpoint/") for k in row)]
    out["first"] = _run(world, f"{tmp}/run", 0.2, K, None, misuse=True)
    out["resumed"] = _run(world, f"{tmp}/run", 0.2, STEPS, f"{tmp}/run/step_{K}")
    out["base0"] = _run(world, f"{tmp}/base0", 0.0, STEPS, None)
    out["first0"] = _run(world, f"{tmp}/run0", 0.0, K, None)
    return out


def other_world(rank: int, world: int, root: str, root_neg: str) -> dict[str, Any]:
    """Resume on ``world`` ranks; then the negative control (a copy, without the optimizer)."""
    return {"one": _run(world, root, 0.0, STEPS, f"{root}/step_{K}"),
            "neg": _run(world, root_neg, 0.0, STEPS, f"{root_neg}/step_{K}", exclude=["optimizer"])}
