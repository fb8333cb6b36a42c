"""Helpers of the DeepSpeed tests: the import check, real ranks that start in a
second, a tiny model, engines and deterministic batches.

Starting a DeepSpeed rank costs 5-10 s of imports (torch._dynamo, which DeepSpeed's
optimizer setup pulls in); 4 ranks on 2 cores take 40 s before the first step.
``run_ds`` therefore starts its ranks from a forkserver that has imported torch,
deepspeed and shardpoint once: each rank is still a fresh process with its own
gloo group and nothing of an earlier rank's state, but it starts in ~0.5 s.

DeepSpeed's CPU communication builds a C++ op (``deepspeed_shm_comm``) with the
compiler the first time it runs on a machine: a minute or more on a loaded 2-core
machine, which every rank would otherwise wait for inside its own time bound.
:func:`run_ds` builds it once, in this process, before the first ranks start; the
bounds (``TIMEOUT`` per run, the tests' pytest timeout) leave room for a machine 3-5x
slower than an idle one.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from typing import Any

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("DS_ACCELERATOR", "cpu")

PRELOAD = [
    "torch", "torch._dynamo", "deepspeed", "deepspeed.runtime.zero.muon.muon_optimizer", "deepspeed.runtime.zero.stage3",
    "shardpoint", "shardpoint.integrations.deepspeed", "tests._dist", "tests.integrations.ds_common",
]


def require_deepspeed() -> Any:
    """Import deepspeed, or skip the calling test module saying why; under
    ``CI=true`` a missing DeepSpeed fails instead of skipping."""
    try:
        return importlib.import_module("deepspeed")
    except Exception as e:  # noqa: BLE001 - any import failure means "cannot test DeepSpeed here"
        reason = f"deepspeed cannot be imported ({type(e).__name__}: {e}); pip install 'shardpoint[deepspeed]'"
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI=true and {reason}", pytrace=False)
        pytest.skip(reason, allow_module_level=True)


#: Seconds a run_ds call may take: ~10-20 s on an idle machine, several times that on a loaded one.
TIMEOUT = 240.0
_built = False


def build_comm_op_once() -> None:
    """Build (or load from the torch extensions cache) DeepSpeed's shared-memory comm
    op in this process, so no rank compiles it within its time bound. A machine
    without a compiler has no such op: DeepSpeed then falls back to torch.distributed."""
    global _built
    if _built:
        return
    _built = True
    try:
        from deepspeed.comm.torch import build_shm_op

        build_shm_op()
    except Exception:  # noqa: BLE001 - the ranks meet the same failure and DeepSpeed's fallback
        pass


def run_ds(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = TIMEOUT) -> list[Any]:
    """``tests._dist.run_ranks``, with ranks forked from a server that preloaded DeepSpeed."""
    from tests._dist import run_ranks

    build_comm_op_once()
    return run_ranks(fn, world_size, *args, timeout=timeout, preload=PRELOAD)


# -- model, engine, data ------------------------------------------------------------------------
IN, HID, OUT = 12, 20, 6
GLOBAL_BATCH = 12


def tiny_model(seed: int = 0, dropout: float = 0.0) -> Any:
    import torch

    class Tiny(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            layers = [torch.nn.Linear(IN, HID), torch.nn.Tanh(), torch.nn.Linear(HID, HID), torch.nn.Tanh()]
            self.body = torch.nn.Sequential(*layers, *([torch.nn.Dropout(dropout)] if dropout else []))
            self.head = torch.nn.Linear(HID, OUT)
            self.register_buffer("scale", torch.linspace(0.5, 1.5, OUT))

        def forward(self, x: Any) -> Any:
            return self.head(self.body(x)) * self.scale.to(x.dtype)

    torch.manual_seed(seed)
    return Tiny()


def build_engine(stage: int, *, gas: int = 1, bf16: bool = False, seed: int = 0, scheduler: bool = True,
                 extra: dict[str, Any] | None = None, dropout: float = 0.0) -> Any:
    """A DeepSpeed engine over :func:`tiny_model` with torch AdamW, whose global batch
    is GLOBAL_BATCH on any world size (micro batch GLOBAL_BATCH / (world * gas))."""
    import logging

    import deepspeed
    import torch.distributed as dist

    deepspeed.utils.logger.setLevel(logging.WARNING)
    deepspeed.init_distributed(dist_backend="gloo")
    world = dist.get_world_size()
    assert GLOBAL_BATCH % (world * gas) == 0, (world, gas)
    model = tiny_model(seed, dropout)
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": GLOBAL_BATCH // (world * gas),
        "gradient_accumulation_steps": gas,
        "optimizer": {"type": "AdamW", "params": {"lr": 2e-2, "weight_decay": 0.05, "torch_adam": True}},
        "zero_optimization": {"stage": stage},
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }
    if scheduler:
        cfg["scheduler"] = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 2e-2, "warmup_num_steps": 6}}
    if bf16:
        cfg["bf16"] = {"enabled": True}
    if extra:
        cfg.update(extra)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    return engine


def global_batch(step: int) -> tuple[Any, Any]:
    import torch

    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(GLOBAL_BATCH, IN, generator=g), torch.randn(GLOBAL_BATCH, OUT, generator=g)


def train(engine: Any, first_step: int, steps: int) -> list[float]:
    """Run ``steps`` optimizer steps (each ``gas`` micro steps), starting at global
    step ``first_step``; returns each step's loss averaged over the global batch."""
    import torch
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    gas = engine.gradient_accumulation_steps()
    micro = GLOBAL_BATCH // (world * gas)
    dtype = next(engine.module.parameters()).dtype
    losses = []
    for s in range(first_step, first_step + steps):
        x, y = global_batch(s)
        total = torch.zeros(1, dtype=torch.float64)
        for m in range(gas):
            lo = (m * world + rank) * micro
            out = engine(x[lo : lo + micro].to(dtype))
            loss = torch.nn.functional.mse_loss(out.float(), y[lo : lo + micro])
            engine.backward(loss)
            engine.step()
            total += loss.detach().double()
        dist.all_reduce(total)
        losses.append(float(total) / (world * gas))
    return losses


