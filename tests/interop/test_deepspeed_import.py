"""Import of checkpoints written by DeepSpeed's own ``engine.save_checkpoint``: fp32
weights equal ``zero_to_fp32`` byte for byte, Adam moments equal
``ds_to_universal --inject_missing_state``, the result resumes training on another
world size (and ZeRO stage) and loads into a plain PyTorch model, and a file with a
class outside the allowlist is refused."""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.integrations.ds_common import build_engine, require_deepspeed, run_ds, tiny_model, train

require_deepspeed()

pytestmark = [pytest.mark.distributed, pytest.mark.deepspeed, pytest.mark.timeout(900)]

REL = 1e-4
ENV = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}


def _ds_save(rank: int, world: int, stage: int, bf16: bool, path: str, after: int) -> list[float]:
    engine = build_engine(stage, bf16=bf16)
    train(engine, 0, 2)
    engine.save_checkpoint(path, client_state={"epoch": 3, "best": 0.25})
    return train(engine, 2, after)


def _load_continue(rank: int, world: int, stage: int, path: str, after: int) -> list[float]:
    from shardpoint.integrations.deepspeed import load

    engine = build_engine(stage, seed=1)
    client: dict = {}
    report = load(engine, path, client_state=client)
    assert report.missing == [] and report.unexpected == [], report
    assert client == {"epoch": 3, "best": 0.25}
    assert engine.global_steps == 2
    return train(engine, 2, after)


def _zero_to_fp32(folder: str) -> dict[str, torch.Tensor]:
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        sd = get_fp32_state_dict_from_zero_checkpoint(folder)
    return {k: v.contiguous() for k, v in sd.items()}


def _universal(folder: str, out: Path) -> Path:
    """Run DeepSpeed's converter the way its users must for a plain nn.Module."""
    subprocess.run(
        [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", folder,
         "--output_folder", str(out), "--inject_missing_state", "--num_extract_workers", "1", "--num_merge_workers", "1"],
        check=True, env=ENV, capture_output=True, timeout=300,
    )
    return out / "zero"


@pytest.mark.parametrize("stage,bf16,world", [(2, False, 2), (3, False, 3), (2, True, 3), (3, True, 2)])
def test_import_equals_deepspeeds_own_converters(tmp_path: Path, stage: int, bf16: bool, world: int) -> None:
    import shardpoint
    from shardpoint.integrations.deepspeed import convert

    ds = str(tmp_path / "ds")
    run_ds(_ds_save, world, stage, bf16, ds, 0)
    convert(ds, tmp_path / "sp", progress=False)
    got = shardpoint.load_full(tmp_path / "sp")
    meta = shardpoint.metadata(tmp_path / "sp")
    assert meta.world_size == world

    ref = _zero_to_fp32(ds)
    params = [k for k, _ in tiny_model().named_parameters()]
    for name in params:
        mine, theirs = got["model"][name], ref[name]
        assert mine.dtype == theirs.dtype == torch.float32 and torch.equal(mine, theirs), name
    assert torch.equal(got["model"]["scale"], ref["scale"].to(got["model"]["scale"].dtype))

    uni = _universal(os.path.join(ds, "global_step2"), tmp_path / "universal")
    for name in params:
        for k in ("exp_avg", "exp_avg_sq"):
            theirs = torch.load(uni / name / f"{k}.pt", weights_only=False)
            theirs = theirs["param"] if isinstance(theirs, dict) else theirs  # ZeRO-3: a bare flat tensor
            mine = got["optimizer"]["state"][name][k]
            assert mine.shape == tuple(ref[name].shape) and mine.numel() == theirs.numel(), (name, k)
            assert torch.equal(mine.reshape(-1), theirs.reshape(-1)), (name, k)
        assert float(got["optimizer"]["state"][name]["step"]) == 2.0
        if (uni / name / "step.pt").exists():  # ZeRO-2; ZeRO-3 keeps one step in zero/optimizer_state.pt
            assert float(torch.load(uni / name / "step.pt", weights_only=False)) == 2.0
    assert got["client"] == {"epoch": 3, "best": 0.25}
    assert got["engine"] == {"global_steps": 2, "global_samples": 24, "skipped_steps": 0}
    assert got["scheduler"] == {"last_batch_iteration": 1}
    assert got["optimizer"]["param_groups"][0]["params"] == params


def test_imported_zero2_checkpoint_resumes_on_three_ranks_under_zero3(tmp_path: Path) -> None:
    from shardpoint.integrations.deepspeed import convert

    ds = str(tmp_path / "ds")
    ref = run_ds(_ds_save, 2, 2, False, ds, 3)[0]
    convert(ds, tmp_path / "sp", progress=False)
    got = run_ds(_load_continue, 3, 3, str(tmp_path / "sp"), 3)[0]
    assert max(abs(a - b) / abs(b) for a, b in zip(got, ref, strict=True)) <= REL, (got, ref)


def test_imported_checkpoint_loads_into_plain_pytorch(tmp_path: Path) -> None:
    import shardpoint
    from shardpoint.integrations.deepspeed import convert

    ds = str(tmp_path / "ds")
    run_ds(_ds_save, 2, 3, False, ds, 0)
    convert(ds, tmp_path / "sp", progress=False)
    model = tiny_model(seed=7)
    opt = torch.optim.AdamW(model.parameters(), lr=0.5)
    state = shardpoint.TrainState(model=model, optimizer=opt, rng=False)
    report = shardpoint.load(state, tmp_path / "sp")
    ref = _zero_to_fp32(ds)
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), ref[name]), name
        assert set(opt.state[p]) == {"step", "exp_avg", "exp_avg_sq"}
    assert opt.param_groups[0]["lr"] == pytest.approx(0.0077370561446908305)  # WarmupLR after 2 steps
    assert report.missing == [] and "engine/global_steps" not in report.loaded


def test_cli_converts_without_deepspeed_and_refuses_unknown_classes(tmp_path: Path) -> None:
    import argparse

    ds = tmp_path / "ds"
    run_ds(_ds_save, 2, 2, False, str(ds), 0)
    cli = [sys.executable, "-m", "shardpoint.cli", "convert", "--from", "deepspeed", "--no-progress"]
    # converting needs no DeepSpeed: run it where importing deepspeed fails
    fake = tmp_path / "no_ds" / "deepspeed"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('DeepSpeed is not installed here')\n")
    no_ds = {**ENV, "PYTHONPATH": os.pathsep.join([str(fake.parent), ENV.get("PYTHONPATH", "")])}
    ok = subprocess.run([*cli, str(ds), str(tmp_path / "sp")], env=no_ds, capture_output=True, text=True, timeout=240)
    assert ok.returncode == 0, ok.stderr
    assert (tmp_path / "sp").is_dir()

    # a DeepSpeed file that carries one more class: refused, naming it; nothing written
    f = ds / "global_step2" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    sd = torch.load(f, weights_only=False)
    sd["optimizer_state_dict"]["extra"] = argparse.Namespace(evil=True)
    torch.save(sd, f)
    bad = subprocess.run([*cli, str(ds), str(tmp_path / "sp2")], env=ENV, capture_output=True, text=True, timeout=240)
    assert bad.returncode == 2
    assert "argparse.Namespace" in bad.stderr and "zero_pp_rank_1" in bad.stderr, bad.stderr
    assert not (tmp_path / "sp2" / "manifest.json").exists()

    from shardpoint import ShardpointError
    from shardpoint.integrations.deepspeed import convert

    with pytest.raises(ShardpointError, match=r"refusing to unpickle argparse\.Namespace"):
        convert(ds, tmp_path / "sp3", progress=False)
