"""Worker side of compare.py for DeepSpeed ZeRO-2 (CPU, gloo, torch AdamW).

Run by compare.py as real processes, never by hand:
    python benchmarks/compare_ds.py ds_save <cfg.json>   # 4 ranks: one step, save_checkpoint
    python benchmarks/compare_ds.py ds_load <cfg.json>   # 2 ranks: load the universal checkpoint

DeepSpeed's save_checkpoint does not fsync; the ``ds_fsync`` row is the time to
make its files durable afterwards, so that ``ds_save + ds_fsync`` compares with
savers that fsync.
"""

from __future__ import annotations

import os
import sys
import time
from datetime import timedelta
from typing import Any

os.environ.setdefault("DS_ACCELERATOR", "cpu")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from _common import fsync_tree  # noqa: E402
from compare_fsdp import Recorder  # noqa: E402
from compare_model import batch, build  # noqa: E402


def engine_for(cfg: dict[str, Any], universal: bool) -> Any:
    import deepspeed

    model = build(cfg["size_mb"], seed=0 if not universal else 1)
    ds_cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 8,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        "zero_optimization": {"stage": 2},
        "steps_per_print": 1 << 30,
    }
    if universal:
        ds_cfg["checkpoint"] = {"load_universal": True}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_cfg)
    return engine


def fp32_fingerprint(engine: Any) -> float:
    """Weighted sum of the full fp32 parameters (collective)."""
    from deepspeed.utils import safe_get_full_fp32_param

    acc = 0.0
    for i, (_, p) in enumerate(sorted(engine.module.named_parameters())):
        full = safe_get_full_fp32_param(p).reshape(-1).to(torch.float64)
        w = (torch.arange(full.numel(), dtype=torch.int64) % 1021 + 1).to(torch.float64)
        acc += float((full * w).sum()) * (i + 1)
    return acc


def role_ds_save(cfg: dict[str, Any]) -> None:
    import deepspeed.comm as dist

    rank = dist.get_rank()
    rec = Recorder(os.path.join(cfg["workdir"], f"ds_save.rank{rank}.json"))
    engine = engine_for(cfg, universal=False)
    loss = engine(batch(cfg["size_mb"], rank)).pow(2).mean()
    engine.backward(loss)
    engine.step()
    rec.info["fingerprint"] = fp32_fingerprint(engine)
    rec.flush()
    rec.op("ds_save", lambda: engine.save_checkpoint(cfg["dirs"]["ds"], tag="step1"))
    rec.op("ds_fsync", lambda: fsync_tree(cfg["dirs"]["ds"]), flush=False, ranks=(0,))


def role_ds_load(cfg: dict[str, Any]) -> None:
    import deepspeed.comm as dist

    rank = dist.get_rank()
    rec = Recorder(os.path.join(cfg["workdir"], f"ds_load.rank{rank}.json"))
    engine = engine_for(cfg, universal=True)
    rec.op("ds_universal_load2", lambda: engine.load_checkpoint(cfg["dirs"]["ds"]), drop=True)
    got = fp32_fingerprint(engine)
    want = cfg["fingerprint"]
    rec.info.setdefault("verified", {})["ds_universal_load2"] = abs(got - want) <= 1e-9 * max(abs(want), 1.0)
    rec.flush()


def main() -> None:
    role, cfg_path = sys.argv[1], sys.argv[2]
    import json

    with open(cfg_path) as f:
        cfg = json.load(f)
    torch.set_num_threads(1)
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo", timeout=timedelta(seconds=cfg.get("pg_timeout", 600)))
    import torch.distributed as tdist

    t0 = time.perf_counter()
    {"ds_save": role_ds_save, "ds_load": role_ds_load}[role](cfg)
    tdist.barrier()
    print(f"{role} done in {time.perf_counter() - t0:.1f}s", flush=True)
    os._exit(0)  # DeepSpeed's teardown can hang for minutes after the work is done


if __name__ == "__main__":
    main()
