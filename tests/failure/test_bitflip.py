"""Every single flipped bit of a checkpoint's metadata is detected: each bit of
``manifest.json`` in turn makes ``load_full`` and ``load`` raise a
``ShardpointError`` (never a silent load, never another exception), and each bit
of a manager's ``latest`` makes ``CheckpointManager.restore`` raise one. The
safetensors header of a data file is not trusted by a load (chunks are located
and checked through the sealed manifest), so each of its bits flipped leaves the
load byte-exact.

One tiny checkpoint is reused: a byte is flipped in place and put back after each
call. The tests print how many positions they tried."""

from __future__ import annotations

import math
import os
import struct
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import shardpoint
from shardpoint.api import save_offline
from shardpoint.errors import ShardpointError
from shardpoint.format.digest import check_seal
from shardpoint.layout import FlatShard

WORLD = 2
W = torch.arange(12, dtype=torch.float32).reshape(4, 3)


def _plain(rank: int) -> dict[str, Any]:
    return {"lr": 0.1, "betas": (0.9, 0.999), "step": 3, "amsgrad": False, "foreach": None, "name": "adamw",
            "blob": b"\x00\xffsp", "big": -(2**70), "groups": [[1, 2.5, "x"], ("a", None, (True, b""))]}


def _rank_state(rank: int) -> dict[str, Any]:
    flat = W.reshape(-1)
    return {
        "model": {"w": FlatShard(flat[rank * 6 : rank * 6 + 6].clone(), (4, 3), rank * 6),
                  "b": torch.tensor([1.5, -2.0, 3.25], dtype=torch.float64)},
        "opt": _plain(rank),
        "rng": shardpoint.PerRank({"seed": torch.tensor([rank, 7]), "pos": 10 * rank}),
    }


def _expected() -> dict[str, Any]:
    return {"model": {"w": W, "b": torch.tensor([1.5, -2.0, 3.25], dtype=torch.float64)}, "opt": _plain(0),
            "rng": {r: {"seed": torch.tensor([r, 7]), "pos": 10 * r} for r in range(WORLD)}}


def _template() -> dict[str, Any]:
    return {"model": {"w": torch.zeros(4, 3), "b": torch.zeros(3, dtype=torch.float64)},
            "opt": {"lr": 0.0, "betas": (0.0, 0.0), "step": 0, "amsgrad": True, "foreach": 1, "name": "",
                    "blob": b"", "big": 0, "groups": [[0, 0.0, ""], ("", 1, (False, b"-"))]},
            "rng": shardpoint.PerRank({"seed": torch.zeros(2, dtype=torch.int64), "pos": -1})}


