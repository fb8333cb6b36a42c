"""Fixtures of the failure tests: a fresh copy of the sample checkpoint per test,
and a sandbox worker that runs read calls with a hard time bound."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.failure._sample import write_sample
from tests.failure._sandbox import Sandbox


@pytest.fixture(scope="session")
def _sample_master(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("sample") / "ckpt"
    write_sample(str(path))
    return path


@pytest.fixture
def sample(_sample_master: Path, tmp_path: Path) -> Path:
    """A good two-rank checkpoint of its own for this test to damage."""
    dst = tmp_path / "ckpt"
    shutil.copytree(_sample_master, dst)
    return dst


@pytest.fixture(scope="module")
def sandbox() -> Iterator[Sandbox]:
    box = Sandbox(timeout=20.0)
    yield box
    box.close()
