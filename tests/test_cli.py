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


# -- issue 33, item 2: honest tools -------------------------------------------------------------------
def _flip_manifest(folder: Path) -> None:
    """Flip one byte inside a manifest's JSON: its seal no longer matches."""
    f = folder / "manifest.json"
    raw = bytearray(f.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    f.write_bytes(bytes(raw))


def _strict_json(text: str) -> Any:  # Any: a JSON document
    def refuse(c: str) -> None:
        raise ValueError(f"not JSON: {c}")

    return json.loads(text, parse_constant=refuse)


def test_ls_shows_a_damaged_manifest_as_damaged_and_still_lists_everything(
        root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _flip_manifest(root / "step-00000010")
    code, out, err = run(capsys, "ls", str(root), "--json")
    assert code == 0 and err == ""
    rows = {r["step"]: r for r in _strict_json(out)}
    assert [(s, r["status"]) for s, r in rows.items()] == [
        (10, "damaged"), (20, "committed"), (30, "committed"), (40, "incomplete")]
    assert rows[10]["time"] is None and rows[10]["size"] is None and rows[10]["world_size"] is None
    assert "checksum mismatch" in rows[10]["damaged"] and rows[20]["damaged"] is None
    code, out, _ = run(capsys, "ls", str(root))
    assert code == 0 and "1970" not in out
    assert any(ln.split()[:1] == ["10"] and "DAMAGED" in ln for ln in out.splitlines()), out
    assert "step-00000010 is DAMAGED: manifest.json: checksum mismatch" in out

    # the newest one damaged: still a table of every step, exit 0 (it was: no table, exit 1)
    _flip_manifest(root / "step-00000030")
    code, out, err = run(capsys, "ls", str(root))
    assert code == 0 and err == ""
    for step, status in ((10, "DAMAGED"), (20, "committed"), (30, "DAMAGED"), (40, "incomplete")):
        assert any(ln.split()[:1] == [str(step)] and status in ln for ln in out.splitlines()), out
    assert "step-00000030 is DAMAGED" in out and "(`latest` names it)" in out
    rows = {r["step"]: r for r in _strict_json(run(capsys, "ls", str(root), "--json")[1])}
    assert rows[30]["status"] == "damaged" and rows[30]["latest"] is True
    # what the manager says, the tool says
    assert {i.step for i in shardpoint.CheckpointManager(root).list() if i.damaged} == {10, 30}

    (root / "latest").write_bytes(b'{"seal": "00", "latest": "step-00000020"}')  # a damaged pointer
    code, out, _ = run(capsys, "ls", str(root))
    assert code == 0 and "latest is damaged" in out and "<- latest" not in out


def test_ls_json_is_strict_json_and_health_is_per_row(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    mgr = shardpoint.CheckpointManager(tmp_path)
    mgr.save({"model": {"w": torch.ones(3)}}, 1, metrics={"loss": 2.5})
    poisoned = torch.ones(3)
    poisoned[1] = float("nan")
    mgr.save({"model": {"w": poisoned}}, 2, metrics={"loss": float("nan"), "gnorm": float("inf")})
    code, out, _ = run(capsys, "ls", str(tmp_path), "--json")
    assert code == 0
    assert "NaN" not in out and "Infinity" not in out
    rows = {r["step"]: r for r in _strict_json(out)}
    assert rows[1]["metrics"] == {"loss": 2.5} and rows[1]["healthy"] is True and rows[1]["nonfinite"] == []
    assert rows[2]["metrics"] == {"loss": None, "gnorm": None}
    assert rows[2]["healthy"] is False and rows[2]["unfit"] == ["model/w"] and rows[2]["nan"] == ["model/w"]
    code, out, _ = run(capsys, "ls", str(tmp_path))
    line = next(ln for ln in out.splitlines() if ln.split()[:1] == ["2"])
    assert "UNFIT: NaN in model/w" in line and "loss=nan" in line, out
    assert "restore passes over it" in out


def _closed_pipe(argv: list[str]) -> subprocess.CompletedProcess[bytes]:
    """Run the command with stdout a pipe whose reader is already gone (`| head` that has had enough)."""
    r, w = os.pipe()
    os.close(r)
    try:
        return subprocess.run([sys.executable, "-m", "shardpoint.cli", *argv], stdout=w, stderr=subprocess.PIPE,
                              timeout=120, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    finally:
        os.close(w)


def test_a_closed_pipe_ends_the_output_quietly(root: Path) -> None:
    for argv in (["ls", str(root), "--json"], ["ls", str(root)], ["inspect", str(root / "step-00000010")]):
        done = _closed_pipe(argv)
        assert done.returncode == 0 and done.stderr == b"", (argv, done)
    _flip_data_byte(root / "step-00000020")
    done = _closed_pipe(["verify", str(root / "step-00000020")])
    assert done.returncode == 1 and done.stderr == b"", done  # the verdict stands


@pytest.mark.parametrize("columns", [100, 80, 50])
def test_ls_fits_the_width_it_is_given(root: Path, columns: int, monkeypatch: pytest.MonkeyPatch,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    _flip_manifest(root / "step-00000010")
    monkeypatch.setenv("COLUMNS", str(columns))
    code, out, _ = run(capsys, "ls", str(root))
    assert code == 0
    assert max(len(ln.rstrip()) for ln in out.splitlines()) <= columns, out
    for step, status in ((10, "DAMAGED"), (20, "committed"), (30, "committed"), (40, "incomplete")):
        assert any(_is_row_of(ln, step) and status in ln for ln in out.splitlines()), out
    assert "latest" in out


def _is_row_of(line: str, step: int) -> bool:
    """The line is the row (or, too narrow for a table, the line) of ``step``."""
    words = line.replace(":", " ").split()
    return words[:1] == [str(step)] or words[:2] == ["step", str(step)]


def test_ls_understands_trainer_output_folders(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    def state(step: int) -> dict[str, Any]:
        return {"model": {"w": torch.full((3,), float(step))}, "extra": {"lightning": {"global_step": step}}}

    # the HF Trainer: output_dir/checkpoint-N (integrations/transformers.py); one in its own format beside them
    hf = tmp_path / "hf_out"
    for step in (500, 1000):
        shardpoint.save(state(step), hf / f"checkpoint-{step}")
    (hf / "checkpoint-1500").mkdir()
    (hf / "checkpoint-1500" / "model.safetensors").write_bytes(b"\0" * 8)
    (hf / "runs").mkdir()  # TensorBoard's folder: not a checkpoint, not listed
    code, out, _ = run(capsys, "ls", str(hf), "--json")
    assert code == 0
    assert [(r["step"], r["name"], r["status"]) for r in _strict_json(out)] == [
        (500, "checkpoint-500", "committed"), (1000, "checkpoint-1000", "committed"),
        (1500, "checkpoint-1500", "not shardpoint")]
    code, out, _ = run(capsys, "ls", str(hf))
    assert "checkpoint-1000" in out and "committed" in out and "no step-" not in out

    # Lightning: default_root_dir/lightning_logs/version_0/checkpoints/{epoch=0-step=100,last}.ckpt folders
    ckpts = tmp_path / "pl" / "lightning_logs" / "version_0" / "checkpoints"
    shardpoint.save(state(100), ckpts / "epoch=0-step=100.ckpt")
    shardpoint.save(state(150), ckpts / "last.ckpt")
    code, out, _ = run(capsys, "ls", str(tmp_path / "pl"), "--json")
    assert [(r["step"], r["name"], r["status"]) for r in _strict_json(out)] == [
        (100, "lightning_logs/version_0/checkpoints/epoch=0-step=100.ckpt", "committed"),
        (150, "lightning_logs/version_0/checkpoints/last.ckpt", "committed")]  # last.ckpt: the step it saved
    code, out, _ = run(capsys, "ls", str(tmp_path / "pl"))
    assert "epoch=0-step=100.ckpt" in out and "last.ckpt" in out

    # Accelerate: save_state(accelerator, "ckpt/step_N") or its automatic checkpoints/checkpoint_N; one never committed
    acc = tmp_path / "acc"
    shardpoint.save(state(3), acc / "checkpoints" / "checkpoint_3")
    shardpoint.save(state(4), acc / "checkpoints" / "checkpoint_4")
    (acc / "checkpoints" / "checkpoint_4" / "manifest.json").unlink()
    shardpoint.save(state(5), acc / "ckpt" / "step_5")
    code, out, _ = run(capsys, "ls", str(acc), "--json")
    assert [(r["step"], r["name"], r["status"]) for r in _strict_json(out)] == [
        (3, "checkpoints/checkpoint_3", "committed"), (4, "checkpoints/checkpoint_4", "incomplete"),
        (5, "ckpt/step_5", "committed")]

    # several manager roots under one folder: each root's steps, each root's latest
    for run_name in ("a", "b"):
        mgr = shardpoint.CheckpointManager(tmp_path / "runs" / run_name / "ckpt")
        for step in (1, 2):
            mgr.save(state(step), step)
    code, out, _ = run(capsys, "ls", str(tmp_path / "runs"), "--json")
    assert [(r["name"], r["latest"]) for r in _strict_json(out)] == [
        ("a/ckpt/step-00000001", False), ("a/ckpt/step-00000002", True),
        ("b/ckpt/step-00000001", False), ("b/ckpt/step-00000002", True)]

    # one checkpoint; a folder with none; nothing at all
    code, out, _ = run(capsys, "ls", str(hf / "checkpoint-500"), "--json")
    assert [(r["step"], r["name"], r["status"]) for r in _strict_json(out)] == [(500, ".", "committed")]
    (tmp_path / "empty" / "a").mkdir(parents=True)
    code, out, _ = run(capsys, "ls", str(tmp_path / "empty"))
    assert code == 0 and "no checkpoints under" in out
    assert run(capsys, "ls", str(tmp_path / "empty"), "--json")[1].strip() == "[]"
    assert run(capsys, "ls", str(tmp_path / "nothing"))[0] == 2


def _incremental_root(tmp_path: Path) -> Path:
    """An incremental root whose retention dropped step 0; steps 2 and 3 still read its data file."""
    root = tmp_path / "inc"
    frozen = torch.randn(1000, generator=torch.Generator().manual_seed(1))
    mgr = shardpoint.CheckpointManager(root, incremental=True, keep_last=2)
    for step in range(4):
        mgr.save({"frozen": frozen, "w": torch.full((3,), float(step))}, step)
    assert not (root / "step-00000000" / "manifest.json").exists() and any((root / "step-00000000").iterdir())
    return root


def test_no_tool_advises_deleting_what_a_checkpoint_reads(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = _incremental_root(tmp_path)
    base = root / "step-00000000"
    code, out, _ = run(capsys, "ls", str(root), "--json")
    assert [(r["step"], r["status"]) for r in _strict_json(out)] == [
        (0, "referenced data only"), (2, "committed"), (3, "committed")]
    for cmd in ("verify", "inspect"):
        code, out, err = run(capsys, cmd, str(base))
        assert code == 2 and "is not a checkpoint" in err and "[2, 3] still read" in err and "Keep it" in err, err
        assert "delete" not in err and "--incomplete" not in err and "is incomplete" not in err
    code, out, _ = run(capsys, "prune", str(root), "--keep-last", "1", "--incomplete")
    assert code == 0 and "step-00000000" not in out.replace("dropped step(s) [0]", "")
    assert "kept the data of dropped step(s) [0]" in out
    assert run(capsys, "verify", str(root / "step-00000003"))[0] == 0  # what it reads is still there
    assert torch.equal(shardpoint.load_full(root / "step-00000003")["w"], torch.full((3,), 3.0))


def test_verify_and_inspect_on_a_folder_of_checkpoints(root: Path, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    # a manager root: verify checks each committed checkpoint and names the rest
    code, out, err = run(capsys, "verify", str(root))
    assert code == 0 and err == "", err
    assert out.count("OK: ") == 3 and "3 checkpoint(s) verified" in out and "3 OK" in out
    assert "not checked (not checkpoints): step-00000040 (incomplete)" in out
    fname = _flip_data_byte(root / "step-00000020")
    code, out, _ = run(capsys, "verify", str(root), "--json")
    doc = _strict_json(out)
    assert code == 1 and doc["ok"] is False
    assert [(c["name"], c["ok"]) for c in doc["checkpoints"]] == [
        ("step-00000010", True), ("step-00000020", False), ("step-00000030", True)]
    assert doc["checkpoints"][1]["damaged_files"] == [fname]
    assert doc["not_checked"] == [{"name": "step-00000040", "step": 40, "status": "incomplete"}]
    code, out, _ = run(capsys, "verify", str(root))
    assert code == 1 and "1 DAMAGED (step-00000020)" in out
    # inspect wants one checkpoint: it names them, and deletes nothing by advice
    code, _, err = run(capsys, "inspect", str(root))
    assert code == 2 and "is not a checkpoint but a CheckpointManager root of 3 checkpoint(s)" in err
    assert f"shardpoint inspect {root / 'step-00000030'}" in err
    assert "incomplete" not in err and "delete" not in err

    # an HF output_dir: the same
    hf = tmp_path / "out"
    shardpoint.save(_state(10), hf / "checkpoint-10")
    code, out, _ = run(capsys, "verify", str(hf))
    assert code == 0 and "1 checkpoint(s) verified" in out
    code, _, err = run(capsys, "inspect", str(hf))
    assert code == 2 and "checkpoint-10" in err and "delete" not in err

    # a random directory: no checkpoint, said so; not "incomplete", nothing to delete
    rnd = tmp_path / "photos"
    (rnd / "2024").mkdir(parents=True)
    (rnd / "cat.jpg").write_bytes(b"\xff\xd8")
    for cmd in ("verify", "inspect"):
        code, _, err = run(capsys, cmd, str(rnd))
        assert code == 2 and "no shardpoint checkpoint at" in err, err
        assert "incomplete" not in err and "delete" not in err and "prune" not in err
    # a folder of Hugging Face weights: which converter reads it
    (tmp_path / "gpt2").mkdir()
    (tmp_path / "gpt2" / "model.safetensors").write_bytes(b"\0" * 8)
    code, _, err = run(capsys, "inspect", str(tmp_path / "gpt2"))
    assert code == 2 and "convert --from hf" in err

    # a save that never committed, in a manager root: incomplete (1), and prune is the advice, not rm
    code, _, err = run(capsys, "verify", str(root / "step-00000040"))
    assert code == 1 and "is incomplete" in err and f"shardpoint prune {root} --incomplete" in err
    assert "delete it" not in err


def test_verify_and_inspect_show_health(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = torch.nn.Linear(3, 4)
    with torch.no_grad():
        model.weight[2, 1] = float("nan")
    shardpoint.save(shardpoint.TrainState(model=model, best=torch.tensor(float("inf"))), tmp_path / "sick")
    code, out, _ = run(capsys, "verify", str(tmp_path / "sick"))
    assert code == 0 and out.startswith("OK: ")  # the bytes are as saved: a NaN is not damage
    health = next(ln for ln in out.splitlines() if ln.startswith("health: "))
    assert health.startswith("health: UNFIT to resume from: inf in 'extra/best', NaN in 'model/weight'"), out
    assert "restore passes over it" in health
    doc = _strict_json(run(capsys, "verify", str(tmp_path / "sick"), "--json")[1])
    assert doc["health"] == {"nonfinite": ["extra/best", "model/weight"], "nan": ["model/weight"],
                             "unfit": ["model/weight"]}  # an infinity in an extra (best = inf) is a value

    code, out, _ = run(capsys, "inspect", str(tmp_path / "sick"))
    assert code == 0 and "UNFIT to resume from, NaN/inf in 2 key(s), marked [NaN] or [inf] below" in " ".join(out.split())
    leaf = {k: next(ln for ln in out.splitlines() if f"── {k}  " in ln).rstrip() for k in ("weight", "bias", "best")}
    assert leaf["weight"].endswith("whole  [NaN, unfit]"), out
    assert leaf["best"].endswith("whole  [inf]") and leaf["bias"].endswith("whole"), out
    doc = _strict_json(run(capsys, "inspect", str(tmp_path / "sick"), "--json")[1])
    assert {k: t["health"] for k, t in doc["tensors"].items()} == {
        "extra/best": "inf", "model/bias": "finite", "model/weight": "nan"}
    assert doc["unfit"] == ["model/weight"]

    shardpoint.save({"model": {"w": torch.ones(2)}}, tmp_path / "well")
    code, out, _ = run(capsys, "verify", str(tmp_path / "well"))
    assert code == 0 and "health: finite" in out


def test_version_and_quiet_everywhere(capsys: pytest.CaptureFixture[str], root: Path, tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.startswith(f"shardpoint {shardpoint.__version__} (torch ")
    step = str(root / "step-00000010")
    for argv in (["ls", str(root)], ["inspect", step], ["verify", step], ["diff", step, step],
                 ["prune", str(root), "--keep-last", "5"], ["export", step, str(tmp_path / "exp")],
                 ["convert", "--to", "hf", step, str(tmp_path / "hf"), "--prefix", ""]):
        assert main([*argv, "-q"]) == 0, argv
    assert main(["verify", "--quiet", step]) == 0


def test_progress_on_verify_and_export_on_a_terminal_only(tmp_path: Path) -> None:
    shardpoint.save({"model": {f"w{i}": torch.randn(64, 64) for i in range(4)}}, tmp_path / "sp")
    code, err = _stderr_on_a_terminal(["verify", str(tmp_path / "sp")])
    assert code == 0 and "verifying" in err and "65.5" in err, err
    code, err = _stderr_on_a_terminal(["verify", "-q", str(tmp_path / "sp")])
    assert code == 0 and err == ""
    code, err = _stderr_on_a_terminal(["export", str(tmp_path / "sp"), str(tmp_path / "copy")])
    assert code == 0 and "exporting" in err and "65." in err, err
    code, err = _stderr_on_a_terminal(["export", "--quiet", str(tmp_path / "sp"), str(tmp_path / "copy2")])
    assert code == 0 and err == ""
    out = subprocess.run([sys.executable, "-m", "shardpoint.cli", "verify", str(tmp_path / "sp")], capture_output=True,
                         text=True, timeout=60, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    assert out.returncode == 0 and out.stderr == ""


def test_prune_incomplete_alone_and_around_damage(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "prune", str(root))
    assert code == 2 and "--keep-last N" in err and "--incomplete" in err
    code, out, _ = run(capsys, "prune", str(root), "--incomplete")  # no --keep-last needed
    assert code == 0 and "removed step-00000040 (incomplete)" in out and "kept 3 committed checkpoint(s)" in out
    assert sorted(p.name for p in root.glob("step-*")) == ["step-00000010", "step-00000020", "step-00000030"]

    # a damaged manifest hides which older data it refers to: prune leaves it and what is older alone
    _flip_manifest(root / "step-00000020")
    code, out, _ = run(capsys, "prune", str(root), "--keep-last", "1")
    assert code == 0
    assert "left damaged step(s) [20] alone" in out and "left step(s) [10] alone" in out
    assert sorted(p.name for p in root.glob("step-*")) == ["step-00000010", "step-00000020", "step-00000030"]
    code, _, err = run(capsys, "prune", str(root.parent), "--keep-last", "1")
    assert code == 2 and "not a CheckpointManager root" in err


def test_convert_refuses_to_write_into_its_source(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = tmp_path / "sp"
    shardpoint.save({"model": {"w": torch.ones(2, 2)}}, src)
    before = {p.name: p.read_bytes() for p in src.iterdir()}
    for dst in (src, src / "hf", Path(str(src) + "/")):
        code, _, err = run(capsys, "convert", "--to", "hf", str(src), str(dst))
        assert code == 2 and "the destination is" in err and "Nothing was written" in err, err
    code, _, err = run(capsys, "export", str(src), str(src), "--overwrite")
    assert code == 2 and "the destination is the source itself" in err
    assert {p.name: p.read_bytes() for p in src.iterdir()} == before
    assert torch.equal(shardpoint.load_full(src)["model"]["w"], torch.ones(2, 2))


def test_convert_deepspeed_names_the_tags_there_are(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ds = tmp_path / "ds"
    for tag in ("global_step100", "global_step200"):
        (ds / tag).mkdir(parents=True)
        (ds / tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"")
    (ds / "latest").write_text("global_step200")
    code, _, err = run(capsys, "convert", "--from", "deepspeed", "--tag", "nosuch", str(ds), str(tmp_path / "out"))
    assert code == 2 and "tag 'nosuch' is not in" in err
    assert "its tags: global_step100, global_step200" in err and "latest names 'global_step200'" in err
    assert not (tmp_path / "out").exists()


def test_diff_json_is_strict_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a = torch.zeros(3)
    b = torch.zeros(3)
    b[0] = float("nan")
    shardpoint.save({"x": a, "best": float("nan")}, tmp_path / "a")
    shardpoint.save({"x": b, "best": float("nan")}, tmp_path / "b")
    code, out, _ = run(capsys, "diff", str(tmp_path / "a"), str(tmp_path / "b"), "--json")
    doc = _strict_json(out)
    assert code == 1 and doc["max_abs_diff"] == {"x": None} and "x" in doc["changed"]
    doc = _strict_json(run(capsys, "inspect", str(tmp_path / "a"), "--json")[1])
    assert doc["values"] == {"best": None}
