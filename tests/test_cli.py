"""The ``shardpoint`` command: what each command prints and the exit codes scripts
rely on (0 ok, 1 damaged / incomplete / differs, 2 usage or environment), on good,
incomplete (no manifest) and damaged (one flipped data byte) checkpoints."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import shardpoint
from shardpoint.cli import main

ROOT = Path(__file__).resolve().parents[1]


def _state(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(4, 3, generator=g)
    state: dict[str, Any] = {"model": {"w": w + step, "b": torch.zeros(3)}, "step": step, "name": "run"}
    if step >= 30:
        state["model"]["extra"] = torch.ones(2)
    return state


def _flip_data_byte(folder: Path) -> str:
    """Flip one byte of tensor data (past the safetensors header) of a data file."""
    f = sorted(p for p in folder.iterdir() if p.suffix == ".safetensors")[0]
    raw = bytearray(f.read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    raw[8 + n + 3] ^= 0x40
    f.write_bytes(bytes(raw))
    return f.name


@pytest.fixture()
def root(tmp_path: Path) -> Path:
    mgr = shardpoint.CheckpointManager(tmp_path / "ckpt")
    for step in (10, 20, 30):
        mgr.save(_state(step), step)
    # a save that never committed: data files, no manifest
    inc = tmp_path / "ckpt" / "step-00000040"
    shardpoint.save(_state(40), inc)
    (inc / "manifest.json").unlink()
    return tmp_path / "ckpt"


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_ls_lists_steps_status_and_latest(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "ls", str(root), "--json")
    assert code == 0
    rows = json.loads(out)
    assert [(r["step"], r["status"], r["latest"], r["world_size"]) for r in rows] == [
        (10, "committed", False, 1), (20, "committed", False, 1), (30, "committed", True, 1), (40, "incomplete", False, None)]
    assert all(r["size"] > 0 for r in rows[:3]) and rows[0]["time"]
    code, out, _ = run(capsys, "ls", str(root))
    assert code == 0
    lines = [ln for ln in out.splitlines() if "step" not in ln.lower() and any(c.isdigit() for c in ln)]
    assert any(" 30 " in ln and "committed" in ln and "<- latest" in ln for ln in lines), out
    assert any(" 40 " in ln and "incomplete" in ln for ln in lines), out
    assert run(capsys, "ls", str(root / "nope"))[0] == 2


def test_inspect_tree_json_and_sharding(tmp_path: Path, root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from shardpoint.api import save_offline
    from shardpoint.layout import FlatShard

    t = torch.arange(12.0).reshape(4, 3)
    save_offline([(0, {"model": {"w": FlatShard(t[:2].reshape(-1).clone(), (4, 3), 0)}, "it": 5}),
                  (1, {"model": {"w": FlatShard(t[2:].reshape(-1).clone(), (4, 3), 6)}, "it": 5})],
                 tmp_path / "two", world_size=2)
    code, out, _ = run(capsys, "inspect", str(tmp_path / "two"), "--json")
    assert code == 0
    doc = json.loads(out)
    assert doc["world_size"] == 2 and doc["values"] == {"it": 5}
    w = doc["tensors"]["model/w"]
    assert w["shape"] == [4, 3] and w["dtype"] == "float32" and w["nbytes"] == 48
    assert w["sharding"] == "2 shards on dim 0 (even)"
    assert [c["offsets"] for c in w["chunks"]] == [[0, 0], [2, 0]]

    code, out, _ = run(capsys, "inspect", str(tmp_path / "two"))
    assert code == 0
    assert "saved by 2 rank(s)" in out and "model/" in out
    assert "w  float32[4, 3]  48 B  2 shards on dim 0 (even)" in out and "it  = 5" in out

    code, out2, _ = run(capsys, "info", str(tmp_path / "two"))  # the old name still works
    assert code == 0 and out2 == out

    code, _, err = run(capsys, "inspect", str(root / "step-00000040"))
    assert code == 1 and "incomplete" in err and "never committed" in err
    assert run(capsys, "inspect", str(tmp_path / "nothing"))[0] == 2
    _flip_data_byte(root / "step-00000020")
    assert run(capsys, "inspect", str(root / "step-00000020"))[0] == 0  # the manifest alone: no data read


def test_verify_good_damaged_incomplete_missing(root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "verify", str(root / "step-00000010"), "--json")
    assert code == 0 and json.loads(out)["ok"] is True
    fname = _flip_data_byte(root / "step-00000020")
    code, out, _ = run(capsys, "verify", str(root / "step-00000020"), "--json")
    doc = json.loads(out)
    assert code == 1 and doc["ok"] is False and doc["damaged_files"] == [fname] and doc["damaged_keys"]
    code, out, _ = run(capsys, "verify", str(root / "step-00000020"))
    assert code == 1 and out.startswith("DAMAGED")
    assert run(capsys, "verify", str(root / "step-00000040"))[0] == 1
    assert run(capsys, "verify", str(tmp_path / "nothing"))[0] == 2


def test_diff_reports_keys_shapes_and_max_difference(root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a, b = str(root / "step-00000010"), str(root / "step-00000030")
    code, out, _ = run(capsys, "diff", a, a)
    assert code == 0 and "identical" in out
    code, out, _ = run(capsys, "diff", a, b, "--json")
    doc = json.loads(out)
    assert code == 1 and doc["identical"] is False
    assert doc["added"] == ["model/extra"] and doc["removed"] == []
    assert doc["changed"] == {"model/w": "max |a - b| = 20", "step": "10 -> 30"}
    assert doc["max_abs_diff"] == {"model/b": 0.0, "model/w": pytest.approx(20.0, abs=1e-5)}
    code, out, _ = run(capsys, "diff", b, a)
    assert code == 1 and "- model/extra" in out and "~ model/w: max |a - b| = 20" in out
    assert run(capsys, "diff", a, b, "--atol", "25", "--json")[0] == 1  # still: a key added, a value changed

    shardpoint.save({"model": {"w": torch.zeros(3, 4, dtype=torch.float64), "b": torch.zeros(3)}, "step": 10, "name": "run"},
                    tmp_path / "other")
    code, out, _ = run(capsys, "diff", a, str(tmp_path / "other"))
    assert code == 1 and "~ model/w: float32[4, 3] -> float64[3, 4]" in out

    _flip_data_byte(root / "step-00000020")
    code, _, err = run(capsys, "diff", a, str(root / "step-00000020"))
    assert code == 1 and "damaged" in err
    assert run(capsys, "diff", a, str(root / "step-00000040"))[0] == 1
    assert run(capsys, "diff", a, str(tmp_path / "nothing"))[0] == 2


def test_prune_dry_run_then_for_real(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "prune", str(root), "--keep-last", "1", "--dry-run")
    assert code == 0
    assert "would remove step-00000010" in out and "would remove step-00000020" in out and "step-00000030" not in out
    assert "left 1 incomplete folder(s) alone (steps [40])" in out
    assert sorted(os.listdir(root)) == ["latest", "owners", "step-00000010", "step-00000020", "step-00000030", "step-00000040"]

    code, out, _ = run(capsys, "prune", str(root), "--keep-last", "1", "--keep-every", "20")
    assert code == 0 and "removed step-00000010" in out and "kept 2 committed checkpoint(s): steps [20, 30]" in out
    assert sorted(os.listdir(root)) == ["latest", "owners", "step-00000020", "step-00000030", "step-00000040"]
    code, out, _ = run(capsys, "prune", str(root), "--keep-last", "2", "--incomplete")
    assert code == 0 and "removed step-00000040 (incomplete" in out
    assert shardpoint.CheckpointManager(root).latest().step == 30
    assert run(capsys, "prune", str(root), "--keep-last", "0")[0] == 2


def test_convert_forms_and_their_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = torch.nn.Linear(3, 2)
    torch.save({"model": model.state_dict(), "iter_num": 3}, tmp_path / "ckpt.pt")
    code, out, _ = run(capsys, "convert", "--from", "torch", str(tmp_path / "ckpt.pt"), str(tmp_path / "sp"))
    assert code == 0 and "converted" in out
    assert shardpoint.load_full(tmp_path / "sp")["iter_num"] == 3

    code, out, _ = run(capsys, "convert", "--to", "hf", str(tmp_path / "sp"), str(tmp_path / "hf"), "--rename", "=linear.")
    assert code == 0 and "model.safetensors" in out
    from safetensors.torch import load_file

    assert sorted(load_file(tmp_path / "hf" / "model.safetensors")) == ["linear.bias", "linear.weight"]
    code, out, _ = run(capsys, "convert", "--to", "hf", str(tmp_path / "sp"), str(tmp_path / "hf"), "--max-shard-size", "30B")
    assert code == 0 and sorted(os.listdir(tmp_path / "hf")) == [
        "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "model.safetensors.index.json"]
    run(capsys, "convert", "--to", "hf", str(tmp_path / "sp"), str(tmp_path / "hf"), "--rename", "=linear.")
    code, _, _ = run(capsys, "convert", "--from", "hf", str(tmp_path / "hf"), str(tmp_path / "sp2"), "--rename", "linear.=")
    assert code == 0
    assert torch.equal(shardpoint.load_full(tmp_path / "sp2")["model"]["weight"], model.weight.detach())

    assert run(capsys, "convert", "--to", "dcp", str(tmp_path / "sp"), str(tmp_path / "dcp"))[0] == 0
    assert run(capsys, "convert", "--from", "dcp", str(tmp_path / "dcp"), str(tmp_path / "sp3"))[0] == 0
    assert shardpoint.load_full(tmp_path / "sp3")["iter_num"] == 3
    code, _, err = run(capsys, "convert", "--to", "dcp", str(tmp_path / "sp"), str(tmp_path / "dcp"))
    assert code == 2 and "--overwrite" in err
    code, _, err = run(capsys, "convert", "--from", "torch", str(tmp_path / "ckpt.pt"), str(tmp_path / "sp"))
    assert code == 2 and "already exists" in err

    code, _, err = run(capsys, "convert", "--to", "hf", "--dtype", "floaty", str(tmp_path / "sp"), str(tmp_path / "x"))
    assert code == 2 and "floating-point dtype such as bfloat16" in err
    code, _, err = run(capsys, "convert", "--to", "hf", "--max-shard-size", "5 parsecs", str(tmp_path / "sp"), str(tmp_path / "x"))
    assert code == 2 and "write it like 5GB" in err
    code, _, err = run(capsys, "convert", "--from", "torch", "--to", "hf", str(tmp_path / "ckpt.pt"), str(tmp_path / "x"))
    assert code == 2 and "one side of convert is shardpoint" in err
    torch.save({"opt": torch.optim.SGD(model.parameters(), lr=0.1)}, tmp_path / "pickled.pt")
    code, _, err = run(capsys, "convert", "--from", "torch", str(tmp_path / "pickled.pt"), str(tmp_path / "sp4"))
    assert code == 2 and "needs pickled code" in err and "torch.optim.sgd.SGD" in err
    (tmp_path / "evil").mkdir()
    marker = tmp_path / "ran"
    (tmp_path / "evil" / ".metadata").write_bytes(
        b"cposix\nsystem\n(V" + f"touch {marker}".encode() + b"\ntR.")  # os.system("touch ...") when unpickled
    code, _, err = run(capsys, "convert", "--from", "dcp", str(tmp_path / "evil"), str(tmp_path / "sp5"))
    assert code == 2 and "refusing to unpickle posix.system" in err and not marker.exists()
    with pytest.raises(SystemExit) as e:
        main(["convert", "--from", "zip", "a", "b"])
    assert e.value.code == 2


@pytest.mark.parametrize("cmd", ["ls", "inspect", "verify", "diff", "prune", "convert"])
def test_every_command_has_help_with_an_example(cmd: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main([cmd, "--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0
    assert "example" in out and f"shardpoint {cmd}" in out


def test_runs_as_a_module_and_usage_errors_exit_2() -> None:
    run_ = subprocess.run([sys.executable, "-m", "shardpoint.cli", "inspect"], capture_output=True, text=True,
                          timeout=60, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    assert run_.returncode == 2 and "the following arguments are required: path" in run_.stderr


def _stderr_on_a_terminal(argv: list[str]) -> tuple[int, str]:
    import pty
    import select

    master, slave = pty.openpty()
    p = subprocess.Popen([sys.executable, "-m", "shardpoint.cli", *argv], stdout=subprocess.DEVNULL, stderr=slave,
                         cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT / "src"), "COLUMNS": "120"})
    os.close(slave)
    chunks = []
    try:
        while True:
            r, _, _ = select.select([master], [], [], 60)
            if not r:
                break
            try:
                data = os.read(master, 4096)
            except OSError:  # the child closed its end
                break
            if not data:
                break
            chunks.append(data)
    finally:
        os.close(master)
    return p.wait(timeout=60), b"".join(chunks).decode(errors="replace")


def test_progress_bar_on_a_terminal_only_and_quiet_silences_it(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    shardpoint.save({"model": {f"w{i}": torch.randn(64, 64) for i in range(4)}}, tmp_path / "sp")
    code, err = _stderr_on_a_terminal(["convert", "--to", "hf", str(tmp_path / "sp"), str(tmp_path / "a")])
    assert code == 0 and "exporting" in err and "65.5" in err, err  # bytes done, drawn by rich
    code, err = _stderr_on_a_terminal(["convert", "--to", "hf", "-q", str(tmp_path / "sp"), str(tmp_path / "b")])
    assert code == 0 and err == ""
    # not a terminal: nothing on stderr without --quiet either
    out = subprocess.run([sys.executable, "-m", "shardpoint.cli", "convert", "--to", "hf", str(tmp_path / "sp"),
                          str(tmp_path / "c")], capture_output=True, text=True, timeout=60, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    assert out.returncode == 0 and out.stderr == ""