def full_state(engine: Any) -> dict[str, Any]:
    """Every trainable parameter's full fp32 master and Adam moments, gathered with
    DeepSpeed's own API (collective), by parameter name; plus step and lr. Without
    ZeRO (stage 0) DeepSpeed's API returns None: the fp32 masters are then the
    parameters (fp32) or FP16_UnfusedOptimizer's fp32 copies (bf16)."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    opt = engine.optimizer
    topt = getattr(opt, "optimizer", opt)
    hp_of = {id(p): p for g in topt.param_groups for p in g["params"]}
    if hasattr(opt, "fp32_groups") and hasattr(opt, "fp16_groups"):
        hp_of = {id(lp): hp for lps, hps in zip(opt.fp16_groups, opt.fp32_groups, strict=True) for lp, hp in zip(lps, hps, strict=True)}
    out: dict[str, Any] = {}
    for n, p in engine.module.named_parameters():
        if not p.requires_grad:
            continue
        shape = getattr(p, "ds_shape", p.shape)
        master = safe_get_full_fp32_param(p)
        if master is None:
            hp = hp_of[id(p)]
            out[f"model/{n}"] = hp.detach().clone()
            for k in ("exp_avg", "exp_avg_sq"):
                if k in topt.state.get(hp, {}):
                    out[f"optimizer/state/{n}/{k}"] = topt.state[hp][k].clone()
            continue
        out[f"model/{n}"] = master.detach().clone().reshape(shape)
        for k in ("exp_avg", "exp_avg_sq"):
            v = safe_get_full_optimizer_state(p, k)
            if v is not None:
                out[f"optimizer/state/{n}/{k}"] = v.detach().clone().reshape(shape)
    out["lr"] = [g["lr"] for g in topt.param_groups]
    out["global_steps"] = engine.global_steps
    return out
