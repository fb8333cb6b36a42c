"""Where Lightning, Accelerate or transformers cannot be imported, their tests skip
saying why; under ``CI=true`` they fail instead, so a CI image without them cannot
pass silently. (transformers needs Python >= 3.11: there its tests skip, CI or not.)"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TESTS = ["test_lightning.py", "test_accelerate.py", "test_hf_trainer.py"]


def _run(tmp_path: Path, ci: str | None) -> subprocess.CompletedProcess[str]:
    for name in ("lightning", "accelerate", "transformers"):
        fake = tmp_path / "fake" / name
        fake.mkdir(parents=True, exist_ok=True)
        (fake / "__init__.py").write_text(f"raise ImportError('no {name} on this machine')\n")
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path / "fake"), str(ROOT / "src"), str(ROOT)])
    if ci is not None:
        env["CI"] = ci
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
         *[str(ROOT / "tests/integrations" / t) for t in TESTS]],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )


@pytest.mark.timeout(300)
def test_missing_trainers_skip_visibly_but_fail_under_ci(tmp_path: Path) -> None:
    skipped = _run(tmp_path, None)
    assert skipped.returncode in (0, 5), skipped.stdout[-2000:]
    for name in ("lightning", "accelerate", "transformers"):
        assert f"{name} cannot be imported" in skipped.stdout, skipped.stdout[-2000:]

    failed = _run(tmp_path, "true")
    assert failed.returncode not in (0, 5)
    assert "CI=true and lightning cannot be imported" in failed.stdout, failed.stdout[-2000:]
    assert "CI=true and accelerate cannot be imported" in failed.stdout, failed.stdout[-2000:]
    if sys.version_info >= (3, 11):
        assert "CI=true and transformers cannot be imported" in failed.stdout, failed.stdout[-2000:]
