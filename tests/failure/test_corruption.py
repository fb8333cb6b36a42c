"""Damaged data is always detected and named: a flipped bit, a truncated file and a
missing file make ``load`` and ``load_full`` raise ``CorruptCheckpointError``
naming the file and the key, and ``verify`` reports exactly the damaged keys and
files; a good checkpoint verifies OK."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import shardpoint
from shardpoint import CheckpointNotFoundError, CorruptCheckpointError
from shardpoint.format.datafile import CRC_BLOCK
from shardpoint.verify import main as verify_main
from shardpoint.verify import verify
from tests.failure._sample import expected, template
from tests.failure._util import as_v1, chunks, files_with, flip_bit, sealed


def _all_chunk_bytes(path: Path) -> int:
    return sum(sum(c["length"] for c in chunks(path, k)) for k in ("model/w", "model/b", "model/big")) + sum(
        c["length"] for r in (0, 1) for c in chunks(path, "rng/seed", r)
    )


def assert_equal_nested(a, b) -> None:  # type: ignore[no-untyped-def]
    assert type(a) is type(b) or (isinstance(a, dict) and isinstance(b, dict)), (a, b)
    if isinstance(a, dict):
        assert set(a) == set(b)
        for k in a:
            assert_equal_nested(a[k], b[k])
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b)
    else:
        assert a == b


def test_good_checkpoint_verifies_and_loads(sample: Path, capsys: pytest.CaptureFixture[str]) -> None:
    res = verify(sample)
    assert res.ok and res.problems == [] and res.unlisted == []
    assert res.tensors == 5  # w, b, big, and rng/seed of each of the two ranks
    assert res.checked_bytes == _all_chunk_bytes(sample)
    assert_equal_nested(shardpoint.load_full(sample), expected())
    assert verify_main([str(sample)]) == 0
    assert capsys.readouterr().out.startswith(f"OK: 5 tensors, {res.checked_bytes} bytes verified")


# (key, rank of a per-rank value, which byte of the chunk to flip)
FLIPS = [
    ("model/w", None, "middle"),
    ("model/b", None, "first"),
    ("model/big", None, "second block"),
    ("rng/seed", 1, "last"),
]


@pytest.mark.parametrize(("key", "rank", "where"), FLIPS, ids=[f"{k}-{w}" for k, _, w in FLIPS])
def test_flipped_bit_is_named(sample: Path, key: str, rank: int | None, where: str,
                              capsys: pytest.CaptureFixture[str]) -> None:
    c = chunks(sample, key, rank)[-1]
    at = {"middle": c["length"] // 2, "first": 0, "last": c["length"] - 1, "second block": CRC_BLOCK + 17}[where]
    assert at < c["length"]
    flip_bit(sample / c["file"], c["offset"] + at)

    calls = [lambda: shardpoint.load_full(sample)]
    if rank in (None, 0):  # a one-process load restores rank 0's per-rank values only, and reads only those
        calls.append(lambda: shardpoint.load(template(), sample))
    for call in calls:
        with pytest.raises(CorruptCheckpointError) as ei:
            call()
        assert c["file"] in str(ei.value) and repr(key) in str(ei.value)
        assert "checksum" in str(ei.value)

    res = verify(sample)
    assert not res.ok
    assert res.damaged_keys == [key] and res.damaged_files == [c["file"]]
    assert res.problems[0].rank == rank and "checksum mismatch" in res.problems[0].reason
    assert verify_main([str(sample)]) == 1
    out = capsys.readouterr().out
    assert out.startswith("DAMAGED:") and f"damaged keys: {key}" in out and f"damaged files: {c['file']}" in out

    # control: without verification the flip goes through, so the checks above are what caught it
    got = shardpoint.load_full(sample, verify=False)
    want = expected()
    if rank is None:
        a, b = key.split("/")
        assert not torch.equal(got[a][b], want[a][b])
    else:
        assert not torch.equal(got["rng"][rank]["seed"], want["rng"][rank]["seed"])


def test_truncated_file_is_named(sample: Path) -> None:
    f = chunks(sample, "model/big")[-1]["file"]  # rank 1's file
    in_file = files_with(sample)[f]
    assert in_file == ["model/big", "model/w", "rng/seed"]
    # big, w, then its rng: longest first, as none is a multiple of 64 bytes (docs/format.md, section 4)
    placed = sorted((c["offset"], c["offset"] + c["length"], key) for key in in_file
                    for c in chunks(sample, key, rank=1 if key == "rng/seed" else None) if c["file"] == f)
    assert [key for _, _, key in placed] == ["model/big", "model/w", "rng/seed"]
    cut = (placed[1][0] + placed[1][1]) // 2  # inside the second chunk: the first stays whole
    os.truncate(sample / f, cut)

    for call in (lambda: shardpoint.load_full(sample), lambda: shardpoint.load(template(), sample)):
        with pytest.raises(CorruptCheckpointError) as ei:
            call()
        msg = str(ei.value)
        assert f in msg and ("'model/w'" in msg or "'rng/seed'" in msg), msg

    res = verify(sample)
    assert not res.ok and res.damaged_files == [f]
    # exactly the keys whose bytes lie past the cut
    assert res.damaged_keys == ["model/w", "rng/seed"]
    assert any(p.key is None and "truncated" in p.reason and str(cut) in p.reason for p in res.problems)
    assert any(p.key == "rng/seed" and p.rank == 1 for p in res.problems)


def test_file_cut_inside_its_header(sample: Path) -> None:
    f = chunks(sample, "model/w")[0]["file"]
    os.truncate(sample / f, 5)
    with pytest.raises(CorruptCheckpointError, match="model/"):
        shardpoint.load_full(sample)
    res = verify(sample)
    assert f in res.damaged_files and "too short to hold a safetensors header" in str(res.problems)
    assert set(res.damaged_keys) == set(files_with(sample)[f])


def test_missing_file_is_named(sample: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = chunks(sample, "model/b")[0]["file"]
    os.remove(sample / f)
    for call in (lambda: shardpoint.load_full(sample), lambda: shardpoint.load(template(), sample)):
        with pytest.raises(CorruptCheckpointError) as ei:
            call()
        msg = str(ei.value)
        assert f in msg and "missing" in msg and any(repr(k) in msg for k in files_with(sample)[f]), msg
    res = verify(sample)
    assert res.damaged_files == [f]
    assert res.damaged_keys == files_with(sample)[f] == ["model/b", "model/big", "model/w", "rng/seed"]
    assert any(p.key is None and p.reason == "the file is missing" for p in res.problems)
    assert verify_main([str(sample)]) == 1
    assert f"damaged files: {f}" in capsys.readouterr().out


def test_damaged_manifest_is_reported(sample: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = (sample / "manifest.json").read_bytes()
    (sample / "manifest.json").write_bytes(data[: len(data) // 2])
    with pytest.raises(CorruptCheckpointError, match="manifest.json"):
        shardpoint.load_full(sample)
    res = verify(sample)
    assert not res.ok and res.damaged_files == ["manifest.json"] and res.damaged_keys == []
    assert verify_main([str(sample)]) == 1
    assert "manifest.json" in capsys.readouterr().out


def test_safetensors_header_longer_than_file(sample: Path) -> None:
    """The header length is not covered by a CRC; verify still catches a bad one.
    The tensor bytes are intact, so a load (which trusts the manifest's offsets)
    still returns them exactly."""
    f = chunks(sample, "model/w")[0]["file"]
    with open(sample / f, "r+b") as fh:
        fh.write((1 << 40).to_bytes(8, "little"))
    res = verify(sample)
    assert res.damaged_files == [f] and "header claims" in str(res.problems)
    assert_equal_nested(shardpoint.load_full(sample), expected())


def test_no_manifest_is_not_found(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "r00000-x.safetensors").write_bytes(b"\0" * 16)
    with pytest.raises(CheckpointNotFoundError):
        verify(tmp_path)
    assert verify_main([str(tmp_path)]) == 2
    assert "no checkpoint" in capsys.readouterr().err


def test_unlisted_file_is_a_note_not_damage(sample: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (sample / "r00003-leftover.safetensors").write_bytes(b"junk")
    res = verify(sample)
    assert res.ok and res.unlisted == ["r00003-leftover.safetensors"]
    assert verify_main([str(sample)]) == 0
    assert "not named by the manifest" in capsys.readouterr().out


def test_manifest_chunk_not_in_header_is_reported(sample: Path) -> None:
    """A manifest that moves a chunk onto other bytes of its file (same length, so
    the read itself works) is caught by the header cross-check and the CRC."""
    m = as_v1(sample)  # moves a chunk in a version 1 manifest (version 2 keeps offsets in digest-checked indexes)
    c = m["entries"]["model/b"]["chunks"][0]
    c["offset"] -= 4
    (sample / "manifest.json").write_bytes(sealed(m))
    res = verify(sample)
    assert res.damaged_keys == ["model/b"] and "does not declare" in str(res.problems)
    with pytest.raises(CorruptCheckpointError, match="model/b"):
        shardpoint.load_full(sample)


def test_shardpoint_verify_command(sample: Path) -> None:
    """The command line: exit 0 and ``OK: ...`` on a good checkpoint; exit 1 naming
    the damaged key and file on a damaged one."""
    import subprocess
    import sys

    def run() -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "shardpoint.cli", "verify", str(sample)],
                              capture_output=True, text=True, timeout=120)

    good = run()
    assert good.returncode == 0 and good.stdout.startswith("OK: 5 tensors"), good
    c = chunks(sample, "model/w")[0]
    flip_bit(sample / c["file"], c["offset"] + 5)
    bad = run()
    assert bad.returncode == 1, bad
    assert "damaged keys: model/w" in bad.stdout and f"damaged files: {c['file']}" in bad.stdout
