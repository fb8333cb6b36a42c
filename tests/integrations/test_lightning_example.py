"""examples/lightning_example.py as documented: ``torchrun --nproc_per_node 2``, the
``ElasticBatchSampler`` built before ``Trainer.fit`` creates the process group. The
sampler must read its rank and the world size when fit iterates it: built as rank 0
of 1 and left so, both ranks trained on the same 4 samples at every step while the
position moved by 8."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests._dist import free_port
from tests.integrations._frameworks import need

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(400)]

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "lightning_example.py"
STEPS = 4


def test_the_documented_example_splits_each_global_batch_between_the_ranks(tmp_path: Path) -> None:
    need("lightning")
    from shardpoint.elastic import ElasticBatchSampler

    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), str(EXAMPLE), "--steps", str(STEPS), "--out", str(out),
           "--log-samples"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT)]))
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, start_new_session=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        output, _ = proc.communicate(timeout=360)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, output[-6000:]
    per_rank = []
    for r in range(2):
        rows = [json.loads(line) for line in (out / f"samples-rank{r}.jsonl").read_text().splitlines()]
        per_rank.append({row["step"]: row["ids"] for row in rows})
    assert sorted(per_rank[0]) == sorted(per_rank[1]) == list(range(1, STEPS + 1)), per_rank
    # the job's global batches, from the same sampler on one rank of one
    whole = ElasticBatchSampler(256, 8, 8, rank=0, world_size=1)
    for step in range(1, STEPS + 1):
        a, b = per_rank[0][step], per_rank[1][step]
        assert len(a) == len(b) == 4 and not set(a) & set(b), f"step {step}: rank 0 {a}, rank 1 {b}"
        assert a + b == whole.global_batch(), f"step {step}: ranks {a} + {b}, global batch {whole.global_batch()}"
        whole.step()
