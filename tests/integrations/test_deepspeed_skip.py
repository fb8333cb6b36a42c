"""Where DeepSpeed cannot be imported the DeepSpeed tests skip, saying why; under
``CI=true`` they fail instead, so a CI image without DeepSpeed cannot pass silently."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(tmp_path: Path, ci: str | None) -> subprocess.CompletedProcess[str]:
    fake = tmp_path / "fake" / "deepspeed"
    fake.mkdir(parents=True, exist_ok=True)
    (fake / "__init__.py").write_text("raise ImportError('no DeepSpeed on this machine')\n")
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    env["PYTHONPATH"] = os.pathsep.join([str(fake.parent), str(ROOT)])
    if ci is not None:
        env["CI"] = ci
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", str(ROOT / "tests/interop/test_deepspeed_import.py")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )


@pytest.mark.timeout(150)
def test_missing_deepspeed_skips_visibly_but_fails_under_ci(tmp_path: Path) -> None:
    skipped = _run(tmp_path, None)
    assert skipped.returncode in (0, 5), skipped.stdout[-2000:]  # 5: every test of the module skipped
    assert "SKIPPED" in skipped.stdout and "deepspeed cannot be imported" in skipped.stdout, skipped.stdout[-2000:]

    failed = _run(tmp_path, "true")
    assert failed.returncode not in (0, 5)
    assert "CI=true and deepspeed cannot be imported" in failed.stdout, failed.stdout[-2000:]
