"""Loading never executes anything from the checkpoint. A directory that also holds
pickle payloads where other loaders look (DCP's ``.metadata``, ``data.pkl``,
``torch.save`` files, a pickled ``latest``), or a manifest that names a pickle as a
data file: ``load``, ``load_full``, ``metadata`` and ``verify`` return or raise a
``ShardpointError``, and the payload, which would create a marker file when
unpickled, never runs. The reads run in a sandbox worker in which every unpickling
entry point (``pickle.load(s)``, ``pickle.Unpickler``, ``torch.load``) raises."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import shardpoint
from tests.failure._sandbox import Sandbox
from tests.failure._util import manifest, sealed

PAYLOAD_NAMES = [".metadata", "data.pkl", "__0_0.distcp", "model.pt", "mp_rank_00_model_states.pt", "latest"]


class Payload:
    """Unpickling this runs ``touch MARKER``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (os.system, (f"touch {self.marker}",))


@pytest.fixture(scope="module")
def sandbox() -> Iterator[Sandbox]:
    box = Sandbox(timeout=20.0)
    box.forbid_unpickling()
    yield box
    box.close()


@pytest.fixture
def marker(tmp_path: Path) -> Path:
    return tmp_path / "PWNED"


def plant(directory: Path, marker: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for name in PAYLOAD_NAMES:
        if name.endswith(".pt"):
            torch.save(Payload(marker), directory / name)
        else:
            (directory / name).write_bytes(pickle.dumps(Payload(marker)))


def test_payload_runs_when_unpickled(tmp_path: Path, marker: Path) -> None:
    """Control: the payload really creates the marker when something unpickles it,
    so its absence below means it never ran."""
    plant(tmp_path / "ckpt", marker)
    code = f"import pickle; pickle.load(open({str(tmp_path / 'ckpt' / 'data.pkl')!r}, 'rb'))"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    assert marker.exists()


def _assert_clean(results: dict, marker: Path) -> None:
    for call, r in results.items():
        assert r["ok"] or r["shardpoint"], f"{call} raised {r['type']}:\n{r['traceback']}"
    assert not marker.exists(), "the pickle payload ran"


def test_pickles_beside_a_good_checkpoint(sample: Path, marker: Path, sandbox: Sandbox) -> None:
    plant(sample, marker)
    results = sandbox.run(str(sample))
    _assert_clean(results, marker)
    assert all(r["ok"] for r in results.values())
    assert results["load"]["loaded"] == ["model/b", "model/big", "model/w", "rng/seed", "step"]
    assert results["verify"]["verified"]


def test_pickles_without_a_manifest(tmp_path: Path, marker: Path, sandbox: Sandbox) -> None:
    plant(tmp_path / "ckpt", marker)
    results = sandbox.run(str(tmp_path / "ckpt"))
    _assert_clean(results, marker)
    assert {r["type"] for r in results.values()} == {"CheckpointNotFoundError"}


@pytest.mark.parametrize("target", ["data.pkl", "model.pt", ".metadata"])
@pytest.mark.parametrize("verify", [True, False])
def test_manifest_names_a_pickle_as_data(sample: Path, marker: Path, sandbox: Sandbox, target: str, verify: bool) -> None:
    """The pickle's bytes are read as raw tensor bytes (failing their checksum, or
    lying past its end), never unpickled, checksums or not."""
    plant(sample, marker)
    m = manifest(sample)
    old = sorted(m["files"])[0]
    m["files"][target] = m["files"].pop(old)
    text = json.dumps(m).replace(json.dumps(old), json.dumps(target))
    (sample / "manifest.json").write_bytes(sealed(text))
    results = sandbox.run(str(sample), verify=verify)
    _assert_clean(results, marker)
    assert not results["load_full"]["ok"] and results["load_full"]["type"] == "CorruptCheckpointError"
    assert results["verify"]["ok"] and not results["verify"]["verified"]


def test_manifest_is_a_pickle(sample: Path, marker: Path, sandbox: Sandbox) -> None:
    (sample / "manifest.json").write_bytes(pickle.dumps(Payload(marker)))
    results = sandbox.run(str(sample))
    _assert_clean(results, marker)
    assert {results[c]["type"] for c in ("load", "load_full", "metadata")} == {"CorruptCheckpointError"}


def test_manager_ignores_pickles(tmp_path: Path, marker: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A manager root full of pickles (a pickled ``latest`` included) has no
    checkpoint, and nothing is unpickled finding that out."""
    def refuse(*_a, **_k):  # type: ignore[no-untyped-def]
        raise AssertionError("unpickling attempted")

    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "loads", refuse)
    monkeypatch.setattr(torch, "load", refuse)
    plant(tmp_path / "root", marker)
    plant(tmp_path / "root" / "step-00000005", marker)
    mgr = shardpoint.CheckpointManager(tmp_path / "root")
    assert mgr.latest() is None and mgr.list() == [] and not mgr.has_checkpoint()
    assert mgr.restore({"x": torch.zeros(1)}) is None
    assert not marker.exists()
