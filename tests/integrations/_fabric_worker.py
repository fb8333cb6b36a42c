"""Ranks of the Fabric tests: a real ``Fabric(strategy=ShardpointFabricDDPStrategy())``
on gloo, trained, saved with ``fabric.save``, resumed with ``fabric.load`` into fresh
objects, on the same and on another number of ranks."""

from __future__ import annotations

import hashlib
from typing import Any

import torch

GBS, STEPS, K = 8, 6, 3  # global batch, steps in all, save after K


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()[:16]


def _fabric(world: int) -> Any:
    import lightning as L

    from shardpoint.integrations.fabric import ShardpointFabricDDPStrategy

    fabric = L.Fabric(accelerator="cpu", devices=world, strategy=ShardpointFabricDDPStrategy(
        process_group_backend="gloo"))
    fabric.launch()
    return fabric


def _objects(fabric: Any, seed: int) -> tuple[Any, Any, Any]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    model, opt = fabric.setup(model, opt)
    return model, opt, sched


def _batch(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's share of global batch ``step`` (the same global batch on any world size)."""
    g = torch.Generator().manual_seed(1000 + step)
    x, y = torch.randn(GBS, 4, generator=g), torch.randn(GBS, generator=g)
    per = GBS // world
    return x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]


def _train(fabric: Any, model: Any, opt: Any, sched: Any, steps: range) -> list[float]:
    losses = []
    for s in steps:
        x, y = _batch(s, fabric.global_rank, fabric.world_size)
        loss = torch.nn.functional.mse_loss(model(x).squeeze(-1), y)
        fabric.backward(loss)
        opt.step()
        opt.zero_grad()
        sched.step()
        losses.append(fabric.all_reduce(loss.detach(), reduce_op="mean").item())
    return losses


def _snapshot(model: Any, opt: Any) -> dict[str, Any]:
    inner = opt.optimizer if hasattr(opt, "optimizer") else opt
    return {"params": {n: _digest(p) for n, p in model.named_parameters()},
            "opt": {f"{i}/{k}": _digest(v) if torch.is_tensor(v) else v
                    for i, p in enumerate(inner.param_groups[0]["params"]) for k, v in inner.state[p].items()},
            "lr": inner.param_groups[0]["lr"]}


def same_world(rank: int, world: int, tmp: str) -> dict[str, Any]:
    """Uninterrupted STEPS steps; then K steps, fabric.save, fresh objects, fabric.load, the rest."""
    fabric = _fabric(world)
    model, opt, sched = _objects(fabric, 0)
    base = _train(fabric, model, opt, sched, range(STEPS))
    model, opt, sched = _objects(fabric, 0)
    first = _train(fabric, model, opt, sched, range(K))
    at_k = _snapshot(model, opt)
    path = f"{tmp}/ckpt/step-{K}"
    fabric.save(path, {"model": model, "optimizer": opt, "scheduler": sched, "step": K, "note": "hello"})
    model, opt, sched = _objects(fabric, 1)  # other weights, an optimizer that never stepped
    state = {"model": model, "optimizer": opt, "scheduler": sched, "step": 0}
    remainder = fabric.load(path, state)
    loaded = _snapshot(model, opt)
    resumed = _train(fabric, model, opt, sched, range(state["step"], STEPS))
    full = fabric.load(path)  # no state: the whole checkpoint (Fabric calls it on every rank)
    raw = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    fabric.load_raw(path, raw)
    # a file as Fabric's own CheckpointIO writes it (torch.save on rank 0) still loads, by Fabric's code
    stock = f"{tmp}/stock.ckpt"
    if rank == 0:
        torch.save({"model": raw.state_dict(), "step": 7}, stock)
    fabric.barrier()
    fresh, _, _ = _objects(fabric, 2)
    stock_state = {"model": fresh, "step": 0}
    fabric.load(stock, stock_state)
    from shardpoint.errors import UsageError

    try:  # refused on every rank before anything collective: no hang, nothing written
        fabric.save(f"{tmp}/filtered", {"model": model}, filter={"model": lambda k, v: "bias" not in k})
        refused = None
    except UsageError as e:
        refused = str(e)
    return {"stock": [stock_state["step"], {n.split("module.")[-1]: _digest(p) for n, p in fresh.named_parameters()}],
            "refused": refused,"base": base, "first": first, "resumed": resumed, "at_k": at_k, "loaded": loaded, "step": state["step"],
            "remainder": remainder, "sched": sched.state_dict(),
            "full": None if full is None else {"keys": sorted(full), "model": sorted(full["model"]),
                                               "note": full["note"], "step": full["step"]},
            "raw": {n: _digest(p) for n, p in raw.named_parameters()}}


def one_rank(rank: int, world: int, tmp: str) -> dict[str, Any]:
    """The uninterrupted run and the save at step K on 1 rank."""
    fabric = _fabric(world)
    model, opt, sched = _objects(fabric, 0)
    base = _train(fabric, model, opt, sched, range(STEPS))
    model, opt, sched = _objects(fabric, 0)
    _train(fabric, model, opt, sched, range(K))
    fabric.save(f"{tmp}/one/step-{K}", {"model": model, "optimizer": opt, "scheduler": sched, "step": K})
    return {"base": base, "at_k": _snapshot(model, opt)}


def other_world(rank: int, world: int, tmp: str) -> dict[str, Any]:
    """The 1-rank checkpoint resumed on ``world`` ranks, the global batch kept."""
    fabric = _fabric(world)
    model, opt, sched = _objects(fabric, 1)
    state = {"model": model, "optimizer": opt, "scheduler": sched, "step": 0}
    fabric.load(f"{tmp}/one/step-{K}", state)
    loaded = _snapshot(model, opt)
    return {"loaded": loaded, "step": state["step"], "resumed": _train(fabric, model, opt, sched,
                                                                        range(state["step"], STEPS))}
