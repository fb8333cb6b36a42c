"""The documentation's code runs as written (issue 33): each ```python block of README.md
and docs/ that runs in one process is executed verbatim after a short prelude that
makes the names it assumes (a model, an optimizer, a dataset...); the others (a
signature, a snippet that needs torchrun, DeepSpeed or a trainer) are listed with the
test that runs the same calls for real. A block added to the docs and listed nowhere
fails the test."""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

_MODEL = """
import torch
model = torch.nn.Linear(4, 2)
opt = torch.optim.AdamW(model.parameters(), lr=0.01)
sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1)
"""

#: After a block: what it must have done (the block's own names are there).
AFTER: dict[tuple[str, int], str] = {
    ("README.md", 1): "assert manager.latest_step() == 0 and state.extra['step'] == total_steps - 1",
    ("README.md", 2): "assert report.loaded and torch.equal(state['model']['weight'], model.weight)",
    ("elastic.md", 1): "assert report is None and sampler.state_dict()['samples_consumed'] == 256 * total_steps",
    ("errors.md", 1): "assert report is not None and manager.latest_step() == 1",
    ("operations.md", 1): ("manager.save(shardpoint.TrainState(model=torch.nn.Linear(2, 2), rng=False), 1)\n"
                           "assert [r[0] for r in writer.rows] == ['checkpoint/save_s', 'checkpoint/stall_s', "
                           "'checkpoint/GB']"),
    ("tiers.md", 1): "assert mgr.latest_step() == 0 and sorted(mgr._tiers.area.steps()) == [1, 2]",  # 0: due for durability
}

#: Preludes of the blocks that run here: (file name, index of the block in it) -> code run first.
RUN: dict[tuple[str, int], str] = {
    ("README.md", 1): _MODEL + """
from shardpoint.elastic import ElasticBatchSampler
sampler = ElasticBatchSampler(64, global_batch_size=8, micro_batch_size=8, rank=0, world_size=1)
total_steps = 3
batches = iter([torch.randn(8, 4) for _ in range(total_steps)])
def train_step(model, opt, x):
    loss = model(x).pow(2).mean()
    loss.backward(); opt.step(); opt.zero_grad()
    return loss
""",
    ("README.md", 2): _MODEL + """
import shardpoint
model_sd, optim_sd, rng = model.state_dict(), {"lr": 0.01}, torch.get_rng_state()
state = {"model": {k: torch.zeros_like(v) for k, v in model_sd.items()}}
""",
    ("elastic.md", 1): _MODEL + """
import torch.nn.functional as F
dataset = torch.utils.data.TensorDataset(torch.randn(512, 4), torch.randn(512, 2))
loss_fn, world_size, tokens_per_global_batch, total_steps = F.mse_loss, 1, 256, 2
""",
    ("errors.md", 1): _MODEL + """
import logging, sys
import shardpoint
state = shardpoint.TrainState(model=model, optimizer=opt, rng=False)
manager, step, path, log = shardpoint.CheckpointManager("root"), 1, "ckpt", logging.getLogger("snippet")
""",
    ("operations.md", 1): """
import shardpoint, torch
class _Writer:
    def __init__(self): self.rows = []
    def add_scalar(self, *a): self.rows.append(a)
writer = _Writer()
""",
    ("tiers.md", 1): _MODEL + """
import shardpoint
state = shardpoint.TrainState(model=model, optimizer=opt, rng=False)
start, end = 0, 3
""",
}

#: The blocks that do not run in one process, and the test that runs their calls for real.
ELSEWHERE: dict[tuple[str, int], str] = {
    ("README.md", 3): "tests/integrations/test_deepspeed.py (spds.save / spds.load on 2 DeepSpeed ranks)",
    ("README.md", 4): "tests/interop/test_deepspeed_import.py (spds.convert)",
    ("README.md", 5): "tests/integrations/test_lightning.py, test_hf_trainer.py, test_accelerate.py (the three trainers)",
    ("deepspeed.md", 1): "tests/integrations/test_deepspeed.py",
    ("deepspeed.md", 2): "tests/interop/test_deepspeed_import.py",
    ("elastic.md", 2): "a signature (tests/elastic/test_sampler.py)",
    ("internals.md", 1): "signatures (tests/test_api.py)",
    ("internals.md", 2): "a protocol's outline (tests/test_adapters.py)",
    ("storage.md", 1): "S3 with a named AWS profile (tests/storage/test_s3_checkpoint.py, on the loopback server)",
    ("storage.md", 2): "S3 retry options (tests/storage/test_s3_retry.py)",
    ("trainers.md", 1): "tests/integrations/test_lightning.py (the same Trainer and strategy on 2 ranks)",
    ("trainers.md", 2): "tests/integrations/test_hf_trainer.py",
    ("trainers.md", 3): "tests/integrations/test_accelerate.py",
    ("trainers.md", 4): "tests/integrations/test_fabric.py (fabric.save / fabric.load on 2 ranks, and 1 -> 2 ranks)",
}


def _blocks() -> list[tuple[str, int, str]]:
    out = []
    for path in DOCS:
        found = re.findall(r"^```python\n(.*?)^```", path.read_text(), flags=re.S | re.M)
        out += [(path.name, i, code) for i, code in enumerate(found, start=1)]
    return out


def test_every_block_is_run_here_or_names_its_test() -> None:
    blocks = {(name, i) for name, i, _ in _blocks()}
    assert blocks == set(RUN) | set(ELSEWHERE), (sorted(blocks - set(RUN) - set(ELSEWHERE)),
                                                 sorted((set(RUN) | set(ELSEWHERE)) - blocks))


@pytest.mark.parametrize("name,index", sorted(RUN))
def test_the_block_runs_as_written(name: str, index: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    code = {(n, i): c for n, i, c in _blocks()}[(name, index)]
    monkeypatch.chdir(tmp_path)
    env: dict[str, Any] = {"__name__": f"snippet_{name}_{index}"}
    exec(compile(RUN[(name, index)], f"<prelude {name}#{index}>", "exec"), env)  # noqa: S102 - the docs' own code
    try:
        exec(compile(code, f"<{name} block {index}>", "exec"), env)  # noqa: S102
        exec(compile(AFTER[(name, index)], f"<after {name}#{index}>", "exec"), env)  # noqa: S102
    finally:
        mgr = env.get("mgr")
        tiers = getattr(mgr, "_tiers", None)
        if tiers is not None:  # the memory tier's folder in shared memory
            mgr.close()
            shutil.rmtree(tiers.area.dir, ignore_errors=True)