def _same(a: Any, b: Any) -> bool:
    """Equal values of the same types, floats bit for bit, tensors byte for byte."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    if isinstance(a, float):
        return type(b) is float and struct.pack("<d", a) == struct.pack("<d", b) or (math.isnan(a) and math.isnan(b))
    return type(a) is type(b) and a == b


def _flips(file: Path, positions: Iterator[int] | range) -> Iterator[int]:
    """Flip bit ``p % 8`` of byte ``p // 8`` of ``file`` for each ``p``, yield while
    flipped, put it back after."""
    fd = os.open(file, os.O_RDWR)
    try:
        for p in positions:
            off, bit = divmod(p, 8)
            (orig,) = os.pread(fd, 1, off)
            os.pwrite(fd, bytes([orig ^ (1 << bit)]), off)
            try:
                yield p
            finally:
                os.pwrite(fd, bytes([orig]), off)
    finally:
        os.close(fd)


def _refused(call: Callable[[], Any]) -> bool:
    """True when ``call`` raised a ShardpointError; False when it returned; any
    other exception propagates (and fails the test)."""
    try:
        call()
    except ShardpointError:
        return True
    return False


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("bitflip") / "ckpt"
    save_offline(((r, _rank_state(r)) for r in range(WORLD)), path, world_size=WORLD)
    return path


def test_the_checkpoint_loads_when_intact(ckpt: Path) -> None:
    """Control: unflipped, both calls return exactly what was saved."""
    assert _same(shardpoint.load_full(ckpt), _expected())
    state = _template()
    shardpoint.load(state, ckpt)
    want = _expected()
    assert _same(state["model"], want["model"]) and _same(state["opt"], want["opt"])
    assert _same(state["rng"].value, want["rng"][0])


def test_every_bit_of_the_manifest(ckpt: Path) -> None:
    manifest = ckpt / "manifest.json"
    size = manifest.stat().st_size
    good = manifest.read_bytes()
    assert 500 < size < 8000, f"the manifest is {size} bytes: keep the checkpoint tiny"
    tried = {"load_full": 0, "load": 0}
    silent: dict[str, list[int]] = {"load_full": [], "load": []}
    calls = {"load_full": lambda: shardpoint.load_full(ckpt), "load": lambda: shardpoint.load(_template(), ckpt)}
    t0 = time.perf_counter()
    for name, call in calls.items():
        for p in _flips(manifest, range(8 * size)):
            tried[name] += 1
            if not _refused(call):
                silent[name].append(p)
    took = time.perf_counter() - t0
    print(f"\nmanifest.json: {size} bytes; single-bit flips tried: {tried['load_full']} through load_full and "
          f"{tried['load']} through load, in {took:.1f} s")
    assert tried == {"load_full": 8 * size, "load": 8 * size}
    assert manifest.read_bytes() == good, "the flips were not all put back"
    silent_full, silent_load = silent["load_full"], silent["load"]
    assert not silent_full, f"load_full accepted the manifest with bits {silent_full[:20]} flipped"
    assert not silent_load, f"load accepted the manifest with bits {silent_load[:20]} flipped"


def test_the_error_names_the_manifest_and_the_fix(ckpt: Path) -> None:
    manifest = ckpt / "manifest.json"
    body_byte = manifest.read_bytes().index(b'"opt/lr"')  # a flip in a plain value's key
    closing_quote = check_seal(manifest.read_bytes(), "m") - 2  # the '"' after the seal's hex digits
    for where, msg in ((8 * body_byte + 1, "checksum mismatch"), (8 * 3, "no valid seal"),
                       (8 * closing_quote, "malformed")):
        for _ in _flips(manifest, [where]):
            with pytest.raises(shardpoint.CorruptCheckpointError, match=msg) as e:
                shardpoint.load_full(ckpt)
            assert "manifest.json" in str(e.value) and "restore(state, fallback=True)" in str(e.value)


def test_every_bit_of_latest(tmp_path: Path) -> None:
    mgr = shardpoint.CheckpointManager(tmp_path)
    for step in (1, 2):
        mgr.save({"w": torch.full((2,), float(step)), "step": step}, step)
    latest = tmp_path / "latest"
    size = latest.stat().st_size
    silent, tried = [], 0
    for p in _flips(latest, range(8 * size)):
        tried += 1
        state = {"w": torch.zeros(2), "step": 0}
        if not _refused(lambda: mgr.restore(state)):  # noqa: B023 - called at once
            silent.append((p, state["step"]))
    print(f"\nlatest: {size} bytes; single-bit flips tried: {tried} through CheckpointManager.restore")
    assert tried == 8 * size
    assert not silent, f"restore resumed with these (bit, step) flipped in latest: {silent[:20]}"
    state = {"w": torch.zeros(2), "step": 0}
    assert mgr.restore(state).step == 2 and state["step"] == 2


def test_control_unsealed_manifest_loads_flipped_bits(ckpt: Path, tmp_path: Path) -> None:
    """Control, showing the test above can fail: the same manifest without its seal,
    as version 1 (which has none) - some single flips load silently, some of them
    with other values."""
    import json

    from tests.failure._util import as_v1

    v1 = tmp_path / "v1"
    v1.mkdir()
    for f in ckpt.iterdir():
        (v1 / f.name).write_bytes(f.read_bytes())
    doc = as_v1(ckpt)  # version 1 lists every chunk with its offsets and CRCs, and has no seal
    (v1 / "manifest.json").write_bytes(json.dumps(doc, separators=(",", ":")).encode())
    assert _same(shardpoint.load_full(v1), _expected())
    size = (v1 / "manifest.json").stat().st_size
    silent = changed = 0
    for _ in _flips(v1 / "manifest.json", range(0, 8 * size, 7)):
        try:
            got = shardpoint.load_full(v1)
        except ShardpointError:
            continue
        silent += 1
        changed += not _same(got, _expected())
    print(f"\nunsealed version-1 manifest: {silent} of {len(range(0, 8 * size, 7))} flips loaded, {changed} with other values")
    assert silent > 0 and changed > 0


def test_data_file_header_is_not_trusted(ckpt: Path) -> None:
    """Bits of each data file's safetensors header flipped one at a time (all of
    the length prefix, a fixed sample of the JSON): the load reads chunks where the
    sealed manifest says and checks their CRCs, so it returns exactly the saved
    values (it never reads the header)."""
    import random

    want, tried, rnd = _expected(), 0, random.Random(18)
    for f in sorted(ckpt.glob("*.safetensors")):
        (n,) = struct.unpack("<Q", f.read_bytes()[:8])
        positions = list(range(64)) + sorted(rnd.sample(range(64, 8 * (8 + n)), 300))
        for _ in _flips(f, positions):
            tried += 1
            assert _same(shardpoint.load_full(ckpt), want)
    print(f"\nsafetensors headers: {tried} single-bit flips through load_full, every load exact")
    assert tried == 2 * 364


def test_verify_reports_the_seal(ckpt: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from shardpoint.verify import main, verify

    res = verify(ckpt)
    assert res.ok and res.seal == "verified" and "manifest seal: verified (crc32)" in res.summary()
    v1 = Path(__file__).parent.parent / "data" / "v1"
    assert main([str(v1)]) == 0
    assert "manifest seal: absent (format version 1 has none" in capsys.readouterr().out
    for _ in _flips(ckpt / "manifest.json", [8 * 500 + 2]):
        res = verify(ckpt)
        assert res.seal is None and res.damaged_files == ["manifest.json"]
        assert "checksum mismatch" in res.problems[0].reason
