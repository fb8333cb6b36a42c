"""Elastic resume end to end: examples/train_elastic.py (FSDP2, gloo, torchrun,
DataLoader with 2 workers) scaled down. A dataset of 100 samples with a global
batch of 8 (12 steps per epoch, 4 samples dropped per epoch); checkpoints at
steps 5 and 10 (mid-epoch); runs cross the epoch boundary at step 12.

Runs, made once for the module:
    base4   uninterrupted, 4 ranks x 1 micro-batch of 2, 21 steps, saves every 5
    same4   resumes base4's step 5 on 4 ranks
    to2     resumes base4's step 5 on 2 ranks (accumulation 2), saves every 5
    to4     resumes to2's step 10 on 4 ranks: a 2-rank checkpoint on 4 ranks
    control resumes base4's step 5 on 2 ranks without the data position
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests._dist import torchrun as _torchrun

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(400)]

ROOT = Path(__file__).resolve().parents[2]
TRAIN = ROOT / "examples" / "train_elastic.py"
STEPS = 21
SMALL = ["--dataset-size", "100", "--train-batch-size", "8", "--micro-batch-size", "2", "--steps", str(STEPS),
         "--seq-len", "16", "--vocab", "64", "--dim", "32", "--layers", "2", "--heads", "2", "--warmup", "2",
         "--num-workers", "2", "--log-samples"]


def torchrun(nproc: int, out: Path, name: str, *extra: str, timeout: float = 150) -> Path:
    proc = _torchrun(nproc, TRAIN, *SMALL, "--out", str(out), "--run-name", name, *extra, timeout=timeout,
                     env={"PYTHONPATH": str(ROOT / "src")}, cwd=ROOT, merge_stderr=True)
    output = proc.stdout
    assert proc.returncode == 0, f"{name} failed:\n{output[-6000:]}"
    return out / name


def read(run: Path, what: str) -> dict[int, object]:
    with open(run / f"{what}.jsonl") as f:
        rows = [json.loads(line) for line in f]
    return {r["step"]: r["loss" if what == "losses" else "samples"] for r in rows}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("elastic")
    base4 = torchrun(4, out, "base4", "--checkpoint-every", "5")
    from_base = ["--resume", "--resume-step", "5", "--checkpoint-dir", str(base4 / "checkpoints")]
    r = {"base4": base4}
    r["same4"] = torchrun(4, out, "same4", *from_base)
    # to2 saves checkpoints of its own: give it a folder holding a copy of base4's step 5
    to2_ckpt = out / "to2ckpt"
    shutil.copytree(base4 / "checkpoints" / "step-00000005", to2_ckpt / "step-00000005")
    r["to2"] = torchrun(2, out, "to2", "--resume", "--resume-step", "5", "--checkpoint-dir", str(to2_ckpt),
                        "--checkpoint-every", "5")
    r["to4"] = torchrun(4, out, "to4", "--resume", "--resume-step", "10", "--checkpoint-dir", str(to2_ckpt))
    r["control"] = torchrun(2, out, "control", *from_base, "--no-restore-data")
    return r


def rel_diffs(a: dict, b: dict, after: int) -> list[float]:
    steps = [s for s in sorted(b) if s > after]
    assert steps == list(range(after + 1, STEPS + 1))
    return [abs(a[s] - b[s]) / abs(a[s]) for s in steps]


def test_same_world_size_resume_is_bitwise_identical(runs: dict[str, Path]) -> None:
    base, same = read(runs["base4"], "losses"), read(runs["same4"], "losses")
    assert sorted(same) == list(range(6, STEPS + 1))
    assert [same[s] for s in sorted(same)] == [base[s] for s in sorted(same)]


def test_resume_4_to_2_tracks_the_uninterrupted_run(runs: dict[str, Path]) -> None:
    diffs = rel_diffs(read(runs["base4"], "losses"), read(runs["to2"], "losses"), after=5)
    assert len(diffs) >= 10 and max(diffs) < 1e-4, diffs


def test_resume_2_to_4_tracks_the_uninterrupted_run(runs: dict[str, Path]) -> None:
    # a checkpoint made on 2 ranks (at step 10 of the 4 -> 2 run), resumed on 4
    diffs = rel_diffs(read(runs["base4"], "losses"), read(runs["to4"], "losses"), after=10)
    assert len(diffs) >= 10 and max(diffs) < 1e-4, diffs
    diffs = rel_diffs(read(runs["to2"], "losses"), read(runs["to4"], "losses"), after=10)
    assert max(diffs) < 1e-4, diffs


def test_sample_multisets_match_step_by_step(runs: dict[str, Path]) -> None:
    base = read(runs["base4"], "samples")
    for name, after in (("same4", 5), ("to2", 5), ("to4", 10)):
        got = read(runs[name], "samples")
        assert sorted(got) == list(range(after + 1, STEPS + 1))
        for s in sorted(got):
            assert got[s] == base[s], f"{name}: step {s} consumed other samples"
    # within an epoch no sample is used twice; across the boundary at step 12 a new epoch starts
    epoch0 = [i for s in range(1, 13) for i in base[s]]  # type: ignore[attr-defined]
    assert len(epoch0) == len(set(epoch0)) == 96


def test_negative_control_breaks_both_bounds(runs: dict[str, Path]) -> None:
    base, ctrl = read(runs["base4"], "losses"), read(runs["control"], "losses")
    assert max(rel_diffs(base, ctrl, after=5)) > 1e-4
    base_s, ctrl_s = read(runs["base4"], "samples"), read(runs["control"], "samples")
    assert any(ctrl_s[s] != base_s[s] for s in ctrl_s)
    assert ctrl_s[6] == base_s[1]  # the sampler restarted at the start of the epoch
